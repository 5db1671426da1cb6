"""Averaging swarms behind the WAN emulator, shared by tests/test_latency_groups.py and
benchmarks/regions.py: in-process peers on one loop, each on its own loopback address.

:func:`start_swarm` starts one peer per emulated node (all bootstrapping from the first) and one
:class:`~swarm.averaging.Averager` per peer; :func:`average_until` runs numbered rounds on every
peer at once and watches the distance to the global mean.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from wan import WanEmulator, WanNode

from swarm.averaging import Averager, AveragingConfig, RoundResult
from swarm.averaging.groups.coordinates import predict_rtt
from swarm.averaging.groups.prober import Prober
from swarm.averaging.groups.regions import find_regions
from swarm.config import PeerConfig
from swarm.identity import PeerID
from swarm.peer import Peer


@dataclass
class Member:
    """One emulated host: its node, peer, prober, averagers by name, and tensor."""

    node: WanNode
    peer: Peer
    prober: Prober
    averagers: dict[str, Averager] = field(default_factory=dict)
    tensor: torch.Tensor | None = None


@dataclass
class Swarm:
    wan: WanEmulator
    members: list[Member]

    def region_of(self, peer_id: PeerID) -> str | None:
        for m in self.members:
            if m.peer.peer_id == peer_id:
                return self.wan._region[m.node.host]
        return None

    def by_region(self) -> dict[str | None, list[Member]]:
        out: dict[str | None, list[Member]] = {}
        for m in self.members:
            out.setdefault(self.wan._region[m.node.host], []).append(m)
        return out

    async def close(self) -> None:
        for m in self.members:
            for avg in m.averagers.values():
                await avg.close()
            await m.prober.close()
        await asyncio.gather(*(m.peer.close() for m in self.members))


async def start_swarm(
    wan: WanEmulator,
    regions: Sequence[str],
    *,
    run_id: str = "wan",
    probe_period: float = 0.3,
    probes: int = 4,
    heartbeat_s: float = 5.0,
) -> Swarm:
    """One peer per entry of ``regions`` (its region name), probing from the start."""
    members: list[Member] = []
    for i, region in enumerate(regions):
        node = await wan.add_node(f"{region}{i}", region=region)
        initial = (str(members[0].node.announce),) if members else ()
        config = PeerConfig(
            run_id=run_id,
            listen=node.listen,
            announce=node.announce,
            initial_peers=initial,
            heartbeat_s=heartbeat_s,
            dht_request_timeout_s=1.0,
        )
        peer = await Peer.start(config)
        prober = Prober(peer, period=probe_period, probes=probes)
        members.append(Member(node, peer, prober))
    for m in members:
        m.prober.start()
    return Swarm(wan, members)


def add_averagers(swarm: Swarm, name: str, **kwargs: Any) -> None:
    """An averager named ``name`` on every peer, sharing the peer's prober."""
    # the consensus checks compare with the exact global mean, which only the plain mean keeps
    # when honest peers start far apart (CenteredClip would clip them toward their group)
    options: dict[str, Any] = dict(
        codec="none",
        min_group_size=2,
        target_group_size=4,
        matchmaking_timeout_s=6.0,
        round_timeout_s=126.0,
        aggregator="mean",
    )
    options.update(kwargs)
    config = AveragingConfig(name=name, **options)
    for m in swarm.members:
        m.averagers[name] = Averager(m.peer, config, prober=m.prober)


async def wait_for_coordinates(swarm: Swarm, samples: int, timeout: float) -> None:
    """Until every peer took ``samples`` RTT samples (and published its coordinate)."""
    deadline = time.monotonic() + timeout
    while min(m.prober.samples for m in swarm.members) < samples:
        if time.monotonic() > deadline:
            raise TimeoutError("coordinates did not converge in time")
        await asyncio.sleep(0.1)


def regions_seen(member: Member, region_rtt: float = 0.05) -> set[frozenset[PeerID]]:
    """The regions that ``member`` computes from its current view."""
    return {frozenset(r) for r in find_regions(member.prober.view(), region_rtt)}


def true_regions(swarm: Swarm) -> set[frozenset[PeerID]]:
    return {frozenset(m.peer.peer_id for m in ms) for ms in swarm.by_region().values()}


async def wait_for_regions(swarm: Swarm, timeout: float) -> float:
    """Until every peer's view yields the emulated regions; returns the seconds it took."""
    started = time.monotonic()
    expected = true_regions(swarm)
    while any(regions_seen(m) != expected for m in swarm.members):
        if time.monotonic() - started > timeout:
            raise TimeoutError("the regions did not emerge in time")
        await asyncio.sleep(0.05)
    return time.monotonic() - started


async def rtt_prediction_errors(swarm: Swarm, pings: int = 3) -> list[float]:
    """Relative error of the predicted RTT for every pair, against the min of ``pings`` pings."""
    errors = []
    ms = swarm.members
    for i, a in enumerate(ms):
        for b in ms[i + 1 :]:
            measured = min([await a.peer.transport.ping(b.node.announce) for _ in range(pings)])
            predicted = predict_rtt(a.prober.coordinate, b.prober.coordinate)
            errors.append(abs(predicted - measured) / measured)
    return errors


def relative_error(tensors: Sequence[torch.Tensor], mean: torch.Tensor) -> float:
    """The largest ``||x_i - mean|| / ||mean||`` over the peers."""
    norm = float(mean.norm())
    return max(float((t - mean).norm()) / norm for t in tensors)


@dataclass
class Progress:
    """What :func:`average_until` saw."""

    results: dict[int, list[tuple[int, RoundResult]]]  # member index -> [(round, result)]
    consensus_s: float | None  # seconds until every peer was within ``tolerance``; None: never
    rounds_run: int  # rounds the slowest peer completed
    final_error: float
    wall_s: float


async def average_until(
    swarm: Swarm,
    name: str,
    rounds: int,
    *,
    tolerance: float = 1e-3,
    numel: int = 4096,
    seed: int = 0,
    stop_at_consensus: bool = False,
    first: int = 0,
) -> Progress:
    """Fresh random tensors on every peer, then ``rounds`` rounds numbered ``first``.. on all
    at once (peers are placed by coordinate in rounds from ``LEAD_ROUNDS`` after the next one
    they plan: :mod:`swarm.averaging.groups.placement`)."""
    g = torch.Generator().manual_seed(seed)
    for m in swarm.members:
        m.tensor = torch.randn(numel, generator=g) + 1.0
    tensors = [m.tensor for m in swarm.members]
    mean = torch.stack(tensors).mean(0)
    results: dict[int, list[tuple[int, RoundResult]]] = {i: [] for i in range(len(tensors))}
    started = time.monotonic()
    reached = asyncio.Event()
    consensus_s: float | None = None

    async def monitor() -> None:
        nonlocal consensus_s
        while relative_error(tensors, mean) > tolerance:
            await asyncio.sleep(0.01)
        consensus_s = time.monotonic() - started
        reached.set()

    async def run(i: int, m: Member) -> None:
        for r in range(first, first + rounds):
            if stop_at_consensus and reached.is_set():
                return
            result = await m.averagers[name].average([m.tensor], round_=r)
            results[i].append((r, result))

    watcher = asyncio.create_task(monitor())
    try:
        await asyncio.gather(*(run(i, m) for i, m in enumerate(swarm.members)))
        if stop_at_consensus:  # the monitor polls: give it one more look
            await asyncio.sleep(0.05)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    return Progress(
        results,
        consensus_s,
        min(len(v) for v in results.values()),
        relative_error(tensors, mean),
        time.monotonic() - started,
    )


def _groups(progress: Progress) -> dict[int, dict[bytes, tuple[PeerID, ...]]]:
    """Per round, the members of each averaged group."""
    groups: dict[int, dict[bytes, tuple[PeerID, ...]]] = {}
    for entries in progress.results.values():
        for r, result in entries:
            if result.averaged and result.group_id is not None:
                groups.setdefault(r, {})[result.group_id] = result.members
    return groups


def single_region_fraction(swarm: Swarm, progress: Progress, rounds: set[int]) -> float:
    """Among the averaged groups of ``rounds``, the fraction whose members share one region."""
    chosen = [m for r, found in _groups(progress).items() if r in rounds for m in found.values()]
    if not chosen:
        return 0.0
    return sum(len({swarm.region_of(p) for p in m}) == 1 for m in chosen) / len(chosen)


def group_regions(swarm: Swarm, progress: Progress) -> dict[int, list[str]]:
    """Per round, the regions of each averaged group's members ("aaab": three of a, one of b)."""
    return {
        r: sorted("".join(sorted(str(swarm.region_of(p)) for p in m)) for m in found.values())
        for r, found in sorted(_groups(progress).items())
    }


def median(values: Sequence[float]) -> float:
    return statistics.median(values)
