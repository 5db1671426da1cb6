"""Reduction of one part (sans-I/O): weighted contributions accumulated chunk by chunk.

The owner of a part starts each chunk from its own weighted values, adds every sender's decoded
chunk as it arrives (``acc += w * D(chunk)``, no temporary), and divides the chunk by the sum of
the weights of the senders that delivered it as soon as every sender has delivered it or been
dropped (:meth:`PartReducer.chunk_ready`), so the averaged chunk can go back while later chunks
still arrive. A sender whose stream breaks after some of its chunks were added *taints* the part:
its partial contribution cannot be taken back, so the owner resets the part and asks the complete
senders for their values again (:meth:`PartReducer.restart`); receivers stage averaged chunks and
apply a part only once its owner confirmed it, so nothing half-received reaches the result.

With ``aggregator="centered_clip"`` (the default) the senders' chunks are decoded into one row
each instead of being added, and a chunk is reduced by :func:`~swarm.averaging.butterfly.robust.
centered_clip` with weights capped at ``weight_cap`` times the group's median once every sender
delivered it (or was dropped); ``aggregator="mean"`` is the plain weighted mean above, for
swarms whose peers are all trusted. The rows of a chunk (one, the sum, under the mean) live in a
buffer of their own, taken from a pool when its first row arrives and given back once the
owner is done with the chunk's average (:meth:`PartReducer.release`): memory holds the chunks
in flight, not the part, and reused buffers cost no fresh pages.

The tensor work (:meth:`PartReducer.begin`, :meth:`add_chunk`, :meth:`finish_chunk`) is meant
for a worker thread; the bookkeeping methods are cheap and belong to the event loop. Work on one
chunk is serialized by a lock per chunk (a cancelled caller does not stop a running add).
"""

from __future__ import annotations

import enum
import math
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from swarm.averaging.butterfly.alignment import PartAlignment
from swarm.averaging.butterfly.echoes import PartEchoes
from swarm.averaging.butterfly.flat import ScratchRows
from swarm.averaging.butterfly.pairs import Shares, compose, pair_shares
from swarm.averaging.butterfly.robust import TRIO_RADIUS, cap_weights, centered_clip
from swarm.compression import decode_into, read_header
from swarm.config import AGGREGATORS
from swarm.errors import AveragingError, CompressionError

MAX_WEIGHT = 1e30

CLIPPED_BELOW = 0.1  # an owner whose own offset was scaled below this is the odd one out
REPORTED_BELOW = 0.5  # a sender whose offset was scaled below this is reported as clipped


def check_weight(weight: object) -> float:
    """A contribution weight: finite, >= 0 and not absurd.

    Raises:
        AveragingError: anything else.
    """
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise AveragingError(f"a weight is a number, not {type(weight).__name__}")
    w = float(weight)
    if not math.isfinite(w) or not 0 <= w <= MAX_WEIGHT:
        raise AveragingError(f"a weight must be finite and within [0, {MAX_WEIGHT:g}], got {w}")
    return w


class SenderState(enum.Enum):
    PENDING = "pending"  # nothing (complete) received yet
    STREAMING = "streaming"  # some chunks added
    COMPLETE = "complete"  # every chunk added, counted in the average
    FAILED = "failed"  # dropped: stopped, timed out, tampered, or malformed


@dataclass
class _Sender:
    weight: float
    state: SenderState = SenderState.PENDING
    next_chunk: int = 0


class PartReducer:
    """Accumulates one part's weighted mean.

    Args:
        chunks: ``(start, end)`` of every chunk, relative to the part.
        senders: the members expected to contribute (not the owner itself).
        aggregator: ``centered_clip`` or ``mean``.
        weight_cap: with ``centered_clip``, no weight counts for more than this times the median
            weight of the group.
        trust: with ``centered_clip``, sender -> the factor its claimed weight is multiplied by
            (this peer's record of it; missing: 1.0).
        score: with ``centered_clip``, measure every contribution's alignment with the robust
            mean (:attr:`alignment`; the owner's own under the key ``-1``): the part is an update.
        pairwise: the group is a pair exchanging its members' own payloads
            (:mod:`~swarm.averaging.butterfly.pairs`): the sender's payloads are kept as they
            came, for :meth:`finish_pair_chunk`.
        device: where the rows live (the owner's values').
    """

    def __init__(
        self,
        chunks: tuple[tuple[int, int], ...],
        senders: Iterable[int],
        aggregator: str = "centered_clip",
        weight_cap: float = 2.0,
        trust: Mapping[int, float] | None = None,
        score: bool = False,
        pairwise: bool = False,
        device: torch.device | str = "cpu",
    ):
        if aggregator not in AGGREGATORS:
            raise AveragingError(f"aggregator must be one of {AGGREGATORS}, not {aggregator!r}")
        self.device = torch.device(device)
        self.chunks = chunks
        self.expected = tuple(senders)
        self.robust = aggregator == "centered_clip"
        self.weight_cap = weight_cap
        self.trust = dict(trust or {})
        self.alignment = PartAlignment() if score and self.robust else None
        self.echoes: PartEchoes | None = None  # set by the owner where it keeps updates
        self.pairwise = pairwise
        self._payloads: dict[int, bytes] = {}  # pairwise: chunk -> the sender's payload
        # (radius, values) of every clipped chunk, for a test's attacker (see faults)
        self.observe_radius: Callable[[float, int], None] | None = None
        self._slots = {s: i + 1 for i, s in enumerate(self.expected)}
        # per chunk in flight: under centered_clip row 0 the owner's values, row slot(s) sender
        # s's; under the mean one row, the weighted sum; row 0 receives the average
        self._rows: dict[int, torch.Tensor] = {}
        self._spare: list[torch.Tensor] = []  # buffers of reduced chunks, for the next ones
        self._pool_lock = threading.Lock()
        self._scratch = ScratchRows(self.device)  # for the chunks of a tainted attempt
        self.clipped: dict[int, float] = {}  # sender -> smallest scale its offset got
        self.own_clipped = False  # the owner's own values were clipped: it is the odd one out
        self.capped: dict[int, float] = {}  # sender -> the weight it claimed, when capped
        self.own_weight = 0.0
        self._own: torch.Tensor | None = None
        self._senders: dict[int, _Sender] = {}
        self._locks = [threading.Lock() for _ in chunks]
        self.attempt = 0
        self.tainted = False

    # ---- tensor work (worker thread)

    def begin(self, own: torch.Tensor, own_weight: float) -> None:
        """Start from the owner's own values (the part's, read-only until the part ends)."""
        self._own, self.own_weight = own, check_weight(own_weight)

    def claimed_weights(self) -> dict[int, float]:
        """The weight each contributor claimed (the owner's own under the key ``-1``)."""
        return {-1: self.own_weight, **{s: x.weight for s, x in self._senders.items()}}

    def add_chunk(self, sender: int, index: int, payload: bytes | memoryview) -> None:
        """Add ``weight * D(payload)`` into chunk ``index`` (call :meth:`accept` first).

        Raises:
            CompressionError: malformed payload, or its size does not match the chunk.
        """
        start, end = self.chunks[index]
        header = read_header(payload, max_numel=end - start)
        if header.numel != end - start:
            raise CompressionError(f"chunk {index} holds {header.numel}, expected {end - start}")
        with self._locks[index]:
            if self.pairwise:  # checked as it came, applied by finish_pair_chunk()
                decode_into(payload, self._scratch.row(end - start), accumulate=False)
                if not self.tainted:
                    self._payloads[index] = bytes(payload)
            elif self.tainted:
                # the attempt is over, but a sender whose payload is refused must still be
                # dropped from the retry: checked into a scratch row, kept nowhere (rows
                # taken now would outlive the window, which no longer holds anyone back)
                decode_into(payload, self._scratch.row(end - start), accumulate=False)
            elif self.robust:
                row = self._chunk_rows(index)[self._slots[sender], : end - start]
                decode_into(payload, row, accumulate=False)
            else:
                row = self._chunk_rows(index)[0, : end - start]
                decode_into(payload, row, self._senders[sender].weight)

    def finish_chunk(self, index: int, total: float) -> torch.Tensor:
        """Reduce chunk ``index``; returns its average, in the chunk's rows until
        :meth:`release`. ``total`` (:meth:`chunk_total`) is the weight it holds under the plain
        mean (unused by CenteredClip).

        When the weights sum to 0 the owner's own values are restored (nothing to average).
        """
        start, end = self.chunks[index]
        if self.robust:
            return self._clip_chunk(index, start, end)
        with self._locks[index]:
            out = self._chunk_rows(index)[0, : end - start]
            if total > 0:
                out.div_(total)
            else:
                out.copy_(self._own_values()[start:end])
        return out

    def release(self, index: int) -> None:
        """The owner is done with chunk ``index``'s average: its rows go back to the pool."""
        with self._locks[index]:
            self._release_rows(index)

    def _own_values(self) -> torch.Tensor:
        if self._own is None:
            raise AveragingError("a chunk reduced before begin()")
        return self._own

    def pair_shares(self, sender: int) -> Shares:
        """Pairwise: the owner's and ``sender``'s shares of the mean, from their weights
        (``sender``'s by this owner's record of it, both capped under ``centered_clip``)."""
        claimed = self._senders[sender].weight
        if not self.robust:
            return pair_shares(self.own_weight, claimed)
        trusted = claimed * self.trust.get(sender, 1.0)
        own, theirs = cap_weights([self.own_weight, trusted], self.weight_cap)
        if theirs < trusted:
            self.capped[sender] = claimed
        return pair_shares(own, theirs)

    def finish_pair_chunk(
        self, index: int, own_payload: bytes, shares: Shares
    ) -> tuple[torch.Tensor, bytes | None]:
        """Pairwise: chunk ``index`` as both members apply it, from the owner's own payload
        and the sender's (:func:`~swarm.averaging.butterfly.pairs.compose`), in its rows until
        :meth:`release`; and the sender's payload (None: it did not deliver the chunk)."""
        start, end = self.chunks[index]
        with self._locks[index]:
            out = self._chunk_rows(index)[0, : end - start]
            theirs = self._payloads.pop(index, None) if self.delivered(index) else None
            compose(out, own_payload, theirs, shares)
        return out, theirs

    def _chunk_rows(self, index: int) -> torch.Tensor:
        """The row buffer of chunk ``index`` (call under its lock)."""
        rows = self._rows.get(index)
        if rows is None:
            with self._pool_lock:
                if self._spare:
                    rows = self._spare.pop()
                else:
                    width = max(e - s for s, e in self.chunks)
                    shape = (1 + len(self._slots) if self.robust else 1, width)
                    rows = torch.empty(shape, dtype=torch.float32, device=self.device)
            if not self.robust:  # the weighted sum starts from the owner's values
                start, end = self.chunks[index]
                torch.mul(
                    self._own_values()[start:end], self.own_weight, out=rows[0, : end - start]
                )
            self._rows[index] = rows
        return rows

    def _release_rows(self, index: int) -> None:
        rows = self._rows.pop(index, None)
        if rows is not None:
            with self._pool_lock:
                self._spare.append(rows)

    def _clip_chunk(self, index: int, start: int, end: int) -> torch.Tensor:
        own = self._own_values()
        live = sorted(self.delivered(index), key=self._slots.__getitem__)  # row order
        trusted = [self._senders[s].weight * self.trust.get(s, 1.0) for s in live]
        weights = cap_weights([self.own_weight, *trusted], self.weight_cap)
        with self._locks[index]:
            buffer = self._chunk_rows(index)
            out = buffer[0, : end - start]
            if not live or sum(weights) <= 0:
                return out.copy_(own[start:end])
            buffer[0, : end - start].copy_(own[start:end])
            slots = [0, *(self._slots[s] for s in live)]
            if len(slots) == buffer.shape[0]:  # everyone delivered: a view, no copy
                rows = buffer[:, : end - start]
            else:
                rows = buffer[torch.tensor(slots, device=buffer.device), : end - start]
            if self.echoes is not None:  # set only where alignment is measured
                self.echoes.add_chunk([-1, *live], rows, start, end)  # before the clip
            if self.alignment is None:
                clip = centered_clip(rows, weights, overwrite=True)  # the buffer is scratch
            else:
                clip = centered_clip(
                    rows, weights, overwrite=True, score=True, trio_radius=TRIO_RADIUS
                )
            out.copy_(clip.center)  # row 0 is scratch once the clip is done
        if self.observe_radius is not None and clip.radius > 0:
            self.observe_radius(clip.radius, end - start)
        if self.alignment is not None and clip.dots:
            self.alignment.add_chunk(
                [-1, *live], clip.dots, clip.norms2, clip.center_norm2, clip.sides, end - start
            )
        if clip.scales[0] < CLIPPED_BELOW:  # only ever set here: chunks reduce in parallel
            self.own_clipped = True
        for sender, scale in zip(live, clip.scales[1:], strict=True):
            if scale < REPORTED_BELOW:
                self.clipped[sender] = min(scale, self.clipped.get(sender, 1.0))
        for sender, w, t in zip(live, weights[1:], trusted, strict=True):
            if w < t:
                self.capped[sender] = self._senders[sender].weight
        return out

    def restart(self) -> tuple[int, ...]:
        """Reset to the owner's values for a new attempt with the complete senders only.

        Returns the senders expected in the new attempt.
        """
        if self._own is None:
            raise AveragingError("restart() before begin()")
        self.expected = self.contributors()
        self._senders = {}
        self._payloads = {}
        for index in list(self._rows):  # chunks the tainted attempt left unreduced
            self._release_rows(index)
        self.own_clipped = False  # judged again from the new attempt's rows
        if self.alignment is not None:
            self.alignment.reset()
        if self.echoes is not None:
            self.echoes.reset()
        self.attempt += 1
        self.tainted = False
        return self.expected

    # ---- bookkeeping (event loop)

    def accept(self, sender: int, weight: float) -> None:
        """Register a sender's stream before its chunks.

        Raises:
            AveragingError: not expected in this attempt, or a second stream from it.
        """
        if sender not in self.expected:
            raise AveragingError(f"member {sender} is not expected to send this part")
        if sender in self._senders:
            raise AveragingError(f"member {sender} already sent this part (attempt {self.attempt})")
        self._senders[sender] = _Sender(check_weight(weight))

    def next_index(self, sender: int) -> int:
        """Index the next chunk from ``sender`` must have (chunks arrive in order).

        Raises:
            AveragingError: the sender is not streaming, or already sent every chunk.
        """
        s = self._senders.get(sender)
        if s is None or s.state in (SenderState.FAILED, SenderState.COMPLETE):
            raise AveragingError(f"member {sender} is not streaming this part")
        if s.next_chunk >= len(self.chunks):
            raise AveragingError(f"member {sender} sent more than {len(self.chunks)} chunks")
        return s.next_chunk

    def chunks_from(self, sender: int) -> int:
        """How many chunks ``sender`` delivered in this attempt."""
        s = self._senders.get(sender)
        return 0 if s is None else s.next_chunk

    def chunk_added(self, sender: int) -> None:
        s = self._senders[sender]
        s.state = SenderState.STREAMING
        s.next_chunk += 1

    def complete(self, sender: int) -> None:
        """The sender's stream ended cleanly.

        Raises:
            AveragingError: it ended before its last chunk.
        """
        s = self._senders.get(sender)
        if s is None or s.state is SenderState.FAILED:
            raise AveragingError(f"member {sender}'s stream is not part of this attempt")
        if s.next_chunk != len(self.chunks):
            raise AveragingError(
                f"member {sender} ended after {s.next_chunk} of {len(self.chunks)} chunks"
            )
        s.state = SenderState.COMPLETE

    def fail(self, sender: int) -> None:
        """Drop a sender; if some of its chunks were added, the part is tainted."""
        s = self._senders.setdefault(sender, _Sender(0.0))
        if s.state is SenderState.COMPLETE:
            return
        if s.next_chunk > 0:
            self.tainted = True
        s.state = SenderState.FAILED

    def state(self, sender: int) -> SenderState:
        s = self._senders.get(sender)
        return SenderState.PENDING if s is None else s.state

    def settled(self) -> bool:
        """Every expected sender is complete or failed."""
        done = (SenderState.COMPLETE, SenderState.FAILED)
        return all(self.state(s) in done for s in self.expected)

    def chunk_ready(self, index: int) -> bool:
        """Every expected sender delivered chunk ``index`` (its add may still run) or failed."""
        for x in self.expected:
            s = self._senders.get(x)
            if s is None or (s.state is not SenderState.FAILED and s.next_chunk <= index):
                return False
        return True

    def chunk_total(self, index: int) -> float:
        """The weight chunk ``index`` holds: the owner's plus that of the live senders that
        delivered it (a failed one that delivered it taints the part instead)."""
        return self.own_weight + sum(
            s.weight
            for s in self._senders.values()
            if s.state is not SenderState.FAILED and s.next_chunk > index
        )

    def delivered(self, index: int) -> tuple[int, ...]:
        """The live senders that delivered chunk ``index``."""
        return tuple(
            x
            for x, s in list(self._senders.items())  # a snapshot: worker threads call this
            if s.state is not SenderState.FAILED and s.next_chunk > index
        )

    def contributors(self) -> tuple[int, ...]:
        return tuple(s for s in self.expected if self.state(s) is SenderState.COMPLETE)

    def failed(self) -> tuple[int, ...]:
        return tuple(s for s in self.expected if self.state(s) is SenderState.FAILED)
