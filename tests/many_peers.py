"""Many unequal peers in one process (issue 32): real AsyncSwarm peers behind the WAN emulator.

Shared by tests/test_many_peers.py and ``benchmarks/scale.py --real``. Every peer is an
:class:`~swarm.api.AsyncSwarm` (real DHT, transport, prober, averager and DiLoCo engine) on its
own emulated host (tests/wan.py): one uplink of its own rate shared by all its connections and
datagrams, and a one-way delay by region. All peers share this process's event loop and torch.

Compute is emulated: a peer's step is the real forward/backward of a small MLP (the task of
tests/poison_run.py) padded with a sleep to ``step_s / speed`` seconds, so that a 0.25x peer
takes four times as long per step without four times the CPU (the machine has 2 cores for
every peer). Utilization is the engine's own figure over the measured window: one less the
share of wall time ``step()`` blocked on the swarm.

With ``churn_per_min`` c, every peer leaves after an exponential time of mean 1/c minutes (half
of them close, half vanish without a word) and a new peer with a new identity takes its host a
second later, joining through a live peer and downloading the swarm's state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from many_peers_figures import Harvest, current_rss_mb, figures, flat, mlp, open_fds, rss_mb
from poison_run import BATCH, data, test_loss
from torch import nn
from wan import WanEmulator, WanNode
from wan_uplinks import SharedUplinks

from swarm.api import AsyncSwarm

MBIT = 1e6 / 8  # bytes per second in one Mbit/s
DELAYS = {("eu", "eu"): 0.005, ("us", "us"): 0.005, ("eu", "us"): 0.045}
# the library's defaults but shorter timeouts (heartbeat 10 s, probes every 5 s: 16 peers that
# probe every second and announce every 2 s keep one event loop too busy to train)
OPTIONS: dict[str, Any] = {
    "codec": "int8",
    "matchmaking_timeout_s": 5.0,
    "round_timeout_s": 30.0,
    "target_group_size": 4,
}


@dataclass(frozen=True)
class PeerSpec:
    """One host: compute speed (1.0: ``step_s`` per step), uplink in Mbit/s, region."""

    speed: float = 1.0
    uplink_mbit: float = 100.0
    region: str = "eu"


@dataclass
class RunConfig:
    specs: list[PeerSpec]
    duration_s: float
    warmup_s: float = 20.0  # not measured: records spread, coordinates settle
    step_s: float = 0.1  # a 1.0x step
    inner_steps: int = 20
    hidden: int = 64
    lr: float = 3e-3
    churn_per_min: float = 0.0
    seed: int = 0
    sample_every_s: float = 0.0  # > 0: sample memory, descriptors and tasks (a soak)
    # after training, every live peer calls average_parameters() this many times (how a run
    # ends with one model): the spread is measured before and after
    finish_rounds: int = 0
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class PeerRun:
    """What one host saw (all its incarnations under churn)."""

    spec: PeerSpec
    node: WanNode
    swarm: AsyncSwarm | None = None
    due: int = 0  # rounds that landed in the measured window
    averaged: int = 0
    reasons: list[str] = field(default_factory=list)
    waited_s: float = 0.0  # step() blocked on the swarm, in the window
    window_s: float = 0.0  # wall time trained in the window
    samples: int = 0
    matchmaking_s: list[float] = field(default_factory=list)
    rounds: list[tuple[str, float]] = field(default_factory=list)  # (group, round_s) averaged
    restarts: int = 0
    nan: bool = False
    # the group size of each finishing round (1: averaged with nobody)
    finished: list[int] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)  # why finishing rounds failed


def run_options(config: RunConfig) -> dict[str, Any]:
    """Every peer's Swarm options."""
    return {**OPTIONS, "inner_steps": config.inner_steps, **config.options}


def make_model(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return mlp(hidden)


class ManyPeers:
    """Start, train, churn and measure ``config.specs`` peers; :meth:`run` returns figures.

    One process runs all of them (:meth:`run`), or a share of them (tests/many_procs.py: its
    nodes, then the others' as remote nodes, :meth:`start`, :meth:`train`)."""

    def __init__(self, config: RunConfig, uplinks: SharedUplinks | None = None):
        self.config = config
        self.rng = random.Random(config.seed)
        self.runs: dict[int, PeerRun] = {}  # by the spec's index
        self.wan = WanEmulator(delays=DELAYS, default_delay=0.005, uplinks=uplinks)
        self.options = run_options(config)
        self.window: tuple[float, float] = (0.0, 0.0)
        self.join_s: list[float] = []  # each start: joining and downloading the state
        self.others: list[str] = []  # other processes' peers' addresses, to join through

    async def run(self) -> dict[str, Any]:
        cfg = self.config
        try:
            await self.add_nodes(range(len(cfg.specs)))
            await self.start([0])  # the first peer starts the run, the others join it together
            await self.start(range(1, len(cfg.specs)))
            return figures(cfg, self.options, [await self.train(time.monotonic())])
        finally:
            await self.close()

    async def add_nodes(self, indices: Iterable[int]) -> dict[int, WanNode]:
        """This process's hosts: ``indices`` of ``config.specs``."""
        for i in indices:
            spec = self.config.specs[i]
            node = await self.wan.add_node(f"p{i}", region=spec.region)
            self.wan.set_uplink(node, spec.uplink_mbit * MBIT)
            self.runs[i] = PeerRun(spec, node)
        return {i: r.node for i, r in self.runs.items()}

    def add_remote(self, nodes: dict[int, WanNode]) -> None:
        """Other processes' hosts, by index."""
        for i, node in nodes.items():
            if i not in self.runs:
                self.wan.add_remote(node, region=self.config.specs[i].region)
                self.others.append(str(node.announce))

    async def start(self, indices: Iterable[int]) -> None:
        """Start the peers of ``indices`` together; each joins through a started one."""
        runs = [self.runs[i] for i in indices]
        joined = await asyncio.gather(*(self._start(r) for r in runs), return_exceptions=True)
        for r, swarm in zip(runs, joined, strict=True):
            r.swarm = swarm if isinstance(swarm, AsyncSwarm) else None
        failed = [e for e in joined if isinstance(e, BaseException)]
        if failed:
            raise failed[0]  # (the started ones close in close())

    async def train(self, start: float) -> Harvest:
        """Train every host from now; measure from ``start`` + warm-up for the duration."""
        cfg = self.config
        # tiny models: torch's intra-op threads would only contend with the one event loop
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self.window = (start + cfg.warmup_s, start + cfg.warmup_s + cfg.duration_s)
            loop_cpu: list[float] = []  # the event loop thread's CPU seconds at the window's start
            clock = asyncio.create_task(self._loop_cpu(loop_cpu))
            datagrams = [0, 0]
            watch = asyncio.create_task(self._count_datagrams(datagrams))
            samples: list[dict[str, float | None]] = []
            sampler = asyncio.create_task(self._sample(samples, start))
            await asyncio.gather(*(self._host(i, run) for i, run in self.runs.items()))
            for task in (watch, sampler, clock):
                task.cancel()
            trained = self._models()  # and anchors, before any finishing round
            live = [r for r in self.runs.values() if r.swarm is not None]
            await asyncio.gather(*(self._finish(r) for r in live))
            return self._harvest(
                trained,
                datagrams[1] - datagrams[0],
                (time.thread_time() - loop_cpu[0]) / max(1e-9, time.monotonic() - self.window[0]),
                samples,
            )
        finally:
            torch.set_num_threads(threads)

    async def close(self) -> None:
        await asyncio.gather(*(r.swarm.close() for r in self.runs.values() if r.swarm is not None))
        await self.wan.close()

    def _models(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The live peers' flat models and anchors."""
        live = [r.swarm for r in self.runs.values() if r.swarm is not None]
        with torch.no_grad():
            return [flat(s.model.parameters()) for s in live], [
                flat(s.engine.outer.anchor) for s in live
            ]

    async def _finish(self, run: PeerRun) -> None:
        assert run.swarm is not None
        for _ in range(self.config.finish_rounds):
            outcome = await run.swarm.average_parameters()
            run.finished.append(outcome.group_size if outcome.averaged else 1)
            if not outcome.averaged:
                run.finish_reasons.append(outcome.reason)

    def _harvest(
        self,
        trained: tuple[list[torch.Tensor], list[torch.Tensor]],
        datagrams: int,
        loop_cpu_share: float,
        samples: list[Any],
    ) -> Harvest:
        live = [r.swarm for r in self.runs.values() if r.swarm is not None]
        models, anchors = self._models()
        parameters = sum(p.numel() for p in live[0].model.parameters()) if live else 0
        runs = [dataclasses.replace(r, swarm=None) for r in self.runs.values()]
        return Harvest(
            runs, models, anchors, [test_loss(s.model) for s in live], self.join_s, datagrams,
            loop_cpu_share, rss_mb(), parameters, samples, *trained,
        )  # fmt: skip

    async def _loop_cpu(self, out: list[float]) -> None:
        """The CPU time of this (the loop's) thread when the window opens."""
        await asyncio.sleep(max(0.0, self.window[0] - time.monotonic()))
        out.append(time.thread_time())

    async def _count_datagrams(self, out: list[int]) -> None:
        await asyncio.sleep(max(0.0, self.window[0] - time.monotonic()))
        out[0] = out[1] = self.wan.datagrams()
        while True:
            await asyncio.sleep(0.5)
            if time.monotonic() <= self.window[1]:
                out[1] = self.wan.datagrams()

    async def _sample(self, out: list[dict[str, float | None]], start: float) -> None:
        every = self.config.sample_every_s
        while every > 0 and time.monotonic() < self.window[1]:
            out.append(
                {
                    "t_s": round(time.monotonic() - start, 1),
                    "rss_mb": current_rss_mb(),
                    "fds": open_fds(),
                    "tasks": len(asyncio.all_tasks()),
                    "peers": sum(r.swarm is not None for r in self.runs.values()),
                }
            )
            await asyncio.sleep(every)

    async def _start(self, run: PeerRun) -> AsyncSwarm:
        # several of each, as a user would list: under churn any one may have just left (a
        # join through one local and one remote peer, both gone, ended a 64-peer run)
        alive = [r for r in self.runs.values() if r.swarm is not None and r is not run]
        initial = [str(r.node.announce) for r in self.rng.sample(alive, min(3, len(alive)))]
        # (other processes' peers: started, or back within seconds)
        initial += self.rng.sample(self.others, min(2, len(self.others)))
        model = make_model(self.config.hidden)
        opt = torch.optim.Adam(model.parameters(), lr=self.config.lr)
        began = time.monotonic()
        try:
            return await self._create(model, opt, run, initial)
        finally:
            self.join_s.append(time.monotonic() - began)

    async def _create(
        self, model: nn.Module, opt: torch.optim.Optimizer, run: PeerRun, initial: list[str]
    ) -> AsyncSwarm:
        return await AsyncSwarm.create(
            model,
            opt,
            run_id="many",
            listen=str(run.node.listen),
            announce=str(run.node.announce),
            initial_peers=initial,
            **self.options,
        )

    async def _host(self, index: int, run: PeerRun) -> None:
        """Train on this host until the window ends, replaced by a new peer after each leave."""
        cfg = self.config
        g = torch.Generator().manual_seed(cfg.seed * 1000 + index)
        while time.monotonic() < self.window[1]:
            leave_at = math.inf
            if cfg.churn_per_min > 0:
                leave_at = time.monotonic() + self.rng.expovariate(cfg.churn_per_min / 60)
            await self._train(run, g, min(leave_at, self.window[1]))
            if time.monotonic() >= self.window[1]:
                break
            swarm, run.swarm = run.swarm, None
            if self.rng.random() < 0.5:
                await swarm.close()
            else:  # vanish: the host goes dark (its sockets close without a leave marker)
                await _vanish(swarm)
            await asyncio.sleep(1.0)
            run.swarm = await self._start(run)
            run.restarts += 1
        if run.swarm is not None:
            await run.swarm.wait_round()

    async def _train(self, run: PeerRun, g: torch.Generator, until: float) -> None:
        swarm = run.swarm
        assert swarm is not None
        step_s = self.config.step_s / run.spec.speed
        last_mm = None
        while (now := time.monotonic()) < until:
            began = time.perf_counter()
            x, y = data(BATCH, g)
            loss = nn.functional.cross_entropy(swarm.model(x), y)
            loss.backward()
            await asyncio.sleep(max(0.0, step_s - (time.perf_counter() - began)))
            report = await swarm.step(samples=BATCH)
            swarm.optimizer.zero_grad()
            if not self.window[0] <= now < self.window[1]:
                continue
            run.window_s += time.perf_counter() - began
            run.waited_s += report.wait_s
            run.samples += BATCH
            run.nan = run.nan or not math.isfinite(loss.item())
            if not report.round_due:
                continue
            run.due += 1
            figures = swarm.peer.progress.last_round if swarm.peer is not None else None
            if figures is not None and figures is not last_mm:
                last_mm = figures
                run.matchmaking_s.append(figures.matchmaking_s)
            if report.averaged:
                run.averaged += 1
                run.rounds.append((figures.group if figures else "", report.round_s))
            else:
                run.reasons.append(report.reason)


async def _vanish(swarm: AsyncSwarm) -> None:
    """Drop a peer as a crash would: no leave marker, no goodbye (its sockets just close)."""
    if swarm.peer is not None:
        swarm.peer._expiration = 0.0  # (fault injection) as if it never announced: no marker
    await swarm.close()


def mixed_specs(n: int, speeds: tuple[float, ...], uplinks: tuple[float, ...]) -> list[PeerSpec]:
    """``n`` hosts cycling through the speeds and uplinks (independently), half per region."""
    return [
        PeerSpec(
            speeds[i % len(speeds)],
            uplinks[(i // len(speeds)) % len(uplinks)],
            "eu" if i < (n + 1) // 2 else "us",
        )
        for i in range(n)
    ]


async def run(config: RunConfig) -> dict[str, Any]:
    return await ManyPeers(config).run()
