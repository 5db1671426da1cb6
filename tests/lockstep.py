"""Engines training in lockstep, their rounds averaged exactly in memory (no network): the
loss of overlapped rounds landing a few steps late against blocking DiLoCo's at the same steps.

A regression task split into disjoint shards, one per peer. Time runs in ticks: a peer of speed
``s`` takes ``s`` inner steps per tick and ``s · inner`` per round, so every peer's round falls
due at the same tick (rounds due by time, as ``inner_steps="30s"`` makes them). An overlapped
round lands ``delay`` ticks after its launch, or when a peer's next round waits for it.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

from swarm.config import SwarmConfig
from swarm.training.engine import TrainingEngine
from swarm.training.overlap import RoundWait
from swarm.training.rounds import RoundOutcome, RoundPlan


@dataclass(frozen=True)
class Lockstep:
    """The swarm: speeds (inner steps per tick, one per peer) and how its rounds group them."""

    speeds: tuple[int, ...] = (1, 1, 1, 1)
    group: int = 0  # members per group, redrawn every round (0: all peers in one group)
    inner: int = 10  # ticks per round
    rounds: int = 24
    fragments: int = 1
    optimizer: str = "sgd"  # or "adam"
    seed: int = 0


def lockstep_loss(overlap: bool, delay: int, swarm: Lockstep = Lockstep()) -> float:
    """Train ``swarm`` and return the loss of the mean of its final models."""
    peers, size = len(swarm.speeds), 16
    g = torch.Generator().manual_seed(swarm.seed)
    x = torch.randn(4096, 16, generator=g)
    y = torch.tanh(2 * x @ (torch.randn(16, 1, generator=g) / 4))
    engines = [_engine(swarm, speed, overlap) for speed in swarm.speeds]
    samplers = [torch.Generator().manual_seed(100 + r) for r in range(peers)]
    draw = torch.Generator().manual_seed(swarm.seed + 7)
    in_flight: list[tuple[int, list[RoundPlan], list[concurrent.futures.Future]]] = []

    def average(plans: list[RoundPlan]) -> RoundOutcome:
        members = swarm.group or peers
        order = torch.randperm(peers, generator=draw).tolist() if swarm.group else range(peers)
        ranked = [plans[i] for i in order]
        groups = [ranked[k : k + members] for k in range(0, peers, members)]
        for group in groups:
            total = sum(p.weight for p in group)
            for parts in zip(*(p.tensors for p in group), strict=True):
                mean = sum(p.weight * t for p, t in zip(group, parts, strict=True)) / total
                for t in parts:
                    t.copy_(mean)
        return RoundOutcome(True, members, 0, 0)

    def land(due: int) -> None:
        while in_flight and in_flight[0][0] <= due:
            _, plans, futures = in_flight.pop(0)
            outcome = average(plans)
            for f in futures:
                f.set_result(outcome)

    for tick in range(1, swarm.rounds * swarm.inner + 1):
        land(tick - delay)
        due: dict[int, tuple[Generator, RoundPlan]] = {}
        for sub in range(max(swarm.speeds)):
            for r, e in enumerate(engines):
                if sub >= swarm.speeds[r]:
                    continue
                idx = torch.arange(r, len(x), peers)[
                    torch.randint(len(x) // peers, (size,), generator=samplers[r])
                ]
                e.optimizer.zero_grad()
                torch.nn.functional.mse_loss(e.model(x[idx]), y[idx]).backward()
                flow = e.step(size)
                request = next(flow, None)
                while isinstance(request, RoundWait):
                    land(tick)
                    request = send(flow, request.handle.result())
                if request is not None:
                    due[r] = (flow, request)
        if not due:
            continue
        assert len(due) == peers, f"tick {tick}: {len(due)} of {peers} peers due"
        plans = [due[r][1] for r in range(peers)]
        if plans[0].background:
            replies: list[Any] = [concurrent.futures.Future() for _ in plans]
            in_flight.append((tick, plans, replies))
        else:
            replies = [average(plans)] * peers
        for r, reply in enumerate(replies):
            assert send(due[r][0], reply) is None
    land(swarm.rounds * swarm.inner)
    for e in engines:
        flow = e.wait_round()
        request = next(flow, None)
        if request is not None:
            send(flow, request.handle.result())
    with torch.no_grad():
        models = (e.model.parameters() for e in engines)
        mean = [sum(ps) / peers for ps in zip(*models, strict=True)]
        for p, m in zip(engines[0].model.parameters(), mean, strict=True):
            p.copy_(m)
        return torch.nn.functional.mse_loss(engines[0].model(x), y).item()


def send(flow: Generator, reply: Any) -> Any:
    """Send ``reply`` into a step's flow; its next request, or None once it returned."""
    try:
        return flow.send(reply)
    except StopIteration:
        return None


def _engine(swarm: Lockstep, speed: int, overlap: bool) -> TrainingEngine:
    torch.manual_seed(swarm.seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    if swarm.optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = SwarmConfig.build(
        inner_steps=swarm.inner * speed,
        codec="none",
        overlap=overlap,
        anchor_sync_every=0,
        fragments=swarm.fragments,
    )
    return TrainingEngine(model, opt, config)
