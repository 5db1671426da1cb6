"""The scale simulation of issue 32 (tests/scale_sim.py): the real planner at 1024 peers, and
many peers planning from their own views under churn (benchmarks/scale.py reports the figures)."""

from __future__ import annotations

import random
import statistics

from scale_sim import VIVALDI, SimConfig, World
from scale_sim_net import embedded

from swarm.averaging.groups.coordinates import Coordinate
from swarm.averaging.groups.regions import CROSS, NEAR, GroupPlan, plan_groups
from swarm.identity import PeerID


def _settled_view(peers: int, seed: int) -> tuple[World, dict[PeerID, Coordinate]]:
    """One view shared by every peer: the simulation's peers with the coordinates Vivaldi
    converges to on its map (within 2 ms)."""
    world = World(SimConfig(peers=peers, churn_per_min=0.0, minutes=0.0, warmup_s=0.0, seed=seed))
    rng = random.Random(seed)
    view = {}
    for peer in world.peers:
        vector, height = embedded(peer.site, VIVALDI.dims, 2.0, rng)
        view[peer.pid] = Coordinate(vector, height, 0.05)
    return world, view


def _plans(view: dict[PeerID, Coordinate], world: World, rounds: int) -> list[GroupPlan]:
    return [plan_groups(view, r, world.grouping) for r in range(rounds)]


def test_planner_at_1024_peers_gives_every_due_peer_a_group_within_bounds_per_seed() -> None:
    world, view = _settled_view(1024, seed=0)
    low, high = world.grouping.min_group_size, world.grouping.target_group_size
    plans = _plans(view, world, 8)  # rounds 3 and 7 mix regions
    assert [p.kind for p in plans] == [NEAR, NEAR, NEAR, CROSS] * 2
    for plan in plans:
        assert len({frozenset(r) for r in plan.regions}) >= 5  # the five regions, at least
        assert not plan.idle
        members = [p for g in plan.groups.values() for p in g]
        assert sorted(members, key=lambda p: p.digest) == sorted(view, key=lambda p: p.digest)
        for peer in view:  # every due peer: a key, and a group within the bounds
            group = plan.groups[plan.key_of(peer)]
            assert low <= len(group) <= high
    again = _plans(_settled_view(1024, seed=0)[1], world, 8)
    assert [dict(p.groups) for p in again] == [dict(p.groups) for p in plans]
    other_world, other_view = _settled_view(1024, seed=1)
    other = _plans(other_view, other_world, 8)
    assert all(set(a.groups) != set(b.groups) for a, b in zip(plans, other, strict=True))


def _run(**overrides: float) -> World:
    settings = {"peers": 128, "churn_per_min": 0.1, "minutes": 3.0, "warmup_s": 300.0}
    world = World(SimConfig(**{**settings, "round_s": 30.0, "seed": 3, **overrides}))  # type: ignore[arg-type]
    world.run()
    return world


def test_differing_views_under_churn_cost_little_averaging() -> None:
    """10% churn per minute: views differ (joins not read yet, dead peers until their TTL or a
    gone report), yet peers that plan apart rarely miss their group. The planner's promise: the
    cost of differing views is a smaller group or no group for some peers, never a wrong one.
    A newcomer, or a peer Vivaldi placed badly, predicted farther than region_rtt from every
    peer, joins its nearest region rather than sitting regular rounds out (it did before: 0.85-
    0.91 of all due peers averaged instead of 0.94-0.97)."""
    world = _run()
    rounds = world.rounds
    assert len(rounds) == 6 and all(r.due >= 100 for r in rounds)
    assert any(max(r.view_sizes) > min(r.view_sizes) for r in rounds)  # views do differ
    assert sum(r.left_mid_round for r in rounds) > 0  # and peers leave during rounds
    due = sum(r.due for r in rounds)
    seekers = sum(len(r.matchmaking_s) for r in rounds)  # due peers with a key
    averaged = sum(r.averaged for r in rounds)
    # seeds 0-5 of this setting: 0.94-0.97 of the due peers, every one of them with a key
    assert seekers == due
    assert averaged / due >= 0.92
    sizes = [s for r in rounds for s in r.group_sizes]
    assert min(sizes) >= world.grouping.min_group_size
    assert max(sizes) <= world.grouping.target_group_size
    for r in rounds:  # every averaged peer is in exactly one closed group of its round
        assert sum(r.group_sizes) == r.averaged
    assert statistics.median(s for r in rounds for s in r.matchmaking_s) < 5.0


def test_simulation_is_deterministic_for_a_seed() -> None:
    short = {"peers": 64, "minutes": 1.0, "warmup_s": 120.0}
    a, b = _run(**short), _run(**short)
    assert [r.keys for r in a.rounds] == [r.keys for r in b.rounds]
    assert [(r.averaged, r.group_sizes, r.matchmaking_s) for r in a.rounds] == [
        (r.averaged, r.group_sizes, r.matchmaking_s) for r in b.rounds
    ]
    c = _run(**short, seed=4)
    assert [r.keys for r in c.rounds] != [r.keys for r in a.rounds]
