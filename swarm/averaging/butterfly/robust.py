"""Robust aggregation of one chunk (sans-I/O): capped weights and CenteredClip.

A part owner cannot trust what the senders hand it: a weight is what a peer *says* it trained
on, and values may be huge, sign-flipped or crafted to overflow a float32 accumulator. So:

- :func:`cap_weights`: no weight counts for more than ``ratio`` times the group's lower median
  weight (of two senders, the smaller weight: a claim alone cannot outweigh the other);
- :func:`centered_clip` (Karimireddy et al., 2021, as used by BTARD-SGD): start from the medoid
  (the contribution with the smallest median distance to the others) and, a few times, move the
  centre by the weighted mean of the offsets, each offset clipped to the radius ``tau`` = the
  median of the contributions' distances to the centre (the medoid's own 0 left out; where
  the owner scores its senders, :data:`TRIO_RADIUS` times it in a group of 3). A
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

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

CLIP_ITERATIONS = 2
# In a group of 3 the radius is the middle of three distances, which a close pair of honest
# rows makes small: the third honest row lay past twice that radius in 1 chunk of 5000 and up
# to 2.4 times it (calm 6-peer runs), and was scaled below half. Where the owner scores its
# senders a wider radius costs little (an update that keeps pushing inside it loses its weight
# through its record); CenteredClip alone keeps the plain one, its only bound on slow poison
# (IPM, 1 of 6: the honest peers' loss 4% higher with the wider radius, 6 seeds)
TRIO_RADIUS = 1.5
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
    # with ``score``: per row, the sum of the signs of its values minus the center's (how many
    # lie above it minus how many below)
    sides: tuple[float, ...] = ()


def centered_clip(
    rows: torch.Tensor,
    weights: Sequence[float],
    iterations: int = CLIP_ITERATIONS,
    overwrite: bool = False,
    score: bool = False,
    trio_radius: float = 1.0,
) -> ClipResult:
    """CenteredClip of ``rows`` (one contribution per row) with ``weights``.

    Args:
        rows: ``[k, n]`` float tensor, every value finite.
        weights: ``k`` weights >= 0; when they sum to 0 every row counts the same.
        iterations: clipping steps after the medoid start.
        overwrite: ``rows`` is scratch space the call may overwrite (saves a ``k x n`` copy).
        score: also return each row's alignment sums with the center (groups of 3 or more).
        trio_radius: with 3 rows, the radius is this times the median distance.
    """
    k = rows.shape[0]
    if k == 1:
        return ClipResult(rows[0].float().clone(), (1.0,), 0.0)
    # Distances through dot products (||x - v||^2 = |x|^2 - 2 x.v + |v|^2). The rows are
    # taken relative to one of them first: |x|^2 of raw values (parameters rather than their
    # changes) would bury every difference below float32's precision relative to the values
    # themselves. That row is the one of median norm, never a minority's huge one, which would
    # bury all the others.
    norms = torch.linalg.vector_norm(rows.float(), dim=1).tolist()
    pick = sorted(range(k), key=norms.__getitem__)[(k - 1) // 2]
    if max(norms) < _SAFE_F32:
        origin = rows[pick].float().clone()
        x = rows.sub_(origin) if overwrite and rows.dtype == torch.float32 else rows - origin
    else:  # huge norms: differences and their norms could overflow float32; exact in float64
        origin = rows[pick].double()
        x = rows.double() - origin
    # The clip runs on the Gram matrix alone: the centre is always a combination v = x^T a of
    # the rows (the medoid, then steps v <- (1 - sum c) v + x^T c), so every distance
    # ||x_i - v||^2 = G_ii - 2 (G a)_i + a^T G a is a k x k product, and the rows are read
    # twice in all (the Gram matrix, then the centre), whatever the iterations. The k x k work
    # is done in Python floats (float64): a few dozen tiny tensor ops would cost more than the
    # arithmetic, and each hands the interpreter lock over and waits to get it back.
    g = (x @ x.T).double().cpu().tolist()
    # symmetric to the last bit: two mutual nearest rows share one median distance, and the
    # medoid between them goes by the tie-break, not by which order the matmul rounded them
    # in (it flipped with the rows' order, and groups of the same rows gave results 0.4% apart)
    g = [[(g[i][j] + g[j][i]) / 2 for j in range(k)] for i in range(k)]
    w = [float(v) for v in weights]
    if sum(w) <= 0:
        w = [1.0] * k
    if k == 2:  # no majority can say which of two is wrong: their (capped) weighted mean
        total = sum(w)
        return ClipResult(_combine(x, [v / total for v in w], origin), (1.0, 1.0), 0.0)
    a, scale, tau = _clip_steps(g, w, iterations, trio_radius if k == 3 else 1.0)
    center = _combine(x, a, origin)
    if not score:
        return ClipResult(center, tuple(scale), tau)
    o = origin.to(x.dtype)
    sums = _alignment(x, g, a, o)
    # in the frame shifted by ``origin`` (r_i - c = x_i - (c - origin)); ``x`` is scratch by
    # now (``rows`` itself only where the caller said so). Sums of +-1 stay exact in float32
    # below 2^24 values a row, which no chunk reaches.
    sides = x.sub_(center.to(x.dtype) - o).sign_().sum(dim=1).tolist()
    return ClipResult(center, tuple(scale), tau, *sums, tuple(sides))


def _clip_steps(
    g: list[list[float]], w: list[float], iterations: int, widen: float = 1.0
) -> tuple[list[float], list[float], float]:
    """The clip on the Gram matrix ``g`` of the rows: the centre's coefficients ``a`` (the
    centre is ``x^T a``), each row's last scale, and the last radius (``widen`` times the
    median distance)."""
    k = len(g)
    start, dist2 = _medoid(g)
    a = [0.0] * k
    a[start] = 1.0
    scale = [1.0] * k
    tau = 0.0
    for step in range(iterations):
        if step == 0:  # from the medoid: its distances are in the Gram matrix already
            dist = [math.sqrt(d) for d in dist2[start]]
            # the medoid's own distance (0) would drag the median down and clip honest rows
            others = dist[:start] + dist[start + 1 :]
        else:
            ga = [sum(gi[j] * a[j] for j in range(k)) for gi in g]
            aga = sum(a[i] * ga[i] for i in range(k))
            dist = others = [math.sqrt(max(0.0, g[i][i] - 2 * ga[i] + aga)) for i in range(k)]
        tau = _lower_median(others)  # the lower median: one of two far rows is clipped
        tau *= widen
        scale = [tau / max(d, _TINY) if d > tau else 1.0 for d in dist]
        wk = [0.0 if s < OUTLIER_SCALE else v for s, v in zip(scale, w, strict=True)]
        total = sum(wk)
        if not total > 0:  # only outliers claim a weight: stay at the medoid
            break
        c = [v * s / total for v, s in zip(wk, scale, strict=True)]  # a <- (1 - sum c) a + c
        keep = 1 - sum(c)
        a = [ai * keep + ci for ai, ci in zip(a, c, strict=True)]
    return a, scale, tau


def _lower_median(values: list[float]) -> float:
    return sorted(values)[(len(values) - 1) // 2]


def _combine(x: torch.Tensor, a: list[float], origin: torch.Tensor) -> torch.Tensor:
    """``x^T a + origin``: a combination of the rows, shifted back (one pass over ``x``)."""
    return (torch.tensor(a, dtype=x.dtype).to(x.device) @ x).add_(origin)


def _alignment(
    x: torch.Tensor, g: list[list[float]], a: list[float], origin: torch.Tensor
) -> tuple[tuple[float, ...], tuple[float, ...], float]:
    """Rows ``r_i = x_i + o`` against the center ``c = x^T a + o``: ``r_i . c``, ``|r_i|^2`` and
    ``|c|^2``, from the Gram matrix ``g`` of ``x`` and one pass over ``x`` (``x . o``)."""
    k = len(g)
    xo = (x @ origin).double().cpu().tolist()
    xv = [sum(gi[j] * a[j] for j in range(k)) for gi in g]
    oo = float(origin @ origin)
    ov = sum(ai * v for ai, v in zip(a, xo, strict=True))
    vv = sum(ai * v for ai, v in zip(a, xv, strict=True))
    dots = tuple(xv[i] + xo[i] + ov + oo for i in range(k))
    norms2 = tuple(max(0.0, g[i][i] + 2 * xo[i] + oo) for i in range(k))
    return dots, norms2, max(0.0, vv + 2 * ov + oo)


def _medoid(gram: list[list[float]]) -> tuple[int, list[list[float]]]:
    """The row with the smallest median distance to the rows, and the squared distances between
    rows, from their Gram matrix."""
    k = len(gram)
    dist2 = [
        [max(0.0, gram[i][i] + gram[j][j] - 2 * gram[i][j]) for j in range(k)] for i in range(k)
    ]
    # ties on the median go to the smallest mean distance (compared only on a tie: added to
    # the median, a far row's distance swamped every median, and the far row could win)
    return min(range(k), key=lambda i: (_lower_median(dist2[i]), sum(dist2[i]))), dist2
