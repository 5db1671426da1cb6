"""An averaging peer in its own process, driven by tests/test_averaging_swarm.py.

Starts a :class:`~swarm.peer.Peer` on ``--listen`` (a loopback address, port 0), builds a
deterministic tensor from ``--seed`` (:func:`make_tensor`), and averages it ``--rounds`` times
per codec with one :class:`~swarm.averaging.Averager` per codec (``grouping="fixed"``). Every
round starts again from the same tensor, so with error feedback the running mean of a lossy
codec's results approaches the exact weighted mean.

Prints ``ADDRESS host:port`` and ``ID <peer id>`` once up, ``STALLED`` when ``--fault stall``
fires (the test may then
SIGKILL it), ``ROUND <json>`` after every round and ``DONE`` at the end. With ``--out``, saves
``{codec: {"first": ..., "last": ..., "mean": ...}}`` (torch.save): the first and last round's
results and the running mean of all results.

The ``ROUND`` fields: ``codec``, ``round``, ``averaged``, ``reason``, ``me`` (this peer's id),
``members`` (ids, in part order), ``ranges`` (``[start, end)`` of every part),
``parts`` (``{part: [ids averaged]}``; a missing part kept this peer's values), ``bytes_sent``,
``matchmaking_s``, ``allreduce_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time

import torch

from swarm.averaging import Averager, AveragingConfig, Fault, PartPlan, RoundResult
from swarm.config import PeerConfig
from swarm.peer import Peer


def make_tensor(seed: int, numel: int) -> torch.Tensor:
    """The values of the peer with ``seed``: different peers hold clearly different values."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g) + float(seed % 7)


async def wait_for_peers(peer: Peer, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while len(await peer.known_peers()) < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {len(await peer.known_peers())} of {count} peers seen")
        await asyncio.sleep(0.1)


async def wait_for_reachable(peer: Peer, count: int, timeout: float = 90.0) -> None:
    """Until ``count`` peers' records say others can dial them (directly or through a relay)."""
    dialable = ("direct", "mapped", "relayed")
    deadline = time.monotonic() + timeout
    while count:
        records = await peer.known_peers()
        if sum(r.extra.get("reach") in dialable for r in records.values()) >= count:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"fewer than {count} reachable peers: {list(records.values())}")
        await asyncio.sleep(0.2)


async def run(args: argparse.Namespace) -> None:
    config = PeerConfig(
        run_id="avg-test",
        listen=args.listen,
        initial_peers=tuple(args.initial_peers),
        bandwidth=args.bandwidth,
        heartbeat_s=2.0,
    )
    started = time.monotonic()
    peer = await Peer.start(config)
    print(f"ADDRESS {peer.address}", flush=True)
    print(f"ID {peer.peer_id}", flush=True)
    fault = Fault(args.fault)
    watchers: list[asyncio.Task[None]] = []
    averagers = {
        codec: Averager(
            peer,
            AveragingConfig(
                codec=codec,
                min_group_size=args.min_group,
                target_group_size=args.target_group,
                matchmaking_timeout_s=args.matchmaking_timeout,
                round_timeout_s=args.matchmaking_timeout + args.allreduce_timeout,
                gather_window_s=args.gather_window,
                stall_timeout_min_s=args.stall_timeout,
                group_key=args.group_key,
                grouping="fixed",
                name=f"avg{i}",
                aggregator=args.aggregator,
            ),
            fault=fault,
        )
        for i, codec in enumerate(args.codecs)
    }
    try:
        if fault is not Fault.NONE:
            watchers = [asyncio.create_task(announce_fault(a)) for a in averagers.values()]
        await wait_for_peers(peer, args.wait_peers)
        if args.wait_reachable:  # how long this peer took to learn how others reach it
            while peer.reach.value == "unknown" and time.monotonic() - started < 90:
                await asyncio.sleep(0.05)
            print(f"REACH {peer.reach.value} {time.monotonic() - started:.3f}", flush=True)
        await wait_for_reachable(peer, args.wait_reachable)
        original = make_tensor(args.seed, args.numel)
        saved = {}
        for codec, averager in averagers.items():
            running = torch.zeros_like(original)
            tensor = original.clone()
            first = tensor
            for rnd in range(args.rounds):
                tensor.copy_(original)
                result = await averager.average([tensor], weight=args.weight)
                running.add_(tensor)
                report(codec, rnd, result, peer, args.numel)
                if rnd == 0 and args.rounds > 1:
                    first = tensor.clone()
            saved[codec] = {"first": first, "last": tensor, "mean": running / max(1, args.rounds)}
        if args.out:
            torch.save(saved, args.out)
        if peer.nat is not None:
            print(f"RELAYED {peer.nat.relay.bytes_relayed}", flush=True)
        print("DONE", flush=True)
        await asyncio.sleep(args.linger)
    finally:
        for task in watchers:
            task.cancel()
        for averager in averagers.values():
            await averager.close()
        await peer.close()


async def announce_fault(averager: Averager) -> None:
    await averager.fault_triggered.wait()
    print("STALLED", flush=True)


def report(codec: str, rnd: int, result: RoundResult, peer: Peer, numel: int) -> None:
    # every worker announces the same bandwidth, so the plan splits the vector equally
    ranges = PartPlan.create(numel, [1.0] * len(result.members), 1).ranges if result.members else ()
    fields = {
        "codec": codec,
        "round": rnd,
        "averaged": result.averaged,
        "reason": result.reason,
        "me": str(peer.peer_id),
        "members": [str(p) for p in result.members],
        "ranges": [list(r) for r in ranges],
        "parts": {str(j): [str(p) for p in ids] for j, ids in result.parts.items()},
        "bytes_sent": result.bytes_sent,
        "matchmaking_s": round(result.matchmaking_s, 4),
        "allreduce_s": round(result.allreduce_s, 4),
    }
    print("ROUND " + json.dumps(fields), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--numel", type=int, default=1 << 20)
    p.add_argument("--weight", type=float, default=1.0)
    p.add_argument("--codecs", nargs="+", default=["none"])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--bandwidth", type=float, default=100e6 / 8)
    p.add_argument("--group-key", default="test")
    p.add_argument("--min-group", type=int, default=2)
    p.add_argument("--target-group", type=int, default=8)
    p.add_argument("--matchmaking-timeout", type=float, default=10.0)
    p.add_argument("--gather-window", type=float, default=None)
    p.add_argument("--allreduce-timeout", type=float, default=30.0)
    p.add_argument("--stall-timeout", type=float, default=3.0)
    p.add_argument("--fault", default="none", choices=[f.value for f in Fault])
    # the tests check exact weighted means, which CenteredClip only gives without outliers
    p.add_argument("--aggregator", default="mean", choices=["mean", "centered_clip"])
    p.add_argument("--wait-peers", type=int, default=1)
    p.add_argument("--wait-reachable", type=int, default=0)
    p.add_argument("--linger", type=float, default=0.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # what dropped a stream or a part, for the test's report when a round was not whole
    logging.getLogger("swarm.averaging").setLevel(logging.INFO)
    torch.set_num_threads(1)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
