"""Many peers over several processes: tests/many_peers.py's hosts split between workers.

One event loop runs out of time near 64 peers (its DHT, transport, prober, averager and the
emulator's proxies, all on one thread): more cores do not help it. Here each of ``processes``
workers runs its own loop, emulator and share of the hosts (a random draw of
``config.specs``), and the emulators form one WAN (tests/wan.py: a shared uplink per host;
every worker can send a datagram as any host's proxy). Linux only (``SO_REUSEPORT`` on UDP).

The steps, in lockstep through queues: every worker binds its hosts' addresses; each learns the
others'; the worker holding host 0 starts its peer; every other peer joins through it (or a
started peer of its own worker); once all have started, the parent names one start time and
every worker trains, churns and measures over the same window, then sends what it measured
(:class:`many_peers_figures.Harvest`).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import random
import socket
import time
from dataclasses import dataclass
from typing import Any

from many_peers import ManyPeers, RunConfig, run_options
from many_peers_figures import Harvest, figures
from wan_uplinks import SharedUplinks

STEP_TIMEOUT_S = 300.0  # a worker that says nothing this long has failed


def run_processes(config: RunConfig, processes: int) -> dict[str, Any]:
    """Run ``config`` over ``processes`` worker processes; the figures of :func:`many_peers.run`."""
    n = len(config.specs)
    if not 1 <= processes <= n:
        raise ValueError(f"processes must be between 1 and the {n} peers")
    if not hasattr(socket, "SO_REUSEPORT"):
        raise OSError("peers over several processes need SO_REUSEPORT (Linux, macOS)")
    context = multiprocessing.get_context("spawn")
    uplinks = SharedUplinks(context)
    # regions, speeds and uplinks mixed in every worker (its load: the fast peers' compute)
    order = random.Random(config.seed).sample(range(n), n)
    blocks = [sorted(order[w::processes]) for w in range(processes)]
    inboxes = [context.Queue() for _ in blocks]
    outbox = context.Queue()
    workers = [
        context.Process(
            target=_worker,
            args=(_Job(config, w, block, uplinks, inboxes[w], outbox),),  # (spawn: sys.path too)
            daemon=True,
        )
        for w, block in enumerate(blocks)
    ]
    for p in workers:
        p.start()
    try:
        nodes: dict[int, Any] = {}
        for _ in workers:
            nodes.update(_expect(outbox, "nodes", workers))
        for inbox in inboxes:
            inbox.put(("nodes", nodes))
        _expect(outbox, "seeded", workers)  # host 0's peer runs
        for inbox in inboxes:
            inbox.put(("join", str(nodes[0].announce)))
        for _ in workers:
            _expect(outbox, "started", workers)
        start = time.monotonic() + 1.0
        for inbox in inboxes:
            inbox.put(("train", start))
        harvests = [_expect(outbox, "harvest", workers) for _ in workers]
        return figures(config, run_options(config), harvests)
    finally:
        for p in workers:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def _expect(outbox: Any, kind: str, workers: list[Any]) -> Any:
    """The next message, which must be ``kind``; a worker's error is raised here."""
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while True:
        try:
            got, value = outbox.get(timeout=1.0)
        except queue.Empty:
            dead = [p for p in workers if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"a worker failed or hung waiting for {kind!r}") from None
            continue
        if got == "error":
            raise RuntimeError(f"a worker failed: {value}")
        if got != kind:
            raise RuntimeError(f"expected {kind!r} from a worker, got {got!r}")
        return value


@dataclass
class _Job:
    """One worker's share of the run, and its ends of the queues."""

    config: RunConfig
    index: int
    block: list[int]  # its hosts (indices of config.specs)
    uplinks: SharedUplinks
    inbox: Any
    outbox: Any


def _worker(job: _Job) -> None:
    try:
        asyncio.run(_work(job))
    except BaseException as e:
        job.outbox.put(("error", f"worker {job.index}: {type(e).__name__}: {e}"))
        raise


async def _work(job: _Job) -> None:
    config, block, inbox, outbox = job.config, job.block, job.inbox, job.outbox
    peers = ManyPeers(config, job.uplinks)
    peers.rng.seed(config.seed * 1000 + job.index)

    async def receive(kind: str) -> Any:
        got, value = await asyncio.to_thread(inbox.get, True, STEP_TIMEOUT_S)
        assert got == kind, (got, kind)
        return value

    try:
        outbox.put(("nodes", await peers.add_nodes(block)))
        peers.add_remote(await receive("nodes"))
        everyone, peers.others = peers.others, []
        if 0 in block:
            await peers.start([0])
            outbox.put(("seeded", None))
        seed = await receive("join")
        peers.others = [] if 0 in block else [seed]
        await peers.start([i for i in block if i != 0])
        peers.others = everyone
        outbox.put(("started", None))
        harvest: Harvest = await peers.train(await receive("train"))
        outbox.put(("harvest", harvest))
    finally:
        await peers.close()
