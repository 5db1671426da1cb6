"""Robust aggregation of one chunk (sans-I/O): capped weights and CenteredClip.

A part owner cannot trust what the senders hand it: a weight is what a peer *says* it trained
on, and values may be huge, sign-flipped or crafted to overflow a float32 accumulator. So:

- :func:`cap_weights`: no weight counts for more than ``ratio`` times the group's lower median
  weight (of two senders, the smaller weight: a claim alone cannot outweigh the other);
- :func:`centered_clip` (Karimireddy et al., 2021, as used by BTARD-SGD): start from the medoid
  (the contribution with the smallest median distance to the others) and, a few times, move the
  centre by the weighted mean of the offsets, each offset clipped to the radius ``tau`` = the
  median of the contributions' distances to the centre (the medoid's own 0 left out). A
  contribution far from the others moves the result by at most its weight share times ``tau``,
  however large its values; one clipped hard (its offset scaled below :data:`OUTLIER_SCALE`,
  so more than ten radii away, where no honest contribution of the group lies) is left out of
  the step altogether: a blatant attack (huge values, a sign flip, a huge weight) then moves the
  result not at all, and only a contribution placed within ten radii pulls, by at most its
  share times ``tau``. When every contribution lies within ``tau`` a step gives the exact
  weighted mean. Two contributions are averaged as they are: without a majority neither can
  be called wrong.

The work runs on the chunk's device, in float32 when no difference or norm can overflow there
and in float64 otherwise (values near the float32 limit): the Gram matrix of the rows, which the
distances need anyway, tells which.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

CLIP_ITERATIONS = 2
OUTLIER_SCALE = 0.1  # a contribution scaled below this is an outlier (reported, left out)
_SAFE_F32 = 1e18  # row norm below which float32 norms of differences cannot overflow
_TINY = torch.finfo(torch.float64).tiny


def cap_weights(weights: Sequence[float], ratio: float = 2.0) -> list[float]:
    """Each weight capped at ``ratio`` times the lower median of ``weights``."""
    if not weights:
        return []
    cap = ratio * statistics.median_low(weights)  # of two weights, the smaller one
    return [min(w, cap) for w in weights]


@dataclass(frozen=True)
class ClipResult:
    """What :func:`centered_clip` did to each row."""

    center: torch.Tensor  # the robust mean (on the rows' device; float32 or float64)
    scales: tuple[float, ...]  # per row, the factor its offset was scaled by (1.0: untouched)
    radius: float  # the last clipping radius
    # with ``score``: per row its dot product with the center and its squared norm, and the
    # center's squared norm (see :mod:`swarm.averaging.butterfly.scoring`); empty otherwise
    dots: tuple[float, ...] = ()
    norms2: tuple[float, ...] = ()
    center_norm2: float = 0.0


def centered_clip(
    rows: torch.Tensor,
    weights: Sequence[float],
    iterations: int = CLIP_ITERATIONS,
    overwrite: bool = False,
    score: bool = False,
) -> ClipResult:
    """CenteredClip of ``rows`` (one contribution per row) with ``weights``.

    Args:
        rows: ``[k, n]`` float tensor, every value finite.
        weights: ``k`` weights >= 0; when they sum to 0 every row counts the same.
        iterations: clipping steps after the medoid start.
        overwrite: ``rows`` is scratch space the call may overwrite (saves a ``k x n`` copy).
        score: also return each row's alignment sums with the center (groups of 3 or more).
    """
    k = rows.shape[0]
    if k == 1:
        return ClipResult(rows[0].float().clone(), (1.0,), 0.0)
    # Distances through dot products (||x - v||^2 = |x|^2 - 2 x.v + |v|^2). The rows are
    # taken relative to one of them first: |x|^2 of raw values (parameters rather than their
    # changes) would bury every difference below float32's precision relative to the values
    # themselves. That row is the one of median norm, never a minority's huge one, which would
    # bury all the others.
    norms = torch.linalg.vector_norm(rows.float(), dim=1)
    pick = int(torch.argsort(norms)[(k - 1) // 2])
    if bool(norms.max() < _SAFE_F32):
        origin = rows[pick].float().clone()
        x = rows.sub_(origin) if overwrite and rows.dtype == torch.float32 else rows - origin
    else:  # huge norms: differences and their norms could overflow float32; exact in float64
        origin = rows[pick].double()
        x = rows.double() - origin
    # The clip runs on the Gram matrix alone: the centre is always a combination v = x^T a of
    # the rows (the medoid, then steps v <- (1 - sum c) v + x^T c), so every distance
    # ||x_i - v||^2 = G_ii - 2 (G a)_i + a^T G a is a k x k product, and the rows are read
    # twice in all (the Gram matrix, then the centre), whatever the iterations.
    g = (x @ x.T).double().cpu()
    w = torch.tensor([float(v) for v in weights], dtype=torch.float64)
    if float(w.sum()) <= 0:
        w = torch.ones(k, dtype=torch.float64)
    if k == 2:  # no majority can say which of two is wrong: their (capped) weighted mean
        return ClipResult(_combine(x, w / w.sum(), origin), (1.0, 1.0), 0.0)
    sq = g.diagonal()
    start, dist2 = _medoid(g)
    a = torch.zeros(k, dtype=torch.float64)
    a[start] = 1.0
    scale = torch.ones(k, dtype=torch.float64)
    tau = 0.0
    for step in range(iterations):
        if step == 0:  # from the medoid: its distances are in the Gram matrix already
            dist = torch.sqrt(dist2[start])
            # the medoid's own distance (0) would drag the median down and clip honest rows
            others = torch.cat([dist[:start], dist[start + 1 :]])
        else:
            ga = g @ a
            dist = others = torch.sqrt(torch.clamp(sq - 2 * ga + a @ ga, min=0))
        tau = float(others.median())  # the lower median: one of two far rows is clipped
        scale = torch.where(dist > tau, tau / torch.clamp(dist, min=_TINY), 1.0)
        wk = torch.where(scale < OUTLIER_SCALE, 0.0, w)
        if not float(wk.sum()) > 0:  # only outliers claim a weight: stay at the medoid
            break
        c = wk * scale / wk.sum()  # a <- (1 - sum c) a + c
        a = a * float(1 - c.sum()) + c
    center = _combine(x, a, origin)
    sums = _alignment(x, g, a, origin.to(x.dtype)) if score else ((), (), 0.0)
    return ClipResult(center, tuple(float(s) for s in scale), tau, *sums)


def _combine(x: torch.Tensor, a: torch.Tensor, origin: torch.Tensor) -> torch.Tensor:
    """``x^T a + origin``: a combination of the rows, shifted back (one pass over ``x``)."""
    return (a.to(device=x.device, dtype=x.dtype) @ x).add_(origin)


def _alignment(
    x: torch.Tensor, g: torch.Tensor, a: torch.Tensor, origin: torch.Tensor
) -> tuple[tuple[float, ...], tuple[float, ...], float]:
    """Rows ``r_i = x_i + o`` against the center ``c = x^T a + o``: ``r_i . c``, ``|r_i|^2`` and
    ``|c|^2``, from the Gram matrix ``g`` of ``x`` and one pass over ``x`` (``x . o``)."""
    xo = (x @ origin).double().cpu()
    xv = g @ a
    oo = float(origin @ origin)
    ov, vv = float(a @ xo), float(a @ xv)
    dots = (xv + xo + ov + oo).tolist()
    norms2 = torch.clamp(g.diagonal() + 2 * xo + oo, min=0).tolist()
    return tuple(dots), tuple(norms2), max(0.0, vv + 2 * ov + oo)


def _medoid(gram: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The row with the smallest median distance to the rows, and the squared distances between
    rows, from their Gram matrix."""
    sq = gram.diagonal()
    dist2 = torch.clamp(sq[:, None] + sq[None, :] - 2 * gram, min=0)
    scale = float(dist2.max()) or 1.0  # ties on the median go to the smallest mean distance
    score = dist2.median(dim=1).values / scale + 1e-6 * dist2.mean(dim=1) / scale
    return int(score.argmin()), dist2
