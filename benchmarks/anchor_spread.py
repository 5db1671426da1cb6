"""How far apart the peers' DiLoCo anchors drift when groups are smaller than the swarm.

N in-process peers (one event loop, one loopback address each) train the churn task's MLP
(``mlp_task.py``, 203k parameters) in ``diloco`` with a sparse codec, in groups of 2-3 that the
latency planner reshuffles every round. After every round (all peers landed it) the anchor
spread is measured: ``max over peers of ||anchor - mean anchor|| / ||mean anchor||``.

One JSON object per ``--sync-every`` value (0: no anchor sync), with the fields ``peers``,
``group``, ``codec``, ``anchor_sync_every``, ``anchor_sync_codec``, ``rounds``, ``spread_max``
(over the run), ``spread_final``, ``spread_last10`` (mean of the last ten rounds),
``spread_series`` (every tenth round), ``sync_picked`` (peer-rounds whose group the group id
picked for a sync; a group whose members hold the same anchors skips it),
``bytes_per_round`` (sent + received per peer and round, mean), ``identical_groups`` (picked
groups whose members then held bit-identical anchors and momentum, of those seen), and the
test losses at the end: ``loss_mean_anchor`` (of the mean anchor), ``loss_anchors`` (mean over
the peers' anchors) and ``loss_peers`` (mean over the peers' models).

    python benchmarks/anchor_spread.py --peers 6 --group 3 --rounds 60 --sync-every 0 16 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time

import mlp_task
import torch

from swarm.api import AsyncSwarm


def spread(anchors: list[torch.Tensor]) -> float:
    """``max_i ||a_i - mean|| / ||mean||`` over flat anchors."""
    stack = torch.stack([a.double() for a in anchors])
    mean = stack.mean(0)
    return float((stack - mean).norm(dim=1).max() / mean.norm())


def flat_anchor(swarm: AsyncSwarm) -> torch.Tensor:
    return torch.cat([a.reshape(-1) for a in swarm.engine.outer.anchor])


def outer_state(swarm: AsyncSwarm) -> list[torch.Tensor]:
    outer = swarm.engine.outer
    return [*outer.anchor, *outer.momentum]


async def train_round(swarm: AsyncSwarm, g: torch.Generator, steps: int) -> tuple[int, bool]:
    """``steps`` inner steps then the landing of the round they started; (bytes, synced)."""
    report = None
    for _ in range(steps):
        x, y = mlp_task.make_data(mlp_task.BATCH, g)
        loss = torch.nn.functional.cross_entropy(swarm.model(x), y)
        loss.backward()
        report = await swarm.step(samples=mlp_task.BATCH, loss=loss.item())
        swarm.optimizer.zero_grad()
    landed = await swarm.wait_round()
    report = landed or report
    moved = report.bytes_sent + report.bytes_received if report is not None else 0
    last = swarm.peer.progress.last_round
    return moved, last is not None and last.averaged


async def run(args: argparse.Namespace, sync_every: int) -> dict:
    base = 20 + 10 * (sync_every % 20)
    options = {
        "codec": args.codec,
        "inner_steps": args.inner_steps,
        "target_group_size": args.group,
        "min_group_size": 2,
        "matchmaking_timeout_s": 5.0,
        "round_timeout_s": 40.0,
        "heartbeat_s": 1.0,
        "anchor_sync_every": sync_every,
        "sync_on_join": False,
        "outer_momentum": args.outer_momentum,
    }
    swarms: list[AsyncSwarm] = []
    try:
        for i in range(args.peers):
            model = mlp_task.make_model(args.seed)  # one initial model: the anchors start equal
            swarms.append(
                await AsyncSwarm.create(
                    model,
                    mlp_task.make_optimizer(model),
                    run_id=f"spread-{sync_every}",
                    listen=f"127.0.0.{base + i}:0",
                    initial_peers=[swarms[0].address] if swarms else [],
                    **options,
                )
            )
        await asyncio.sleep(2.0)  # every record in the DHT: the first plans see the whole swarm
        gens = [torch.Generator().manual_seed(1000 * args.seed + i) for i in range(args.peers)]
        spreads, moved, synced, identical, seen = [], [], 0, 0, 0
        for _ in range(args.rounds):
            rounds = await asyncio.gather(
                *(train_round(s, g, args.inner_steps) for s, g in zip(swarms, gens, strict=True))
            )
            moved.extend(b for b, _ in rounds)
            spreads.append(spread([flat_anchor(s) for s in swarms]))
            groups: dict[str, list[AsyncSwarm]] = {}
            for s in swarms:
                last = s.peer.progress.last_round
                if last is not None and last.averaged:
                    groups.setdefault(last.group, []).append(s)
            for key, members in groups.items():
                every = swarms[0].engine._sync_every
                if not every or int(key[:8], 16) % every or len(members) < 2:
                    continue  # not a synced group (the choice comes from the group id)
                synced += len(members)
                seen += 1
                first = outer_state(members[0])
                identical += all(
                    all(torch.equal(x, y) for x, y in zip(first, outer_state(m), strict=True))
                    for m in members[1:]
                )
        test = mlp_task.test_set()
        anchors = [flat_anchor(s) for s in swarms]
        probe = mlp_task.make_model(args.seed)

        def loss_at(values: torch.Tensor) -> float:
            torch.nn.utils.vector_to_parameters(values, probe.parameters())
            return mlp_task.evaluate(probe, test)

        return {
            "peers": args.peers,
            "group": args.group,
            "codec": args.codec,
            "anchor_sync_every": sync_every,
            "anchor_sync_codec": swarms[0].engine._sync_codec if sync_every else "",
            "rounds": args.rounds,
            "inner_steps": args.inner_steps,
            "outer_momentum": args.outer_momentum,
            "spread_max": max(spreads),
            "spread_final": spreads[-1],
            "spread_last10": sum(spreads[-10:]) / len(spreads[-10:]),
            "spread_series": [round(x, 4) for x in spreads[9::10]],
            "sync_picked": synced,
            "bytes_per_round": sum(moved) / max(1, len(moved)),
            "identical_groups": f"{identical}/{seen}",
            "loss_mean_anchor": loss_at(torch.stack(anchors).mean(0)),
            "loss_anchors": sum(loss_at(a) for a in anchors) / len(anchors),
            "loss_peers": sum(mlp_task.evaluate(s.model, test) for s in swarms) / len(swarms),
        }
    finally:
        await asyncio.gather(*(s.close() for s in swarms), return_exceptions=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peers", type=int, default=6)
    p.add_argument("--group", type=int, default=3, help="target group size")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--inner-steps", type=int, default=10)
    p.add_argument("--codec", default="sparse")
    p.add_argument("--sync-every", type=int, nargs="+", default=[0, 16, 64])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)
    for every in args.sync_every:
        started = time.perf_counter()
        result = asyncio.run(run(args, every))
        result["seconds"] = round(time.perf_counter() - started, 1)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
