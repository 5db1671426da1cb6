"""The averages of one round, staged until their verdict: kept as the owners sent them.

A member applies a part only once its owner confirmed it and the average looks plausible next to
the member's own values (:mod:`~swarm.averaging.butterfly.checks`). Until then the averaged
chunks wait here *compressed*, as they came off the wire, not decoded into a float32 buffer the
size of the vector: with ``int8`` a quarter of the vector, with ``sparse`` about 1/140. Each
chunk is decoded once on arrival, into a chunk-sized scratch row (a malformed one accuses its
owner at once), to measure its distance from this member's values, and once more when the round
applies it. A codec whose payloads are as large as the values (``none``) saves nothing so: its
chunks are decoded once, into a float32 buffer the size of the vector (``into``), as before
(holding a vector of frames instead cost 22% of a 250M-value round in fresh pages). The
member's own part is staged the same way, chunk by chunk as it sends the averages out
(:meth:`StagedAverages.stage_own`, no buffer of the part's size); parts that a repair averaged
are staged as float32 values.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Iterator

import torch

from swarm.averaging.butterfly.flat import ScratchRows, write_at
from swarm.averaging.butterfly.kept import split
from swarm.averaging.butterfly.pairs import Shares, compose
from swarm.compression import Codec, decode_into, read_header
from swarm.errors import CompressionError

Range = tuple[int, int]
Pair = tuple[bytes, Shares]  # in a pair: this member's own payload of a chunk, and the shares

_SPAN = 1 << 20  # torch.dist allocates its operands' difference: 4 MiB at most, not a part


class StagedAverages:
    """The averaged parts of one round, until the round applies the accepted ones.

    Args:
        flat: this member's values (read-only during the round).
        kept: the ranges where this member kept its own values in recent rounds: distances
            there are measured apart (see :func:`~swarm.averaging.butterfly.checks.
            implausible_parts`).
        whole: parts measured whole, ``kept`` or not (their owners were accused before).
        into: a float32 buffer the size of ``flat`` to decode chunks into on arrival, instead
            of keeping their payloads (see :func:`stage_decoded`).
        codec: the name of the round's codec: averages in another are refused, so what an
            owner makes a member hold is what the round's codec makes of its values.
    """

    def __init__(
        self,
        flat: torch.Tensor,
        kept: tuple[Range, ...] = (),
        whole: Collection[int] = (),
        into: torch.Tensor | None = None,
        codec: str | None = None,
    ):
        self.flat = flat
        self.kept, self.whole = kept, frozenset(whole)
        self.into, self.codec = into, codec
        self._decoded: dict[int, list[Range]] = {}  # with ``into``: the chunks decoded there
        self._payloads: dict[int, list[tuple[int, int, bytes, Pair | None]]] = {}
        self._values: dict[int, tuple[int, torch.Tensor]] = {}
        self._unmeasured: set[int] = set()  # parts staged as values, distances not taken yet
        self._outside: dict[int, _Distance] = {}
        self._inside: dict[int, _Distance] = {}
        self._scratch = ScratchRows(flat.device)

    @property
    def staged_bytes(self) -> int:
        """Memory the staged averages hold: payload bytes plus float32 values."""
        payloads = sum(len(c[2]) for chunks in self._payloads.values() for c in chunks)
        decoded = sum(4 * (e - s) for chunks in self._decoded.values() for s, e in chunks)
        return payloads + decoded + sum(4 * v.numel() for _, v in self._values.values())

    def begin_part(self, part: int) -> None:
        """Part ``part``'s chunks start again (a new attempt): forget what came before."""
        self._payloads.pop(part, None)
        self._decoded.pop(part, None)
        self._values.pop(part, None)
        self._unmeasured.discard(part)
        self._outside.pop(part, None)
        self._inside.pop(part, None)

    def stage(
        self, part: int, start: int, end: int, payload: bytes, pair: Pair | None = None
    ) -> None:
        """Stage the averaged chunk ``[start, end)`` of ``part`` (a worker thread's work); in
        a pair (:mod:`~swarm.averaging.butterfly.pairs`), ``payload`` is the owner's own and
        ``pair`` this member's payload of the chunk and the shares of the mean.

        Raises:
            CompressionError: it does not decode to ``end - start`` values of the round's codec.
        """
        header = read_header(payload, max_numel=end - start)
        if header.numel != end - start:
            raise CompressionError(f"chunk holds {header.numel}, expected {end - start}")
        if self.codec is not None and header.codec != self.codec:
            raise CompressionError(f"chunk is {header.codec}, the round's codec is {self.codec}")
        if self.into is not None:
            got = _decode(payload, pair, self.into[start:end])
            self._measure(part, start, end, got)
            self._decoded.setdefault(part, []).append((start, end))
            return
        got = _decode(payload, pair, self._scratch.row(end - start))
        self._measure(part, start, end, got)
        self._payloads.setdefault(part, []).append((start, end, payload, pair))

    def stage_own(
        self,
        part: int,
        start: int,
        payload: bytes,
        decoded: torch.Tensor,
        pair: Pair | None = None,
    ) -> None:
        """Stage a chunk of this member's own part from ``start``: ``payload`` as it went out
        and ``decoded``, what it decodes to (chunk-sized, reused once this returns); in a pair
        whose sender delivered the chunk, ``pair`` holds the sender's payload and the shares,
        as :meth:`~swarm.averaging.butterfly.reducer.PartReducer.finish_pair_chunk` composed
        them. The same bits apply as from a member's staged chunk of the same payload."""
        end = start + decoded.numel()
        self._measure(part, start, end, decoded)
        if self.into is not None:
            self.into[start:end].copy_(decoded)
            self._decoded.setdefault(part, []).append((start, end))
        else:
            self._payloads.setdefault(part, []).append((start, end, payload, pair))

    def stage_values(self, part: int, start: int, values: torch.Tensor) -> None:
        """Stage ``part`` as float32 ``values`` from ``start`` (in place of any chunks)."""
        self.begin_part(part)
        self._values[part] = (start, values)
        self._unmeasured.add(part)

    def deviations(self, parts: Iterable[int]) -> tuple[dict[int, float], dict[int, float]]:
        """Per part, ``||average - flat||`` over its elements outside the kept ranges divided
        by ``||flat||`` over the whole part, and ``||average - flat|| / ||flat||`` over those
        inside them, ``||flat||`` there taken as at least the whole part's over as many values
        (each part in the first, the second or both; NaN where the average holds NaN or inf:
        see :func:`~swarm.averaging.butterfly.checks.not_finite`).

        The floor is for slivers: plans cut the vector a little differently from round to round,
        so a range kept in one round may overlap the next round's part by one value. Measured
        alone, that value's honest average read 2.7-4.0 times its own small size from it in
        8-peer runs where colluders refused a member (0.06-0.17 against the part's size), and
        the member accused honest owners."""
        outside: dict[int, float] = {}
        inside: dict[int, float] = {}
        for part in parts:
            if part in self._unmeasured:
                self._unmeasured.discard(part)
                start, values = self._values[part]
                self._measure(part, start, start + values.numel(), values)
            if part in self._outside and self._outside[part].pieces:
                outside[part] = self._outside[part].value()
            if part in self._inside:
                kept = self._inside[part]
                inside[part] = kept.value(self._outside[part].share(kept.numel))
        return outside, inside

    def apply(self, tensors: list[torch.Tensor], parts: Iterable[int]) -> None:
        """Write the staged averages of ``parts`` into ``tensors`` (laid end to end like
        ``flat``); a worker thread's work."""
        single = tensors[0] if len(tensors) == 1 else None
        direct = single is not None and single.dtype == torch.float32 and single.is_contiguous()
        for part in parts:
            if part in self._values:
                start, values = self._values[part]
                write_at(tensors, start, values)
                continue
            for start, end in self._decoded.get(part, ()):
                write_at(tensors, start, self.into[start:end])
            for start, end, payload, pair in self._payloads.get(part, ()):
                if direct:
                    _decode(payload, pair, single.detach().view(-1)[start:end])
                else:
                    write_at(tensors, start, _decode(payload, pair, self._scratch.row(end - start)))

    def _measure(self, part: int, start: int, end: int, got: torch.Tensor) -> None:
        """Add ``got`` (the average of ``[start, end)``) to ``part``'s distances."""
        if part in self.whole:
            rest, mine = [(start, end)], []
        else:
            rest, mine = split(start, end, self.kept)
        outside = self._outside.setdefault(part, _Distance())
        outside.numel += end - start  # the whole part's values, the kept ranges' too
        for s, e in rest:
            outside.add(self.flat[s:e], got[s - start : e - start])
        for s, e in mine:
            inside = self._inside.setdefault(part, _Distance())
            inside.numel += e - s
            # the rest of a part is measured against the size of the whole part's values: a
            # slice left between kept ranges (a bias near 0) read 0.38-0.98 from its own small
            # values where the other parts read 0.01-0.05, and an honest owner was accused
            outside.size2 += inside.add(self.flat[s:e], got[s - start : e - start])


def _decode(payload: bytes, pair: Pair | None, out: torch.Tensor) -> torch.Tensor:
    """An owner's chunk as this member applies it: decoded, or in a pair composed with this
    member's own payload (as the owner composed it)."""
    if pair is None:
        return decode_into(payload, out, accumulate=False)
    mine, shares = pair
    return compose(out, payload, mine, shares)


def stage_decoded(codec: Codec) -> bool:
    """Whether a round in ``codec`` stages its averages decoded into a float32 buffer: when its
    payloads are about as large as the values, keeping them saves no memory."""
    return codec.estimate_size(1 << 20) >= 3.5 * (1 << 20)


class _Distance:
    """``||got - mine||`` and ``||mine||`` summed over pieces; NaN once ``got`` was not finite.
    Norms that overflow float32 (values near its limit) are taken again in float64, so huge own
    values do not read as a bad average. ``size2`` may also count own values around the pieces
    measured (the rest of the part)."""

    def __init__(self) -> None:
        self.diff2 = self.size2 = 0.0
        self.finite = True
        self.pieces = 0  # pieces measured by :meth:`add`
        self.numel = 0  # values whose size ``size2`` counts (kept by the caller)

    def add(self, mine: torch.Tensor, got: torch.Tensor) -> float:
        """Add one piece; returns the ``||mine||^2`` it counted (0 once not finite)."""
        self.pieces += 1
        added = 0.0
        if not self.finite:
            return added
        for at, to in _spans(mine.numel()):
            m, g = mine[at:to], got[at:to]
            diff = float(torch.dist(g, m))  # half the time of norm(got - mine)
            size = float(torch.linalg.vector_norm(m))
            if not (math.isfinite(diff) and math.isfinite(size)):
                if not bool(torch.isfinite(g).all()):
                    self.finite = False  # checked only here: a finite norm means finite values
                    return added
                diff = float(torch.linalg.vector_norm(g.double() - m.double()))
                size = float(torch.linalg.vector_norm(m, dtype=torch.float64))
            self.diff2 += diff * diff
            self.size2 += size * size
            added += size * size
        return added

    def share(self, numel: int) -> float:
        """The squared size of ``numel`` values of mean square ``size2 / self.numel``."""
        return self.size2 * numel / self.numel if self.numel else 0.0

    def value(self, floor2: float = 0.0) -> float:
        """``||got - mine|| / ||mine||``, the size taken as at least ``sqrt(floor2)``."""
        if not self.finite:
            return math.nan
        return math.sqrt(self.diff2) / max(math.sqrt(max(self.size2, floor2)), 1e-30)


def _spans(numel: int) -> Iterator[Range]:
    for at in range(0, numel, _SPAN):
        yield at, min(at + _SPAN, numel)
