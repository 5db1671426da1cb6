"""Where a peer sits for grouping (sans-I/O): a cell of a grid laid over Vivaldi space.

Regions are made of cells (see :mod:`.regions`): a peer's region then depends on its own place
only, never on where the other peers of a view sit, so views that differ in a few peers or in
their newest coordinates still agree on everyone else's region.

A face may cut a tight cluster (a few peers in one city, a LAN) in two. So two neighbouring
cells (one step apart on every axis at most) whose peers all lie within ``region_rtt / 2`` of
each other (:data:`TIGHT`, before heights) are one region (:func:`join_tight`): a cluster cut
in two is well under that, while two crowded neighbours are well over it (their peers span the
cells), so a coordinate moving a little changes neither.

Cells are cubes of side ``region_rtt / sqrt(dims)`` (the cube's diagonal: two peers of one cell
are at most ``region_rtt`` apart before their heights), centred on the grid's points so that the
origin, where a peer without RTT samples sits, lies inside one. A coordinate moves a little with
every probe; a peer near a face would hop between two cells and be seen in either by readers of
different versions of its record. So each peer publishes its cell (in its placement, see
:mod:`.placement`) and keeps it (:func:`place`) until its coordinate lies more than ``SLACK`` of
a side outside it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from swarm.averaging.groups.coordinates import Coordinate

Cell = tuple[int, ...]

CELL_FIELD = "rc"  # key of the cell in PeerRecord.extra
SLACK = 0.25  # of a side: how far past its cell's faces a coordinate may go before it moves
TIGHT = 0.5  # of region_rtt: neighbouring cells whose peers are all this close are one region
MAX_INDEX = 1 << 20  # cells beyond this on any axis are no place (coordinates are far smaller)


def side(region_rtt: float, dims: int) -> float:
    """The side of a cell, in seconds of RTT."""
    return region_rtt / math.sqrt(dims)


def cell_of(coordinate: Coordinate, region_rtt: float) -> Cell:
    """The cell ``coordinate`` lies in (no history)."""
    width = side(region_rtt, coordinate.dims)
    return tuple(_clamp(math.floor(x / width + 0.5)) for x in coordinate.vector)


def place(coordinate: Coordinate, region_rtt: float, previous: Sequence[int] | None) -> Cell:
    """The cell to publish: ``previous`` while ``coordinate`` lies within ``SLACK`` of a side
    outside it on every axis, else the cell the coordinate lies in."""
    if previous is not None and len(previous) == coordinate.dims:
        width = side(region_rtt, coordinate.dims)
        if all(
            abs(x / width - c) <= 0.5 + SLACK
            for x, c in zip(coordinate.vector, previous, strict=True)
        ):
            return tuple(previous)
    return cell_of(coordinate, region_rtt)


def parse_cell(raw: Any, dims: int) -> Cell | None:
    """A published cell, or None when ``raw`` is not one of ``dims`` bounded integers."""
    if (
        isinstance(raw, list)
        and len(raw) == dims
        and all(isinstance(c, int) and not isinstance(c, bool) and abs(c) <= MAX_INDEX for c in raw)
    ):
        return tuple(raw)
    return None


def join_tight(
    cells: Mapping[Cell, list[int]], vectors: np.ndarray, region_rtt: float
) -> list[list[int]]:
    """The peers (row indices of ``vectors``) of each cell, neighbouring cells joined while all
    the peers of the two lie within ``TIGHT * region_rtt`` of each other (see the module
    docstring); pairs are tried in the cells' order, so every view with the same cells and
    coordinates joins alike."""
    order = sorted(cells)
    members = {k: list(cells[c]) for k, c in enumerate(order)}
    root = list(range(len(order)))
    if len(order) > 1:
        limit = TIGHT * region_rtt
        grid = np.array(order, dtype=np.int64)
        low = np.array([vectors[cells[c]].min(axis=0) for c in order])
        high = np.array([vectors[cells[c]].max(axis=0) for c in order])
        # neighbours whose peers fit in a box of the limit's side (the rest cannot be joined)
        fit = np.triu(np.ones((len(order), len(order)), dtype=bool), 1)
        for k in range(grid.shape[1]):
            fit &= np.abs(grid[:, None, k] - grid[None, :, k]) <= 1
            span = np.maximum(high[:, None, k], high[None, :, k])
            span -= np.minimum(low[:, None, k], low[None, :, k])
            fit &= span <= limit
        for i, j in zip(*np.nonzero(fit), strict=True):
            a, b = root[int(i)], root[int(j)]
            if a != b and _within(vectors[members[a] + members[b]], limit):
                members[a] += members.pop(b)
                root = [a if r == b else r for r in root]
    return list(members.values())


def _within(points: np.ndarray, limit: float) -> bool:
    """Whether every two of ``points`` are at most ``limit`` apart."""
    if (points.max(axis=0) - points.min(axis=0)).max() > limit:
        return False
    gaps = points[:, None, :] - points[None, :, :]
    return bool(np.sqrt(np.square(gaps).sum(axis=2)).max() <= limit)


def _clamp(index: int) -> int:
    return max(-MAX_INDEX, min(MAX_INDEX, index))
