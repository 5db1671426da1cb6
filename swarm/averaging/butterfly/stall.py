"""When to give up on a silent peer (sans-I/O): limits derived from the rate measured so far.

A part owner times the current attempt of its part (:class:`PartTiming`): when the first byte
came, how many bytes and chunks arrived while data flowed, and when each sender completed.
:class:`StallPolicy` turns that into limits:

- a sender that is streaming is dropped after ``factor`` chunk-times of silence, a chunk-time
  being one chunk at the rate each active sender has been getting (never below ``floor_s``);
- a sender that never started is dropped after ``factor`` times the slowest completion so far
  (or the time to the first byte when nobody completed yet), never below ``floor_s``;
- before any byte arrived only the deadline applies: nothing has been measured.

The same rule bounds how long a sender waits for progress on its stream to an owner
(:meth:`StallPolicy.reply_limit`), so a frozen owner costs seconds, not the round timeout.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field


@dataclass
class PartTiming:
    """What one attempt of one part has received so far (monotonic seconds)."""

    start: float  # when the attempt began
    first_byte: float | None = None  # when its first chunk arrived
    last_byte: float = 0.0  # when its latest chunk arrived
    bytes: int = 0  # payload bytes received from every sender
    chunks: int = 0  # chunks received from every sender
    completions: list[float] = field(default_factory=list)  # seconds from start per completion

    def received(self, now: float, nbytes: int) -> None:
        if self.first_byte is None:
            self.first_byte = now
        self.last_byte = now
        self.bytes += nbytes
        self.chunks += 1

    def completed(self, now: float) -> None:
        self.completions.append(now - self.start)

    def rate(self) -> float:
        """Bytes/s over all senders while data flowed (it does not decay while all wait)."""
        elapsed = self.last_byte - (self.first_byte if self.first_byte is not None else 0.0)
        return self.bytes / elapsed if self.first_byte is not None and elapsed > 0 else 0.0

    def chunk_bytes(self) -> float:
        return self.bytes / max(1, self.chunks)


@dataclass
class StreamTiming:
    """One sender's stream of one attempt: what arrived after its first chunk, and when."""

    first: float | None = None  # when its first chunk arrived (monotonic)
    last: float = 0.0  # when its latest chunk arrived
    bytes_after_first: int = 0  # payload bytes of every chunk but the first
    chunks: int = 0
    complete: bool = False  # read to its end
    held_s: float = 0.0  # time its owner held it back between chunks (not its link's)
    # a hold counts once a chunk follows it: the hold after the last chunk waited for nothing,
    # and counted it took a fast sender's whole stream time (measured rate 0)
    _hold_s: float = field(default=0.0, init=False, repr=False)

    def held(self, seconds: float) -> None:
        """The owner held this stream back ``seconds`` before reading its next chunk."""
        self._hold_s += seconds

    def received(self, now: float, nbytes: int) -> None:
        if self.first is None:
            self.first = now
        else:
            self.bytes_after_first += nbytes
            self.held_s += self._hold_s
        self._hold_s = 0.0
        self.last = now
        self.chunks += 1

    @property
    def elapsed(self) -> float:
        return max(0.0, self.last - self.first - self.held_s) if self.first is not None else 0.0


@dataclass(frozen=True)
class StallPolicy:
    """Stall limits: ``factor`` chunk-times at the measured rate, at least ``floor_s``."""

    floor_s: float  # never give up on a peer sooner than this after its last sign of life
    factor: float  # chunk-times of silence tolerated

    def silence_limit(self, timing: PartTiming, active: int) -> float:
        """Seconds a streaming sender may stay silent, with ``active`` senders sharing the link."""
        per_sender = timing.rate() / max(1, active)
        if per_sender <= 0:
            return self.floor_s * 4  # streaming, but no rate measured yet
        return max(self.floor_s, self.factor * timing.chunk_bytes() / per_sender)

    def start_limit(self, timing: PartTiming) -> float | None:
        """Seconds from the attempt's start a sender may take to begin; None: no limit yet."""
        if timing.completions:
            return max(self.floor_s, self.factor * max(timing.completions))
        if timing.first_byte is not None:
            return max(self.floor_s, self.factor * (timing.first_byte - timing.start))
        return None

    def stalled(
        self,
        now: float,
        timing: PartTiming,
        streaming: Mapping[int, float],
        pending: Iterable[int],
    ) -> list[tuple[int, str]]:
        """The senders to drop now, each with why.

        Args:
            now: the current monotonic time.
            timing: the attempt's measurements.
            streaming: sender -> time of its last chunk (or of its stream's start).
            pending: senders that have not started streaming.
        """
        pending = list(pending)
        verdicts: list[tuple[int, str]] = []
        limit = self.silence_limit(timing, len(streaming) + len(pending))
        for sender, last in streaming.items():
            if now - last > limit:
                verdicts.append((sender, f"silent for {now - last:.1f} s (limit {limit:.1f} s)"))
        start = self.start_limit(timing)
        if start is not None and now - timing.start > start:
            verdicts.extend((s, f"never started (limit {start:.1f} s)") for s in pending)
        return verdicts

    def drops(
        self,
        now: float,
        timing: PartTiming,
        streaming: Mapping[int, float],
        pending: Iterable[int],
        *,
        deadline: float,
        gone: Collection[int] = (),
        start_by: float | None = None,
    ) -> list[tuple[int, str]]:
        """Every sender an owner drops now, each with why: all of them at the ``deadline``;
        else pending ones known ``gone`` (a refused address), else the :meth:`stalled` ones,
        else, from ``start_by`` on, every pending one (nothing else will measure a rate)."""
        pending = list(pending)
        if now >= deadline:
            return [(s, "all-reduce deadline") for s in (*streaming, *pending)]
        refused = [
            (s, "its address refused us, or the group is over there") for s in pending if s in gone
        ]
        found = refused or self.stalled(now, timing, streaming, pending)
        if not found and start_by is not None and now >= start_by:
            found = [(s, "never started; the rest of the round is over") for s in pending]
        return found

    def reply_limit(self, chunk_s: float | None) -> float:
        """Seconds a sender waits for progress on its stream to an owner (a chunk going out or
        an averaged one coming back), given the pace so far (None: none measured yet). Twice
        the owner's own limit for a silent sender at this pace, since the owner may be waiting
        on one, and never below four floors (a slower sender elsewhere sets the owner's pace)."""
        if chunk_s is None:
            return 4 * self.floor_s
        return max(4 * self.floor_s, 2 * self.factor * chunk_s)
