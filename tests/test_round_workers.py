"""Where a round's tensor work runs: small chunks on the CPU at once on the event loop's thread,
the rest in the averager's worker threads (and every round still averages exactly)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest
import torch
from loopback_peers import fixed_group_config, start_peers

from swarm.averaging import Averager
from swarm.averaging.butterfly.parts import MIN_CHUNK_BYTES, PartPlan, chunk_elems_for
from swarm.averaging.butterfly.reducer import PartReducer
from swarm.averaging.butterfly.workers import INLINE_CHUNK_VALUES, Workers
from swarm.compression import get_codec


def test_small_chunks_on_the_cpu_run_inline_and_nothing_else_does():
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        cpu, gpu = torch.device("cpu"), torch.device("cuda")
        assert Workers.for_chunks(pool, INLINE_CHUNK_VALUES, cpu).inline
        assert not Workers.for_chunks(pool, INLINE_CHUNK_VALUES + 1, cpu).inline
        assert not Workers.for_chunks(pool, 16, gpu).inline  # it would wait for the device
        # the smallest chunks a slow link gets still go to the threads: only small vectors,
        # whose parts are that small, run inline
        for codec in ("none", "fp16", "int8", "sparse"):
            smallest = chunk_elems_for(get_codec(codec), MIN_CHUNK_BYTES)
            plan = PartPlan.create(10**7, [1.0] * 4, smallest)
            assert not Workers.for_chunks(pool, plan.largest_chunk(), cpu).inline, codec
    finally:
        pool.shutdown()


def test_the_largest_chunk_of_a_plan():
    assert PartPlan.create(1000, [1.0] * 4, 100).largest_chunk() == 100
    assert PartPlan.create(1000, [1.0] * 4, 4096).largest_chunk() == 250
    assert PartPlan.create(1000, [3.0, 1.0], 4096).largest_chunk() == 750


async def test_inline_work_runs_on_the_callers_thread_and_hands_on_its_errors():
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        for inline in (True, False):
            workers = Workers(pool, inline=inline)
            ran = await workers.run(threading.current_thread)
            assert (ran is threading.current_thread()) is inline
            with pytest.raises(ZeroDivisionError):
                await workers.run(lambda: 1 / 0)
            await workers.drain()  # nothing left in flight either way
    finally:
        pool.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("numel", [4 * 1000, 4 * (INLINE_CHUNK_VALUES + 1000)])
async def test_a_round_adds_chunks_on_the_loop_thread_only_when_they_are_small(monkeypatch, numel):
    threads: set[threading.Thread] = set()
    add_chunk = PartReducer.add_chunk

    def recorded(self, *args):
        threads.add(threading.current_thread())
        return add_chunk(self, *args)

    monkeypatch.setattr(PartReducer, "add_chunk", recorded)
    n = 4
    peers = await start_peers([161, 162, 163, 164])
    config = fixed_group_config(n, f"workers-{numel}", aggregator="centered_clip")
    averagers = [Averager(p, config) for p in peers]
    try:
        tensors = [torch.full((numel,), float(i)) for i in range(n)]
        results = await asyncio.gather(
            *(a.average([t]) for a, t in zip(averagers, tensors, strict=True))
        )
        assert all(r.averaged and len(r.parts) == n for r in results), results
        assert all(torch.equal(tensors[0], t) for t in tensors[1:])  # the same bits
        assert float(tensors[0].min()) > 0 and float(tensors[0].max()) < n - 1
        small = numel // n <= INLINE_CHUNK_VALUES
        assert (threads == {threading.current_thread()}) is small, threads
    finally:
        for a in averagers:
            await a.close()
        await asyncio.gather(*(p.close() for p in peers))
