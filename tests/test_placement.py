"""Placements published rounds ahead: two versions of a record place a peer alike in the rounds
a reader may still plan with the older one, moves wait their turn, hostile fields are refused."""

from __future__ import annotations

import hashlib
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.averaging.groups.coordinates import Coordinate
from swarm.averaging.groups.placement import (
    LEAD_ROUNDS,
    PLACEMENT_FIELD,
    PREVIOUS_FIELD,
    QUANTUM_S,
    Placement,
    Placer,
    placement_at,
)
from swarm.averaging.groups.regions import GroupingConfig, plan_groups
from swarm.identity import PeerID

RTT = 0.05
DIMS = 4


def _at(x: float) -> Coordinate:
    return Coordinate((x, 0.0, 0.0, 0.0), 0.001, 0.5)


moves = st.lists(
    # (coordinate, rounds planned since: below 0 the order came back down, as a group can
    # settle it; see GroupPlanner.settle)
    st.tuples(st.floats(-0.3, 0.3), st.integers(-3, 3)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(moves)
def test_the_version_before_places_a_peer_alike_until_the_new_one_is_due(
    steps: list[tuple[float, int]],
) -> None:
    placer = Placer(RTT, move_s=0.005)
    order = 0
    published: dict[str, Any] = {}
    for x, planned in steps:
        order = max(0, order + planned)
        changed = placer.update(_at(x), order)
        # never further ahead than LEAD_ROUNDS, however far the order came back down
        assert placer.current is not None and placer.current.start <= order + LEAD_ROUNDS
        if not changed:
            continue
        newer = placer.extra()
        # a reader that holds the version before plans the rounds up to LEAD_ROUNDS ahead alike
        for round_ in range(order, order + LEAD_ROUNDS):
            old = placement_at(published, DIMS, round_)
            assert old == placement_at(newer, DIMS, round_), (round_, published, newer)
            assert placer.at(round_) == placement_at(newer, DIMS, round_)
        assert placer.current is not None and placer.current.start >= order + LEAD_ROUNDS
        published = newer


def test_a_move_waits_while_the_one_before_is_due_soon() -> None:
    placer = Placer(RTT, move_s=0.005)
    assert placer.update(_at(0.0), 0)
    first = placer.current
    assert first is not None and first.start == LEAD_ROUNDS
    # before any round is planned a pending placement is replaced (it keeps its round)
    assert placer.update(_at(0.1), 0)
    assert placer.current is not None and placer.current.start == LEAD_ROUNDS
    assert placer.previous is None and placer.current.cell != first.cell
    # once it is due within LEAD_ROUNDS, a move waits for it to count
    assert not placer.update(_at(0.2), 1)
    assert placer.at(1) is None and placer.at(LEAD_ROUNDS) == placer.current
    # it counts: the move goes out, and the one before counts until the new one does
    counted = placer.current
    assert placer.update(_at(0.2), LEAD_ROUNDS)
    assert placer.previous == counted
    assert placer.current.start == 2 * LEAD_ROUNDS
    assert placer.at(2 * LEAD_ROUNDS - 1) == counted
    # a small move inside the cell is no move
    assert not placer.update(_at(0.2 + QUANTUM_S), 10)


def test_a_placement_planned_ahead_of_an_order_that_came_back_counts_from_the_new_one() -> None:
    """A group can settle a peer's round order lower (a member had dragged it ahead): its
    placement, published for the order before, is brought back even when the peer did not
    move, or readers would plan it at its previous place (or the origin) until the swarm
    reached the order it had been dragged to."""
    placer = Placer(RTT, move_s=0.005)
    assert placer.update(_at(0.0), 1024)
    assert placer.current is not None and placer.current.start == 1024 + LEAD_ROUNDS
    assert placer.update(_at(0.0), 5)  # the same place, its round brought back
    assert placer.current.start == 5 + LEAD_ROUNDS and placer.previous is None
    assert placer.at(5 + LEAD_ROUNDS) == placer.current
    assert not placer.update(_at(0.0), 6)  # then as before: no move, nothing new


def _peer(i: int) -> PeerID:
    return PeerID(hashlib.sha256(b"placement peer %d" % i).digest())


def test_views_with_either_version_plan_the_same_groups() -> None:
    """16 peers in two clusters; one of them moves (its newest record not read by half the
    readers): every round before the move counts is planned alike."""
    config = GroupingConfig(2, 4, cross_every=4, region_rtt=RTT)
    placers = {_peer(i): Placer(RTT, move_s=0.005) for i in range(16)}
    for i, placer in enumerate(placers.values()):
        placer.update(_at(0.0 if i < 8 else 0.2), 0)
    older = {p: placer.extra() for p, placer in placers.items()}
    mover = _peer(3)
    assert placers[mover].update(_at(0.2), LEAD_ROUNDS)  # the first placements count
    newer = {**older, mover: placers[mover].extra()}

    def plan(records: dict[PeerID, dict[str, Any]], round_: int) -> dict[str, Any]:
        view, cells = {}, {}
        for p, extra in records.items():
            placement = placement_at(extra, DIMS, round_)
            assert placement is not None
            view[p], cells[p] = placement.coordinate(), placement.cell
        return dict(plan_groups(view, round_, config, cells).groups)

    for round_ in range(LEAD_ROUNDS, 2 * LEAD_ROUNDS):
        assert plan(older, round_) == plan(newer, round_)
    moved = 2 * LEAD_ROUNDS
    assert plan(older, moved) != plan(newer, moved)  # (readers hold the new one by then)


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
        lambda children: st.lists(children, max_size=5),
        max_leaves=20,
    ),
    st.integers(0, 10),
)
def test_hostile_placements_are_ignored_never_raised(raw: Any, round_: int) -> None:
    for extra in ({PLACEMENT_FIELD: raw}, {PLACEMENT_FIELD: [0, [0] * 4, [0] * 4, 0]}):
        placement_at({**extra, PREVIOUS_FIELD: raw}, DIMS, round_)
    placement = placement_at({PLACEMENT_FIELD: raw}, DIMS, round_)
    assert placement is None or isinstance(placement, Placement)


def test_out_of_range_fields_are_refused() -> None:
    good = [5, [0, 1, 0, 0], [10, -10, 0, 0], 3]
    assert placement_at({PLACEMENT_FIELD: good}, DIMS, 5) == Placement(
        5, (0, 1, 0, 0), (10, -10, 0, 0), 3
    )
    assert placement_at({PLACEMENT_FIELD: good}, DIMS, 4) is None  # not due, none before
    for bad in (
        [True, [0, 1, 0, 0], [0] * 4, 3],
        [1 << 63, [0, 1, 0, 0], [0] * 4, 3],
        [5, [0, 1, 0], [0] * 4, 3],
        [5, [0, 1, 0, 0], [0] * 3, 3],
        [5, [0, 1, 0, 0], [2 * 10**6, 0, 0, 0], 3],
        [5, [0, 1, 0, 0], [0] * 4, 1.0],
        [5, [0, 1, 0, 0], [0] * 4, 3, 4],
        (5, [0, 1, 0, 0], [0] * 4, 3),
    ):
        assert placement_at({PLACEMENT_FIELD: bad}, DIMS, 5) is None, bad
    # a malformed previous placement is no placement before the current one counts
    extra = {PLACEMENT_FIELD: good, PREVIOUS_FIELD: [[0, 1], [0] * 4, 0]}
    assert placement_at(extra, DIMS, 4) is None
