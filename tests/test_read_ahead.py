"""Reading the peer list ahead of a round: the round's plan waits for no DHT read."""

from __future__ import annotations

import asyncio
import time

import torch
from loopback_peers import start_peers

from swarm.api import AsyncSwarm, Swarm
from swarm.averaging import Averager
from swarm.config import AveragingConfig
from swarm.training.cadence import READ_AHEAD_S, Cadence, RoundLookout


def test_seconds_to_due_on_the_clock_and_in_steps() -> None:
    clock = Cadence(None, period_s=30.0)
    assert clock.seconds_to_due(0, now=1000.0) is None  # no step taken: no boundary yet
    assert not clock.due(1, now=1000.0)
    assert clock.seconds_to_due(1, now=1005.0) == 15.0  # the next boundary: 1020
    steps = Cadence(10)
    assert steps.seconds_to_due(3) is None  # no step timed yet
    steps.step(0.0, now=0.0)
    steps.step(0.0, now=0.5)
    assert steps.seconds_to_due(3) == 7 * 0.5
    assert steps.seconds_to_due(12) == 0.0


def test_the_lookout_says_once_per_round() -> None:
    lookout = RoundLookout()
    assert not lookout.due_soon(None, now=0.0)
    assert not lookout.due_soon(READ_AHEAD_S + 1, now=100.0)
    assert lookout.due_soon(READ_AHEAD_S - 0.5, now=101.0)  # due at about 103.5
    assert not lookout.due_soon(READ_AHEAD_S - 1.0, now=101.5)  # the same round
    assert not lookout.due_soon(0.0, now=103.6)
    assert lookout.due_soon(READ_AHEAD_S - 0.5, now=131.0)  # the next round


async def test_a_read_ahead_of_the_round_serves_its_plan() -> None:
    peers = await start_peers([81, 82], run_id="read-ahead")
    config = AveragingConfig(grouping="latency", min_group_size=2, target_group_size=2, threads=1)
    averagers = [Averager(p, config) for p in peers]
    try:
        deadline = time.monotonic() + 20
        while len(await peers[0].known_peers()) < 2:
            assert time.monotonic() < deadline, "the peers never saw each other"
            await asyncio.sleep(0.2)
        planner = averagers[0].planner
        gets = peers[0].metrics.counts.dht_ops
        before = gets.get("get", 0)
        await planner.plan(6)  # a read of the loop above (no read ahead) serves no plan
        assert gets.get("get", 0) == before + 1
        planner.read_ahead()
        await peers[0].known_peers()  # (shares the read ahead's read: one get)
        before = gets.get("get", 0)
        planned = await planner.plan(7)
        assert gets.get("get", 0) == before  # the plan read nothing itself
        assert planned.key is not None and planned.expected == 2
        async with averagers[0]._lock:  # (as a round in flight holds it)
            averagers[0].read_ahead()  # its outcome must reach the next plan: no read ahead
        assert planner.reads_ahead == 1
        averagers[0].read_ahead()
        assert planner.reads_ahead == 2
    finally:
        await asyncio.gather(*(a.close() for a in averagers))
        await asyncio.gather(*(p.close() for p in peers))


async def test_a_swarm_reads_ahead_of_its_clock_rounds() -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    swarm = await AsyncSwarm.create(
        model, opt, run_id="read-ahead-facade", listen="127.0.0.83:0", inner_steps="2s"
    )
    try:
        read_before_due = None
        deadline = time.monotonic() + 10
        while read_before_due is None:
            assert time.monotonic() < deadline, "no round fell due"
            reads = swarm.averager.planner.reads_ahead
            model(torch.ones(1, 2)).sum().backward()
            report = await swarm.step()
            opt.zero_grad()
            if report.round_due:
                read_before_due = reads
            await asyncio.sleep(0.05)
        assert read_before_due == 1
    finally:
        await swarm.close()


def test_the_sync_swarm_reads_ahead_on_its_loop_thread() -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Swarm(model, opt, run_id="read-ahead-sync", listen="127.0.0.84:0", inner_steps="2s") as s:
        deadline = time.monotonic() + 10
        while not s.step().round_due:
            assert time.monotonic() < deadline, "no round fell due"
            time.sleep(0.05)
        assert s._async.averager.planner.reads_ahead == 1
