"""What an owner sums over its part's chunks to score update contributions (see
:mod:`~swarm.averaging.butterfly.scoring`): each one's dot product with the robust mean, its
norm, and how many of its values lie above the mean and below."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass


@dataclass
class AlignmentSums:
    """One contribution's running sums over a part's chunks: ``r . c``, ``|r|^2``, and how many
    of its values lie above the center's minus how many below, of how many."""

    dot: float = 0.0
    norm2: float = 0.0
    side: float = 0.0
    numel: int = 0

    def add(self, dot: float, norm2: float, side: float, numel: int) -> None:
        self.dot += dot
        self.norm2 += norm2
        self.side += side
        self.numel += numel

    def balance(self) -> float:
        """The share of its values above the center minus the share below (0 for none): near 0
        for an offset of noise, -1 for one below the center everywhere (ALIE's mean minus
        standard deviations)."""
        return self.side / self.numel if self.numel else 0.0

    def cosine(self, center_norm2: float) -> float:
        """Its cosine with the center (0 when either is zero)."""
        return cosine(self.dot, self.norm2, center_norm2)

    def progress(self, center_norm2: float) -> float:
        """Its projection on the center, in units of the center (0 when the center is zero or
        the projection not finite: a row past float32's range delivers nothing usable)."""
        if not (center_norm2 > 0 and math.isfinite(center_norm2)):
            return 0.0
        progress = self.dot / center_norm2
        return progress if math.isfinite(progress) else 0.0


def cosine(dot: float, norm2: float, other_norm2: float) -> float:
    """The cosine of two vectors from their dot product and squared norms, in [-1, 1] (0 where
    either is zero, or a sum overflowed)."""
    denom = math.sqrt(norm2 * other_norm2)  # sums of squares: never negative
    cos = dot / denom if denom > 0 and math.isfinite(denom) else 0.0
    return min(1.0, max(-1.0, cos)) if math.isfinite(cos) else 0.0


class PartAlignment:
    """Alignments of one part's contributions, accumulated chunk by chunk (thread-safe: chunks
    reduce in parallel). Keys are member indices (the owner's own included)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums: dict[int, AlignmentSums] = {}
        self._center_norm2 = 0.0

    def add_chunk(
        self,
        members: list[int],
        dots: tuple[float, ...],
        norms2: tuple[float, ...],
        center_norm2: float,
        sides: tuple[float, ...],
        numel: int,
    ) -> None:
        with self._lock:
            self._center_norm2 += center_norm2
            for m, d, n, side in zip(members, dots, norms2, sides, strict=True):
                self._sums.setdefault(m, AlignmentSums()).add(d, n, side, numel)

    def reset(self) -> None:
        with self._lock:
            self._sums.clear()
            self._center_norm2 = 0.0

    def cosines(self, members: set[int]) -> dict[int, float]:
        """The alignment of each of ``members`` (those that contributed every chunk)."""
        with self._lock:
            return {m: s.cosine(self._center_norm2) for m, s in self._sums.items() if m in members}

    def progress(self, members: set[int]) -> dict[int, float]:
        """The progress of each of ``members`` (see :meth:`AlignmentSums.progress`)."""
        with self._lock:
            c2 = self._center_norm2
            return {m: s.progress(c2) for m, s in self._sums.items() if m in members}

    def balance(self, members: set[int]) -> dict[int, float]:
        """The balance of each of ``members`` (see :meth:`AlignmentSums.balance`)."""
        with self._lock:
            return {m: s.balance() for m, s in self._sums.items() if m in members}
