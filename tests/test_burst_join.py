"""Joiners arriving all at once in a young swarm all start, adopt the trained state, average.

The way a run begins: an organizer's peer trains alone, then volunteers start at the same
moment through it. Joiners that have not adopted a state decline to offer one, so the trained
peer is the only provider a burst sees (issue 35: a joiner died in ``Swarm(...)``, outvoted by a
peer at round 0, or silently adopted another joiner's untrained state). In-process peers on one
loop keep 12 joiners affordable on 2 cores; every byte still crosses real loopback sockets.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from swarm.api import AsyncSwarm
from swarm.training.transfer import LIE_ROUNDS, Fault

TRAINED_ROUNDS = 75
OPTIONS = {
    "codec": "none",
    "heartbeat_s": 2.0,
    "inner_steps": 1,
    "overlap": False,  # blocking rounds: each step's report says whether it averaged
    "matchmaking_timeout_s": 5.0,
    "round_timeout_s": 30.0,
}
HOSTILE_SUBNET = "127.0.9"  # an attacker's own /24 inside loopback


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 2))


async def start(seed: int, peers=(), host: str = "127.0.0.1") -> AsyncSwarm:
    m = model(seed)
    return await AsyncSwarm.create(
        m,
        torch.optim.SGD(m.parameters(), lr=0.05),
        run_id="burst",
        initial_peers=list(peers),
        listen=f"{host}:0",
        **OPTIONS,
    )


async def train(swarm: AsyncSwarm, steps: int, seed: int) -> list:
    """``steps`` steps (each a blocking round); the reports."""
    g = torch.Generator().manual_seed(seed)
    reports = []
    for _ in range(steps):
        x = torch.randn(16, 6, generator=g)
        loss = (swarm.model(x) - x[:, :2]).pow(2).mean()
        loss.backward()
        reports.append(await swarm.step(samples=16, loss=loss.detach()))
        swarm.optimizer.zero_grad()
    return reports


def values(swarm: AsyncSwarm) -> list[torch.Tensor]:
    return values_of(swarm.model)


def values_of(m: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in m.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


async def burst(joiners: int, faults: tuple[Fault, ...] = ()) -> None:
    """One peer trains alone, ``faults`` hostile providers join it, then ``joiners`` peers
    start at the same moment; all of them must start, none may take a hostile state, and every
    joiner averages within its first two rounds."""
    first = await start(0)
    peers, hostile, started = [first], [], []
    try:
        await train(first, TRAINED_ROUNDS, seed=0)
        assert first.round == TRAINED_ROUNDS
        trained = values(first)  # its anchor: what it serves (alone, the model follows it)
        assert same(trained, [t.clone() for t in first.engine.outer.anchor])
        for i in range(len(faults)):
            h = await start(100 + i, [first.address], host=f"{HOSTILE_SUBNET}.{i + 1}")
            hostile.append(h)
            assert h.round == TRAINED_ROUNDS and same(values(h), trained)
        for h, fault in zip(hostile, faults, strict=True):
            h._provider.fault = fault  # from now on it serves its lie through the real code
            h._provider._cache.clear()  # (the honest snapshot it built for the others)
        initial = [values_of(model(1 + i)) for i in range(joiners)]
        results = await asyncio.gather(
            *(start(1 + i, [first.address]) for i in range(joiners)), return_exceptions=True
        )
        started = [r for r in results if isinstance(r, AsyncSwarm)]
        peers += started
        assert len(started) == joiners, [r for r in results if not isinstance(r, AsyncSwarm)]
        liars = {h.peer.peer_id for h in hostile}
        for j, own in zip(started, initial, strict=True):
            got = values(j)
            assert all(bool(torch.isfinite(t).all()) for t in got)
            if not faults:  # the trained state, not round 0 nor another joiner's weights
                assert j.joined is not None and j.round == TRAINED_ROUNDS
                assert same(got, trained)
            elif j.joined is not None:  # adopted: the honest state only
                assert not liars & set(j.joined.providers), j.joined
                assert j.round == TRAINED_ROUNDS and same(got, trained)
            else:  # undecided: its own weights, offered only once trained
                assert j.round == 0 and same(got, own) and not j._provider.offering
            assert j.round < LIE_ROUNDS
        if faults:  # liars were heard and refused: not a vacuous pass. Not every one of them
            # each time: joiners ask the providers their DHT reads list (in one full suite, one
            # of the three went unasked)
            assert any(h._provider._cache for h in hostile)
            for h in hostile:
                await h.close()
            hostile.clear()
        # an adopter plans with the trained peer's round order: its first round (75, a cross
        # round: 75 % 4 == 3) groups it even before its coordinates are measured. An undecided
        # joiner starts at round 0 and meets the others at its first cross round (3)
        rounds = 4 if faults else 2
        reports = await asyncio.gather(
            *(train(p, rounds, seed=1000 + k) for k, p in enumerate(peers))
        )
        for j, rs in zip(peers[1:], reports[1:], strict=True):
            within = rs[:2] if j.joined is not None else rs
            assert any(r.averaged for r in within), [(r.round, r.group_size, r.reason) for r in rs]
    finally:
        for p in reversed(hostile + peers):
            await p.close()


@pytest.mark.parametrize("joiners", [3, 6, 12])
async def test_a_burst_of_joiners_adopts_the_trained_state_and_averages(joiners: int) -> None:
    await burst(joiners)


@pytest.mark.parametrize("fault", [Fault.LIE_NAN, Fault.LIE_ROUND])
async def test_a_burst_beside_three_hostile_providers_starts_and_takes_no_lie(
    fault: Fault, caplog
) -> None:
    with caplog.at_level(logging.WARNING, logger="swarm.training.joining"):
        await burst(6, (fault,) * 3)
