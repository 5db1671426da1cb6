"""Latency-aware group keys: regions from coordinates, near and cross rounds, random baseline."""

from __future__ import annotations

import hashlib
import math
import random
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.averaging.groups.coordinates import Coordinate, Vivaldi, predict_rtt
from swarm.averaging.groups.regions import (
    CROSS,
    NEAR,
    RANDOM,
    GroupingConfig,
    GroupPlan,
    _predicted_rtts,
    find_regions,
    group_key,
    plan_groups,
    random_plan,
)
from swarm.errors import AveragingError, ConfigError
from swarm.identity import PeerID

CONFIG = GroupingConfig(min_group_size=2, target_group_size=4, cross_every=3, region_rtt=0.05)
Region = dict[PeerID, str]


def _peer(i: int) -> PeerID:
    return PeerID(hashlib.sha256(b"peer %d" % i).digest())


def _view(
    sizes: dict[str, int], seed: int = 0, jitter: float = 0.001
) -> tuple[dict[PeerID, Coordinate], Region]:
    """Coordinates of peers in regions 120 ms apart (RTT), each peer within ``jitter`` of its
    region's centre; returns the view and each peer's true region."""
    centres = {"eu": (0.0, 0.0), "us": (0.12, 0.0), "asia": (0.06, 0.11)}
    rng = random.Random(seed)
    view, truth, n = {}, {}, 0
    for name, size in sizes.items():
        cx, cy = centres[name]
        for _ in range(size):
            vector = (cx + rng.uniform(-jitter, jitter), cy + rng.uniform(-jitter, jitter))
            view[_peer(n)] = Coordinate(vector, 0.001, 0.1)
            truth[_peer(n)] = name
            n += 1
    return view, truth


def _check_partition(plan: GroupPlan, view: dict[PeerID, Coordinate]) -> None:
    members = [p for g in plan.groups.values() for p in g] + list(plan.idle)
    assert sorted(members, key=lambda p: p.digest) == sorted(view, key=lambda p: p.digest)
    # only a region too small to average sits out, and only in a regular round (a random plan
    # idles as many peers, drawn at random)
    if plan.kind == NEAR:
        idle = set(plan.idle)
        assert all(len(r) < CONFIG.min_group_size for r in plan.regions if set(r) & idle)
    if plan.kind == CROSS:
        assert not plan.idle
    for key, group in plan.groups.items():
        assert key and "/" not in key and key.startswith(f"r{plan.round}.")
        assert len(group) <= CONFIG.target_group_size
        if len(view) >= CONFIG.min_group_size:
            assert len(group) >= CONFIG.min_group_size


def _single_region_share(plan: GroupPlan, truth: Region) -> float:
    single = [len({truth[p] for p in g}) == 1 for g in plan.groups.values()]
    return sum(single) / len(single)


def test_regions_emerge_from_coordinates() -> None:
    view, truth = _view({"eu": 9, "us": 7, "asia": 5})
    regions = find_regions(view, CONFIG.region_rtt)
    assert sorted(len(r) for r in regions) == [5, 7, 9]
    assert all(len({truth[p] for p in r}) == 1 for r in regions)
    assert find_regions({}, 0.05) == ()


@pytest.mark.parametrize("seed", range(3))
def test_near_rounds_group_near_peers(seed: int) -> None:
    view, truth = _view({"eu": 13, "us": 11}, seed)
    for round_ in (r for r in range(12) if not CONFIG.is_cross_round(r)):
        plan = plan_groups(view, round_, CONFIG)
        assert plan.kind == NEAR
        _check_partition(plan, view)
        assert _single_region_share(plan, truth) >= 0.9


def test_near_groups_with_converged_vivaldi_coordinates() -> None:
    """End to end: coordinates learned from noisy samples still give single-region groups."""
    rng, n = random.Random(7), 20
    one_way = [[0.002 if i % 2 == j % 2 else 0.060 for j in range(n)] for i in range(n)]
    nodes = [Vivaldi(rng=random.Random(i)) for i in range(n)]
    for _ in range(200):
        for i in range(n):
            j = rng.choice([k for k in range(n) if k != i])
            nodes[i].observe(2 * one_way[i][j] * rng.uniform(1.0, 1.2), nodes[j].coordinate, j)
    view = {_peer(i): nodes[i].coordinate for i in range(n)}
    truth = {_peer(i): "even" if i % 2 == 0 else "odd" for i in range(n)}
    plan = plan_groups(view, 0, CONFIG)
    _check_partition(plan, view)
    assert _single_region_share(plan, truth) >= 0.9


def test_cross_rounds_mix_regions() -> None:
    view, truth = _view({"eu": 8, "us": 7})
    for round_ in (2, 5, 8):
        plan = plan_groups(view, round_, CONFIG)
        assert plan.kind == CROSS and CONFIG.is_cross_round(round_)
        _check_partition(plan, view)
        # 15 peers (one cell) -> 4 groups; both regions have >= 4 peers: every group spans both
        assert len(plan.groups) == 4
        assert all({truth[p] for p in g} == {"eu", "us"} for g in plan.groups.values())


def test_cross_rounds_of_a_large_swarm_mix_regions_inside_cells() -> None:
    view, truth = _view({"eu": 130, "us": 110, "asia": 60})
    spanning = total = 0
    for round_ in (2, 5, 8):
        plan = plan_groups(view, round_, CONFIG)
        assert plan.kind == CROSS
        _check_partition(plan, view)
        assert len(plan.groups) >= 300 // CONFIG.target_group_size
        spanning += sum(len({truth[p] for p in g}) >= 2 for g in plan.groups.values())
        total += len(plan.groups)
    assert spanning / total > 0.95


def test_cross_round_with_three_regions_takes_one_per_region() -> None:
    view, truth = _view({"eu": 3, "us": 3, "asia": 3})
    plan = plan_groups(view, 2, GroupingConfig(target_group_size=3, cross_every=3))
    assert len(plan.groups) == 3
    assert all(sorted(truth[p] for p in g) == ["asia", "eu", "us"] for g in plan.groups.values())


def test_lone_peer_takes_part() -> None:
    view, truth = _view({"eu": 8, "asia": 1})
    lone = next(p for p, r in truth.items() if r == "asia")
    near = plan_groups(view, 0, CONFIG)
    assert len(near.regions) == 2
    _check_partition(near, view)  # never a group of one
    # it averages with the nearest region every round rather than sitting out three of four
    assert not near.idle and len(near.groups[near.key_of(lone)]) >= 2
    cross = plan_groups(view, 2, CONFIG)
    assert len(cross.groups[cross.key_of(lone)]) >= 2


def test_a_peer_at_the_edge_of_a_region_joins_it() -> None:
    """A peer alone in its grid cell, near a crowd across a face of it or far from everyone,
    joins the region of its nearest peer in a near round instead of sitting out."""
    line = {_peer(i): Coordinate((0.0025 * i, 0.0), 0.0005, 0.1) for i in range(13)}  # 0-30 ms
    edge, far = _peer(50), _peer(51)
    view = {
        **line,
        edge: Coordinate((0.07, 0.0), 0.0005, 0.1),
        far: Coordinate((0.4, 0.0), 0.0005, 0.1),
    }
    regions = find_regions(view, CONFIG.region_rtt)
    assert (edge,) in regions and (far,) in regions  # alone in their cells
    assert min(predict_rtt(view[edge], c) for c in line.values()) <= CONFIG.region_rtt
    for round_ in (0, 1, 3):
        plan = plan_groups(view, round_, CONFIG)
        assert plan.kind == NEAR and not plan.idle
        for peer in (edge, far):
            group = plan.groups[plan.key_of(peer)]
            assert CONFIG.min_group_size <= len(group) <= CONFIG.target_group_size
            assert set(group) - {edge, far} <= set(line)
        _check_partition(plan, view)


def test_groups_rotate_between_rounds() -> None:
    view, _ = _view({"eu": 16})
    partners = [
        frozenset(frozenset(g) for g in plan_groups(view, r, CONFIG).groups.values())
        for r in (0, 1, 3)
    ]
    assert len(set(partners)) == 3  # other partners every round inside the same region


def test_deterministic_and_independent_of_view_order() -> None:
    view, _ = _view({"eu": 10, "us": 9, "asia": 6})
    shuffled = list(view.items())
    random.Random(1).shuffle(shuffled)
    for round_ in range(6):
        a, b = plan_groups(view, round_, CONFIG), plan_groups(dict(shuffled), round_, CONFIG)
        assert a == b
        for peer in view:
            assert group_key(view, peer, round_, CONFIG) == a.key_of(peer)


def test_slightly_different_views_agree() -> None:
    """Coordinates that moved a little, or a peer missing in another region, change nothing."""
    view, truth = _view({"eu": 10, "us": 9}, seed=1)
    moved, _ = _view({"eu": 10, "us": 9}, seed=2)  # every peer moved by up to ~2 ms
    assert plan_groups(view, 0, CONFIG) == plan_groups(moved, 0, CONFIG)
    eu_peer = next(p for p, r in truth.items() if r == "eu")
    partial = {p: c for p, c in view.items() if p != eu_peer}
    full, part = plan_groups(view, 0, CONFIG), plan_groups(partial, 0, CONFIG)
    for peer, region in truth.items():
        if region == "us":
            assert full.key_of(peer) == part.key_of(peer)


def test_random_plan_keeps_the_sizes_and_mixes() -> None:
    view, truth = _view({"eu": 13, "us": 11})
    shares = []
    for round_ in range(6):
        near, rand = plan_groups(view, round_, CONFIG), random_plan(view, round_, CONFIG)
        assert rand.kind == RANDOM
        _check_partition(rand, view)
        assert Counter(map(len, near.groups.values())) == Counter(map(len, rand.groups.values()))
        shares.append(_single_region_share(rand, truth))
        assert group_key(view, _peer(0), round_, CONFIG, randomized=True) == rand.key_of(_peer(0))
    assert sum(shares) / len(shares) < 0.5


@settings(max_examples=60, deadline=None)
@given(
    coords=st.lists(
        st.tuples(st.floats(-0.3, 0.3), st.floats(-0.3, 0.3), st.floats(0, 0.02)),
        min_size=1,
        max_size=40,
    ),
    round_=st.integers(0, 10**6),
)
def test_every_peer_gets_one_key(coords: list[tuple[float, float, float]], round_: int) -> None:
    view = {_peer(i): Coordinate((x, y), h, 0.5) for i, (x, y, h) in enumerate(coords)}
    for plan in (plan_groups(view, round_, CONFIG), random_plan(view, round_, CONFIG)):
        _check_partition(plan, view)
    for region in find_regions(view, CONFIG.region_rtt):  # cells: a bounded diameter
        assert all(
            math.dist(view[a].vector, view[b].vector) <= CONFIG.region_rtt * (1 + 1e-12)
            for a in region
            for b in region
        )


def test_errors() -> None:
    view, _ = _view({"eu": 3})
    with pytest.raises(AveragingError):
        group_key(view, _peer(99), 0, CONFIG)
    with pytest.raises(AveragingError):
        plan_groups({**view, _peer(99): Coordinate.origin(3)}, 0, CONFIG)
    for bad in (
        {"min_group_size": 1},
        {"min_group_size": 5, "target_group_size": 4},
        {"cross_every": 0},
        {"region_rtt": 0.0},
        {"region_rtt": float("nan")},
    ):
        with pytest.raises(ConfigError):
            GroupingConfig(**bad)  # type: ignore[arg-type]


def test_views_one_peer_apart_keep_most_groups_and_their_keys() -> None:
    """A peer that just died or joined is in some views and not others: groups cut as runs of
    the hashed order, keyed by their first member, keep most peers' groups and keys alike in
    both views (dealing round-robin kept about a quarter; runs keep over 40%)."""
    peers = [_peer(i) for i in range(12)]
    view = {p: Coordinate.origin(2) for p in peers}
    rng = random.Random(5)
    kept = total = 0
    for round_ in range(300):
        gone = rng.choice(peers)
        full = plan_groups(view, round_, CONFIG)
        less = plan_groups({p: c for p, c in view.items() if p != gone}, round_, CONFIG)
        for p in peers:
            if p == gone:
                continue
            a, b = full.key_of(p), less.key_of(p)
            total += 1
            kept += a == b and set(full.groups[a]) - {gone} == set(less.groups[b])
    assert kept / total > 0.38


def test_group_keys_are_unique_and_name_the_first_member() -> None:
    view, _ = _view({"eu": 7, "us": 6})
    for round_ in range(6):
        plan = plan_groups(view, round_, CONFIG)
        for key, members in plan.groups.items():
            first = min(members, key=lambda p: p.digest)
            assert key.endswith(first.digest.hex()[:16])
        assert len(plan.groups) == len(
            {min(m, key=lambda p: p.digest) for m in plan.groups.values()}
        )


def test_vectorized_predictions_are_predict_rtt() -> None:
    """The predictions that place a peer alone in its cell are predict_rtt's, to a rounding."""
    view, _ = _view({"eu": 30, "us": 30, "asia": 20}, jitter=0.02)
    coords = list(view.values())
    rows = [0, 7, 42, 79]
    dist = _predicted_rtts(coords, rows)
    for r, i in enumerate(rows):
        for j in range(len(coords)):
            if i == j:
                assert np.isinf(dist[r, j])
            else:
                exact = predict_rtt(coords[i], coords[j])
                assert dist[r, j] == pytest.approx(exact, rel=1e-15, abs=0)
