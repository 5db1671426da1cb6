"""Where a peer sits in the plan of a round (sans-I/O): placements published rounds ahead.

A plan (:mod:`.regions`) takes two things from each peer's record: its grid cell and the
coordinate that joins tight cells and attaches small regions. Views differ in which version of
a record they hold (peers read at different moments, and a record changes whenever its
coordinate moves), and a plan made from each record's newest cell and coordinate planned other
groups in views that held the version before: in two runs of 16 unequal peers
(tests/many_peers.py), the planned members of 12 of the 13 rounds that failed in the measured
windows had planned other groups, from another cell or coordinate of one peer.

So a record publishes a :class:`Placement`: a cell, a coordinate rounded to 0.1 ms and the round
from which it counts, ``LEAD_ROUNDS`` rounds ahead, together with the placement before it, which
counts until then. Views that hold either version plan a round with the same placement of that
peer, as long as they read its record at most ``LEAD_ROUNDS`` rounds late. A peer without a
placement for a round (none published yet, or its first one does not count yet) sits at the
origin.

:class:`Placer` decides when a peer moves: when its cell (:func:`.grid.place`, with its slack)
or its coordinate (by ``move_s``) changed. A placement that does not count yet is replaced
while it still lies ``LEAD_ROUNDS`` ahead (before a peer's first rounds, no round moves), and
one further ahead (planned from a round order that has come back down since) is brought back to
``LEAD_ROUNDS`` ahead; one that counts becomes the previous one. Between the two, a move waits:
a peer moves at most once in ``LEAD_ROUNDS`` rounds, and one that moved (another network)
regroups that many rounds later.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from swarm.averaging.groups.coordinates import MAX_COMPONENT, Coordinate
from swarm.averaging.groups.grid import Cell, parse_cell, place
from swarm.identity import PeerID

PLACEMENT_FIELD = "pl"  # key of the placement in PeerRecord.extra: [start, cell, vector, height]
PREVIOUS_FIELD = "pp"  # key of the placement before it: [cell, vector, height]
LEAD_ROUNDS = 2  # a new placement counts from this many rounds after the next one planned
QUANTUM_S = 1e-4  # coordinates of placements are integers of this many seconds
MAX_UNITS = round(MAX_COMPONENT / QUANTUM_S)
MAX_START = 1 << 62


@dataclass(frozen=True)
class Placement:
    """A peer's place in the plans of the rounds from ``start`` on (equal placements: the
    same place)."""

    start: int = field(compare=False)  # the first round it counts in
    cell: Cell
    vector: tuple[int, ...]  # in QUANTUM_S
    height: int  # in QUANTUM_S

    @classmethod
    def of(cls, coordinate: Coordinate, cell: Cell, start: int) -> Placement:
        vector = tuple(_units(x) for x in coordinate.vector)
        return cls(start, cell, vector, max(0, _units(coordinate.height)))

    def coordinate(self) -> Coordinate:
        """The rounded coordinate (the planner reads no error)."""
        return Coordinate(tuple(v * QUANTUM_S for v in self.vector), self.height * QUANTUM_S, 0.0)

    def to_wire(self) -> list[Any]:
        return [self.start, list(self.cell), list(self.vector), self.height]

    @classmethod
    def from_wire(cls, raw: Any, dims: int, start: int | None = None) -> Placement | None:
        """A placement from ``[start, cell, vector, height]`` (``[cell, vector, height]`` when
        ``start`` is given), or None when ``raw`` is not one of ``dims`` dimensions."""
        if not isinstance(raw, list):
            return None
        if start is None:
            if not raw or not _is_int(raw[0], 0, MAX_START):
                return None
            start, raw = raw[0], raw[1:]
        if len(raw) != 3:
            return None
        cell = parse_cell(raw[0], dims)
        vector, height = raw[1], raw[2]
        if (
            cell is None
            or not isinstance(vector, list)
            or len(vector) != dims
            or not all(_is_int(v, -MAX_UNITS, MAX_UNITS) for v in vector)
            or not _is_int(height, 0, MAX_UNITS)
        ):
            return None
        return cls(start, cell, tuple(vector), height)


def put(
    view: dict[PeerID, Coordinate],
    cells: dict[PeerID, Cell],
    peer: PeerID,
    placement: Placement | None,
    dims: int,
) -> None:
    """Put ``peer`` in a plan's ``view`` and ``cells`` where ``placement`` says: its rounded
    coordinate and its cell, or the origin and no cell when it has none for the round."""
    view[peer] = placement.coordinate() if placement is not None else Coordinate.origin(dims)
    cells.pop(peer, None)
    if placement is not None:
        cells[peer] = placement.cell


def placement_at(extra: Mapping[str, Any], dims: int, round_: int) -> Placement | None:
    """The placement a record's ``extra`` gives for ``round_`` (None: the origin)."""
    current = Placement.from_wire(extra.get(PLACEMENT_FIELD), dims)
    if current is None or round_ >= current.start:
        return current
    return Placement.from_wire(extra.get(PREVIOUS_FIELD), dims, start=0)


class Placer:
    """This peer's placements: when to move, and what its record publishes."""

    def __init__(self, region_rtt: float, move_s: float, lead: int = LEAD_ROUNDS):
        self.region_rtt = region_rtt
        self.move_s = move_s
        self.lead = lead
        self.current: Placement | None = None
        self.previous: Placement | None = None

    def update(self, coordinate: Coordinate, round_order: int) -> bool:
        """Move to ``coordinate`` when it left the current cell or moved ``move_s`` from the
        current placement, if a move may happen now; ``round_order``: the next round this
        peer plans. True when the placement to publish changed."""
        current = self.current
        cell = place(coordinate, self.region_rtt, current.cell if current is not None else None)
        start = round_order + self.lead
        if current is not None and current.start <= start:
            same_cell = cell == current.cell
            if same_cell and moved(current.coordinate(), coordinate) < self.move_s:
                return False
            if current.start <= round_order:  # counts already: the one before the next
                self.previous = current
            elif current.start < start:
                return False  # counts within LEAD rounds: the move waits
            # else it does not count yet, nor soon (it starts where this one would): replaced
        # (a placement further ahead was published for a round order the planner has since come
        # back from, GroupPlanner.settle: it is replaced too, moved or not, or it would not
        # count for as many rounds as the order fell)
        self.current = Placement.of(coordinate, cell, start)
        return True

    def at(self, round_: int) -> Placement | None:
        """The placement that counts in ``round_`` (what readers of the record compute)."""
        if self.current is None or round_ >= self.current.start:
            return self.current
        return self.previous

    def extra(self) -> dict[str, Any]:
        """The record fields: the placement, and the one before it."""
        fields: dict[str, Any] = {}
        if self.current is not None:
            fields[PLACEMENT_FIELD] = self.current.to_wire()
        if self.previous is not None:
            fields[PREVIOUS_FIELD] = self.previous.to_wire()[1:]
        return fields


def _units(seconds: float) -> int:
    return max(-MAX_UNITS, min(MAX_UNITS, round(seconds / QUANTUM_S)))


def _is_int(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def moved(before: Coordinate, after: Coordinate) -> float:
    """How far (seconds of RTT) a coordinate moved: its vector's distance plus its height's."""
    if before.dims != after.dims:
        return math.inf
    return math.dist(before.vector, after.vector) + abs(before.height - after.height)
