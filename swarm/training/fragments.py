"""Streaming DiLoCo's fragments: the averaged tensors cut into runs of about equal size.

With ``fragments = F`` (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication")
round ``r`` averages fragment ``r mod F`` only (on the wall clock: the round after instant ``k``
averages fragment ``k mod F``), and rounds come every ``inner_steps / F`` steps:
each fragment still averages every ``inner_steps`` steps, with its own anchor, momentum and
pseudo-gradient, while a round moves ``1 / F`` of the model's bytes.

The paper cuts a transformer into groups of blocks. Here the averaged tensors (parameters, then
floating buffers, in the model's order) are laid end to end and cut into ``F`` runs of equal
length, so a model whose one embedding or layer holds most weights still gets fragments of
equal size: a cut may fall inside a tensor (a contiguous one; a non-contiguous tensor is never
cut, the cut moves to its nearer end). The cut is a pure function of the model's tensors, so
every peer of a run (same schema) cuts the same way.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from swarm.errors import TrainingError
from swarm.training.tensors import ModelTensors

Piece = tuple[int, int, int]  # (index into ModelTensors.all, start, end) of the flattened tensor


@dataclass(frozen=True)
class Fragment:
    """Fragment ``index`` of ``count``: the pieces of the averaged tensors it holds, in order."""

    index: int
    count: int
    pieces: tuple[Piece, ...]

    @property
    def label(self) -> str:
        """What tells its rounds apart from other fragments' ("" for a whole model)."""
        return "" if self.count == 1 else f"{self.index + 1}/{self.count}"

    @property
    def numel(self) -> int:
        return sum(end - start for _, start, end in self.pieces)


def split(tensors: ModelTensors, count: int) -> list[Fragment]:
    """Cut ``tensors.all`` laid end to end into ``count`` non-empty runs of about equal length.

    Raises:
        TrainingError: ``count`` runs cannot be cut (fewer elements than fragments, or
            non-contiguous tensors too large to leave every fragment some elements).
    """
    if count < 1:
        raise TrainingError("fragments must be >= 1")
    sizes = [t.numel() for t in tensors.all]
    starts = [0, *itertools.accumulate(sizes)][:-1]
    total = sum(sizes)
    bounds = [0]
    for k in range(1, count):
        target = round(k * total / count)
        i = bisect.bisect_right(starts, target) - 1  # the tensor the cut falls in
        if not tensors.all[i].is_contiguous() and target != starts[i]:
            low, high = starts[i], starts[i] + sizes[i]
            target = low if target - low <= high - target and low > bounds[-1] else high
        if not bounds[-1] < target < total:
            raise TrainingError(
                f"cannot cut {total} elements in {len(sizes)} tensors into {count} fragments"
            )
        bounds.append(target)
    bounds.append(total)
    fragments = []
    for k in range(count):
        lo, hi = bounds[k], bounds[k + 1]
        pieces = tuple(
            (i, max(lo, s) - s, min(hi, s + n) - s)
            for i, (s, n) in enumerate(zip(starts, sizes, strict=True))
            if max(lo, s) < min(hi, s + n)
        )
        fragments.append(Fragment(k, count, pieces))
    return fragments
