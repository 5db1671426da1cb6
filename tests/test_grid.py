"""Grid cells for regions: placement with slack, hostile published cells, plans that agree."""

from __future__ import annotations

import hashlib
import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.averaging.groups.coordinates import Coordinate
from swarm.averaging.groups.grid import (
    MAX_INDEX,
    SLACK,
    TIGHT,
    cell_of,
    parse_cell,
    place,
    side,
)
from swarm.averaging.groups.regions import GroupingConfig, find_regions, plan_groups
from swarm.identity import PeerID

RTT = 0.05
CONFIG = GroupingConfig(min_group_size=2, target_group_size=8, cross_every=4, region_rtt=RTT)


def _peer(i: int) -> PeerID:
    return PeerID(hashlib.sha256(b"grid peer %d" % i).digest())


def _at(*vector: float) -> Coordinate:
    return Coordinate(tuple(float(x) for x in vector), 0.001, 0.2)


def test_cells_are_centred_on_the_origin_and_as_wide_as_the_region_allows() -> None:
    width = side(RTT, 4)
    assert width == RTT / 2
    assert cell_of(Coordinate.origin(4), RTT) == (0, 0, 0, 0)
    assert cell_of(_at(-0.49 * width, 0.49 * width, 0, 0), RTT) == (0, 0, 0, 0)
    assert cell_of(_at(0.51 * width, -0.51 * width, 3 * width, 0), RTT) == (1, -1, 3, 0)


@settings(max_examples=200, deadline=None)
@given(
    a=st.lists(st.floats(-1.0, 1.0), min_size=3, max_size=3),
    b=st.lists(st.floats(-1.0, 1.0), min_size=3, max_size=3),
)
def test_two_peers_of_a_cell_are_within_the_region_rtt(a: list[float], b: list[float]) -> None:
    if cell_of(_at(*a), RTT) == cell_of(_at(*b), RTT):
        assert math.dist(a, b) <= RTT * (1 + 1e-12)


def test_a_peer_keeps_its_cell_while_it_wobbles_near_a_face() -> None:
    width = side(RTT, 2)
    cell = place(_at(0.49 * width, 0.0), RTT, None)
    assert cell == (0, 0)
    for x in (0.52, 0.7, 0.5 + SLACK - 0.01, 0.3):  # past the face, within the slack
        cell = place(_at(x * width, 0.0), RTT, cell)
        assert cell == (0, 0)
    cell = place(_at((0.5 + SLACK + 0.01) * width, 0.0), RTT, cell)
    assert cell == (1, 0)  # moved on for good
    assert place(_at(0.6 * width, 0.0), RTT, cell) == (1, 0)  # and kept there in turn
    assert place(_at(0.0, 0.0), RTT, (0, 0, 0)) == (0, 0)  # a cell of other dims: placed anew


@settings(max_examples=200, deadline=None)
@given(
    raw=st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(),
        st.text(max_size=8),
        st.binary(max_size=8),
        st.lists(
            st.one_of(st.integers(), st.floats(), st.booleans(), st.none(), st.text(max_size=2)),
            max_size=6,
        ),
        st.dictionaries(st.text(max_size=2), st.integers(), max_size=3),
    )
)
def test_a_malformed_published_cell_is_no_cell(raw: object) -> None:
    cell = parse_cell(raw, 4)
    if cell is not None:
        assert isinstance(raw, list) and len(raw) == 4
        assert all(type(c) is int and abs(c) <= MAX_INDEX for c in cell)


def test_published_cells_are_checked() -> None:
    assert parse_cell([1, -2, 3, 0], 4) == (1, -2, 3, 0)
    for bad in ([1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3, True], [1, 2, 3, 1.0], [MAX_INDEX + 1] * 4):
        assert parse_cell(bad, 4) is None
    assert cell_of(_at(100.0, -100.0), RTT) == (2828, -2828)  # the farthest a coordinate goes
    assert cell_of(_at(100.0, -100.0), 1e-9) == (MAX_INDEX, -MAX_INDEX)  # clamped


def test_published_cells_make_views_with_moved_coordinates_agree() -> None:
    """Peers near the faces of their cells: readers that saw other versions of their
    coordinates agree on every region as long as the records publish the cells."""
    width = side(RTT, 2)
    rng = random.Random(3)
    peers = [_peer(i) for i in range(60)]
    first = {
        p: _at(rng.choice((-0.49, 0.49)) * width, rng.uniform(-0.3, 0.3) * width) for p in peers
    }
    cells = {p: place(c, RTT, None) for p, c in first.items()}
    moved = {
        p: _at(c.vector[0] * -1.05 if rng.random() < 0.3 else c.vector[0], c.vector[1])
        for p, c in first.items()
    }
    assert find_regions(first, RTT) != find_regions(moved, RTT)  # coordinates alone disagree
    assert find_regions(first, RTT, cells) == find_regions(moved, RTT, cells)
    for round_ in range(4):
        assert plan_groups(first, round_, CONFIG, cells) == plan_groups(
            moved, round_, CONFIG, cells
        )


def test_views_one_peer_apart_keep_the_groups_of_a_large_region() -> None:
    """A peer in one view and not the other moves a few peers of its own cell; before cells,
    every group after it in the region's order changed (about half of a region of 400)."""
    peers = [_peer(i) for i in range(400)]
    view = {p: Coordinate.origin(2) for p in peers}
    rng = random.Random(7)
    kept = total = 0
    for round_ in range(0, 40, 4):  # near rounds
        gone = rng.choice(peers)
        full = plan_groups(view, round_, CONFIG)
        less = plan_groups({p: c for p, c in view.items() if p != gone}, round_, CONFIG)
        assert len(full.regions) == 1
        for p in peers:
            if p != gone:
                a, b = full.key_of(p), less.key_of(p)
                kept += a == b and set(full.groups[a]) - {gone} == set(less.groups[b])
                total += 1
    assert kept / total > 0.9


def test_a_tight_cluster_cut_by_a_face_is_one_region_and_crowded_neighbours_are_two() -> None:
    width = side(RTT, 2)
    rng = random.Random(11)
    face = 0.5 * width
    lan = {_peer(i): _at(face + rng.uniform(-0.002, 0.002), 0.0) for i in range(6)}
    assert len({cell_of(c, RTT) for c in lan.values()}) == 2  # the face cuts it
    assert find_regions(lan, RTT) == (tuple(sorted(lan, key=lambda p: p.digest)),)
    # two cells full of peers, spread over their whole width: too wide to be one region
    crowd = {
        _peer(100 + i): _at(rng.uniform(-0.5, 1.5) * width, rng.uniform(-0.5, 0.5) * width)
        for i in range(80)
    }
    assert len(find_regions(crowd, RTT)) == len({cell_of(c, RTT) for c in crowd.values()}) == 2
    # a far peer never joins a tight pair it neighbours when together they are too wide
    pair = {_peer(200): _at(face - 0.001, 0.0), _peer(201): _at(face - 0.002, 0.0)}
    far = {_peer(202): _at(face + TIGHT * RTT + 0.001, 0.0)}
    assert len(find_regions({**pair, **far}, RTT)) == 2
