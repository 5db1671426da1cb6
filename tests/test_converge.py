"""The converging plan of values rounds: a grid that averages a swarm to one model."""

from __future__ import annotations

import asyncio
import hashlib
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.utils import parameters_to_vector

from swarm.api import AsyncSwarm
from swarm.averaging import averager as averager_module
from swarm.averaging.groups.converge import converging_plan, grid_sides
from swarm.averaging.groups.regions import GRID, GroupingConfig
from swarm.identity import PeerID


def _peers(n: int, salt: int = 0) -> list[PeerID]:
    return [PeerID(hashlib.sha256(f"{salt}/{i}".encode()).digest()) for i in range(n)]


def _grouped(peers: list[PeerID], round_: int, config: GroupingConfig) -> set[PeerID]:
    return {p for g in converging_plan(peers, round_, config).groups.values() for p in g}


def _average(values: dict[PeerID, torch.Tensor], peers, round_, config) -> None:
    for members in converging_plan(peers, round_, config).groups.values():
        mean = torch.stack([values[p] for p in members]).mean(0)
        for p in members:
            values[p] = mean.clone()


@pytest.mark.parametrize(("n", "target", "rounds"), [(64, 4, 3), (16, 4, 2), (16, 8, 2), (8, 8, 1)])
def test_a_full_grid_reaches_one_model_in_dims_rounds(n: int, target: int, rounds: int) -> None:
    config = GroupingConfig(target_group_size=target)
    peers = _peers(n)
    g = torch.Generator().manual_seed(0)
    values = {p: torch.randn(5, generator=g, dtype=torch.float64) for p in peers}
    mean = torch.stack(list(values.values())).mean(0)
    start = 7  # any round to start from: the axes come round in turn
    for r in range(start, start + rounds):
        _average(values, peers, r, config)
    for v in values.values():
        assert torch.allclose(v, mean, atol=1e-12)


def _spread(values: dict[PeerID, torch.Tensor]) -> float:
    stacked = torch.stack(list(values.values()))
    mean = stacked.mean(0)
    return float((stacked - mean).norm(dim=1).max() / mean.norm())


def _random_groups(peers: list[PeerID], rng: random.Random, target: int) -> list[list[PeerID]]:
    order = rng.sample(peers, len(peers))
    count = -(-len(order) // target)
    return [order[k::count] for k in range(count)]


@pytest.mark.parametrize(("n", "target"), [(50, 4), (200, 4), (100, 8), (500, 8)])
def test_a_partial_grid_converges_faster_than_random_groups(n: int, target: int) -> None:
    """Deterministic: the same values, 6 rounds of the grid against 6 of random groups."""
    config, peers = GroupingConfig(target_group_size=target), _peers(n)
    g = torch.Generator().manual_seed(n)
    start = {p: 1 + torch.randn(256, generator=g, dtype=torch.float64) for p in peers}
    grid, shuffled, rng = dict(start), dict(start), random.Random(0)
    for r in range(6):
        _average(grid, peers, r, config)
        for members in _random_groups(peers, rng, target):
            mean = torch.stack([shuffled[p] for p in members]).mean(0)
            shuffled.update({p: mean for p in members})
    assert _spread(grid) < _spread(shuffled) < 0.05 * _spread(start)


@pytest.mark.parametrize(
    ("n", "sides"), [(8, (4, 2)), (64, (4, 4, 4)), (130, (4, 4, 3, 3)), (4, (4,)), (1, (2,))]
)
def test_grid_sides_hold_every_peer_in_the_fewest_axes(n: int, sides: tuple[int, ...]) -> None:
    assert grid_sides(n, GroupingConfig(target_group_size=4)) == sides


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 300),
    target=st.integers(2, 9),
    min_size=st.integers(2, 9),
    round_=st.integers(0, 10**6),
)
def test_every_peer_has_one_place_in_groups_within_bounds(
    n: int, target: int, min_size: int, round_: int
) -> None:
    config = GroupingConfig(min_group_size=min(min_size, target), target_group_size=target)
    peers = _peers(n, salt=n)
    plan = converging_plan(reversed(peers), round_, config)
    assert plan == converging_plan(peers, round_, config)  # deterministic, any order given
    placed = [p for g in plan.groups.values() for p in g] + list(plan.idle)
    assert sorted(placed, key=lambda p: p.digest) == sorted(peers, key=lambda p: p.digest)
    sizes = [len(g) for g in plan.groups.values()]
    assert all(config.min_group_size <= s <= target for s in sizes)
    sides = grid_sides(n, config)
    assert math.prod(sides) >= n and plan.kind == GRID
    assert all(config.min_group_size <= side <= target for side in sides)
    # rows cut short leave some peers out of a round, none out of a whole pass over the axes
    # (where groups of half the target may average, as near rounds need too)
    first = round_ - round_ % len(sides)
    grouped = {p for r in range(first, first + len(sides)) for p in _grouped(peers, r, config)}
    if config.min_group_size <= max(2, target // 2) and n >= config.min_group_size:
        assert len(grouped) == n


def test_consecutive_rounds_group_different_peers() -> None:
    config, peers = GroupingConfig(target_group_size=4), _peers(64)
    first, second = (set(converging_plan(peers, r, config).groups.values()) for r in (0, 1))
    assert not first & second
    met = {p: set() for p in peers}
    for r in range(3):
        for members in converging_plan(peers, r, config).groups.values():
            for p in members:
                met[p] |= set(members) - {p}
    assert all(len(m) == 9 for m in met.values())  # 3 axes x 3 others, never the same twice


async def test_sixteen_real_peers_end_with_one_model_after_two_values_rounds() -> None:
    """16 peers in groups of 4 make a 4 x 4 grid: two average_parameters() calls of every peer
    (real DHT, matchmaking and butterfly, codec none) leave one model. Two rounds of near
    groups of 4 (the plan before) would do so by chance only (a 4 x 4 transversal: p = 0.005)."""
    swarms = await _linear_swarm("converge-16", list(range(16)), 60, "none")
    try:
        flat = [_flat(s) for s in swarms]
        mean = torch.stack(flat).mean(0)
        for _ in range(2):
            outcomes = await asyncio.gather(*(s.average_parameters() for s in swarms))
            assert all(o.averaged for o in outcomes), [o.reason for o in outcomes]
        got = [_flat(s) for s in swarms]
        for g in got[1:]:  # the robust aggregator's mean, not the plain one: but one model
            torch.testing.assert_close(g, got[0], rtol=0, atol=1e-6)
        spread = max(float((f - mean).norm()) for f in flat)
        assert float((got[0] - mean).norm()) < 0.5 * spread
    finally:
        await asyncio.gather(*(s.close() for s in swarms), return_exceptions=True)


async def _linear_swarm(
    run_id: str, seeds: list[int], first_address: int, codec: str
) -> list[AsyncSwarm]:
    """Peers on loopback, each holding the linear model of its seed, once each sees them all."""
    swarms: list[AsyncSwarm] = []
    try:
        for i, seed in enumerate(seeds):
            torch.manual_seed(seed)
            model = torch.nn.Linear(16, 4)
            swarms.append(
                await AsyncSwarm.create(
                    model,
                    torch.optim.SGD(model.parameters(), lr=0.1),
                    run_id=run_id,
                    listen=f"127.0.0.{first_address + i}:0",
                    initial_peers=[swarms[0].address] if swarms else [],
                    codec=codec,
                    target_group_size=4,
                    matchmaking_timeout_s=5.0,
                    heartbeat_s=1.0,
                    # 16 peers in one loop lag their heartbeats by seconds on a loaded machine:
                    # a record that expired there would drop its peer from some views, and a
                    # member whose view lacks a peer plans another grid
                    record_ttl_s=30.0,
                    sync_on_join=False,
                )
            )
        for _ in range(50):  # every view holds every peer: every peer plans the same grid
            views = await asyncio.gather(*(s.known_peers() for s in swarms))
            if all(len(v) == len(seeds) for v in views):
                return swarms
            await asyncio.sleep(0.2)
        pytest.fail(f"the peers did not all see each other: {sorted(map(len, views))}")
    except BaseException:
        await asyncio.gather(*(s.close() for s in swarms), return_exceptions=True)
        raise


def _flat(s: AsyncSwarm) -> torch.Tensor:
    return parameters_to_vector(s.model.parameters()).detach()


async def test_a_values_round_of_equal_models_sends_nothing() -> None:
    """Peers that hold the same model skip average_parameters()'s all-reduce: it would move
    nothing but int8's rounding, and a whole model's round costs minutes on a home uplink. Once
    one model differs they average, every member leaves with the same bits, and the next call
    skips again."""
    swarms = await _linear_swarm("equal-values", [0, 0, 0], 90, "int8")
    try:
        before = _flat(swarms[0])
        outcomes = await asyncio.gather(*(s.average_parameters() for s in swarms))
        assert all(o.averaged and o.group_size == 3 for o in outcomes), outcomes
        assert all(o.bytes_sent == o.bytes_received == 0 for o in outcomes), outcomes
        assert all(torch.equal(_flat(s), before) for s in swarms)  # not rounded

        with torch.no_grad():
            for p in swarms[2].model.parameters():
                p.add_(0.5)
        outcomes = await asyncio.gather(*(s.average_parameters() for s in swarms))
        assert all(o.averaged and o.bytes_sent > 0 for o in outcomes), outcomes
        assert all(torch.equal(_flat(s), _flat(swarms[0])) for s in swarms[1:])
        assert not torch.equal(_flat(swarms[0]), before)

        outcomes = await asyncio.gather(*(s.average_parameters() for s in swarms))
        assert all(o.averaged and o.bytes_sent == 0 for o in outcomes), outcomes
    finally:
        await asyncio.gather(*(s.close() for s in swarms), return_exceptions=True)


async def test_a_peer_lying_that_its_values_equal_the_others_moves_no_honest_model(
    monkeypatch,
) -> None:
    """A peer whose model differs but that joins with the digest of the others' gets the round
    skipped, nothing more: the honest models keep their values, bit for bit."""
    swarms = await _linear_swarm("equal-values-liar", [0, 0, 0], 95, "int8")
    try:
        honest = _flat(swarms[0])
        with torch.no_grad():
            for p in swarms[2].model.parameters():
                p.mul_(-3.0)
        liar_slots = {t.data_ptr() for t in swarms[2].engine.outer.slots}
        real = averager_module.state_digest
        swarms[0].engine.outer.load_values()  # the slots a values round digests
        told = real(swarms[0].engine.outer.slots)

        def digest(tensors):
            lying = bool(tensors) and tensors[0].data_ptr() in liar_slots
            return told if lying else real(tensors)

        monkeypatch.setattr(averager_module, "state_digest", digest)
        outcomes = await asyncio.gather(*(s.average_parameters() for s in swarms))
        assert all(o.averaged and o.bytes_sent == 0 for o in outcomes), outcomes
        assert all(torch.equal(_flat(s), honest) for s in swarms[:2])
    finally:
        await asyncio.gather(*(s.close() for s in swarms), return_exceptions=True)
