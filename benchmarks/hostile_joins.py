"""Joins under attack and in bursts, for ``benchmarks/hostile.py`` (issue 35, items 1 and 6).

    python benchmarks/hostile.py --attacks sybil_state_providers burst_join

Both attacks run training peers in this process (``AsyncSwarm``, a small MLP, real loopback
sockets), a swarm of their own beside ``hostile.py``'s three ``swarm-peer`` victims, which the
prober lists and pings meanwhile (a trained peer that joined them would plan groups with peers
that never train, and pay a matchmaking timeout per round). Their joins count in
``legit_success`` and ``legit_p50_ms`` beside the prober's calls.

- ``sybil_state_providers``: one peer trains 75 rounds alone and a second adopts its state (the
  honest providers, on 127.0.0.0/24); ``rate`` hostile providers on 127.0.9.0/24 adopt it too,
  then lie through the real provider code: first all serve NaN weights behind an honest
  sketch (``Fault.LIE_NAN``), then all claim a round 10^9 ahead with weights scaled 1000x
  (``Fault.LIE_ROUND``). Joiners start one at a time (three per lie) through the trained peer.
  A join counts in ``legit_success`` when it started and took no hostile state.
- ``burst_join``: one peer trains 75 rounds alone, then ``rate`` joiners start at the same
  moment through it. A join counts when it started and adopted the trained state (round 75,
  the same values), and ``legit_p50_ms`` includes the joins' times.

``joiners_started`` counts the joiners that came out of ``AsyncSwarm.create`` at all (the
issue: one of three died in ``Swarm(...)``). Neither attack is a flood: ``achieved_rate`` and
``amplification`` are null.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch
from hostile_net import REPORTED

from swarm.api import AsyncSwarm
from swarm.training.transfer import LIE_ROUNDS, Fault

RUN = "bench-joins"  # a swarm of its own beside the victims
TRAINED_ROUNDS = 75
JOINERS_PER_LIE = 3
OPTIONS = {"codec": "none", "heartbeat_s": 2.0, "inner_steps": 1, "overlap": False}


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


async def _start(seed: int, peers: list[str], host: str = "127.0.0.1") -> AsyncSwarm:
    m = _model(seed)
    return await AsyncSwarm.create(
        m,
        torch.optim.SGD(m.parameters(), lr=0.05),
        run_id=RUN,
        initial_peers=peers,
        listen=f"{host}:0",
        **OPTIONS,
    )


async def _trained() -> AsyncSwarm:
    """A peer that started a swarm and trained ``TRAINED_ROUNDS`` rounds alone."""
    peer = await _start(0, [])
    g = torch.Generator().manual_seed(0)
    while peer.round < TRAINED_ROUNDS:
        x = torch.randn(32, 16, generator=g)
        (peer.model(x) - x[:, :4]).pow(2).mean().backward()
        await peer.step(samples=32)
        peer.optimizer.zero_grad()
    return peer


def _values(swarm: AsyncSwarm) -> list[torch.Tensor]:
    return [p.detach().clone() for p in swarm.model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


async def _timed_start(seed: int, peers: list[str]) -> tuple[AsyncSwarm | None, float]:
    started = time.perf_counter()
    try:
        swarm = await _start(seed, peers)
    except Exception as e:  # a benchmark counts failures
        logging.getLogger(__name__).error("a joiner did not start: %s", e)
        swarm = None
    return swarm, (time.perf_counter() - started) * 1000


def _report(started: int, legit: list[tuple[str, bool, float, int]]) -> None:
    REPORTED["joiners_started"] = started
    REPORTED.setdefault("legit_results", []).extend(legit)


async def attack_sybil_state_providers(victims, rate, duration):
    first = await _trained()
    peers = [first, await _start(1, [first.address])]
    hostile: list[AsyncSwarm] = []
    legit: list[tuple[str, bool, float, int]] = []
    started = 0
    try:
        for i in range(rate):
            hostile.append(await _start(100 + i, [first.address], host=f"127.0.9.{i + 1}"))
        liars = {h.peer.peer_id for h in hostile}
        for lie in (Fault.LIE_NAN, Fault.LIE_ROUND):
            for h in hostile:
                h._provider.fault = lie
                h._provider._cache.clear()
            for k in range(JOINERS_PER_LIE):
                joiner, ms = await _timed_start(10 + k, [first.address])
                if joiner is None:
                    legit.append(("join", False, ms, 0))
                    continue
                started += 1
                took = joiner.joined is not None and bool(liars & set(joiner.joined.providers))
                clean = all(bool(torch.isfinite(t).all()) for t in _values(joiner))
                ok = not took and clean and joiner.round < LIE_ROUNDS
                legit.append(("join", ok, ms, 0))
                await joiner.close()
    finally:
        for p in reversed(hostile + peers):
            await p.close()
    _report(started, legit)
    await asyncio.sleep(max(0.0, duration - 1))
    return None


async def attack_burst_join(victims, rate, duration):
    first = await _trained()
    trained = _values(first)
    joiners: list[AsyncSwarm] = []
    try:
        results = await asyncio.gather(*(_timed_start(1 + i, [first.address]) for i in range(rate)))
        joiners = [j for j, _ in results if j is not None]
        legit = [
            (
                "join",
                j is not None and j.round == TRAINED_ROUNDS and _same(_values(j), trained),
                ms,
                0,
            )
            for j, ms in results
        ]
    finally:
        for p in reversed([first, *joiners]):
            await p.close()
    _report(len(joiners), legit)
    await asyncio.sleep(max(0.0, duration - 1))
    return None


JOIN_ATTACKS = {
    # name: (function, rate): hostile providers / joiners at once
    "sybil_state_providers": (attack_sybil_state_providers, 3),
    "burst_join": (attack_burst_join, 12),
}
