"""Memory of training peers: peak RSS per peer above their models, in vectors of the model.

    python benchmarks/training_memory.py [--codecs sparse int8] [--size 5000] [--peers 2]
        [--steps 12] [--inner-steps 3] [--anchor-sync-every 0]

``--peers`` DiLoCo peers of one ``--size`` x ``--size`` linear layer (25M parameters by default)
train in one process on loopback (plain SGD, so the inner optimizer adds no state), a round
every ``--inner-steps`` steps, overlapped (the default). Everything the peers hold beside their
models counts: the outer state (anchors, slots, momentum), the overlap's copies, the averager's
residuals and each round's buffers. Each codec runs in a process of its own (the peak RSS is
the process's). Prints one JSON object per codec: ``codec``, ``peers``, ``parameters``,
``rounds`` (each peer's), ``outer_momentum`` (tensors kept), ``model_mb``, ``rss_before_mb``
(models built and their gradients allocated), ``peak_rss_mb`` and ``vectors_per_peer``
(``(peak - before) / peers / model``). Linux and macOS (``ru_maxrss``); elsewhere the memory
figures are NaN.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys

import torch
from arguments import at_least
from rss import peak_rss_mb, proc_status_mb

from swarm.api import AsyncSwarm


async def measure(args: argparse.Namespace, codec: str) -> dict:
    torch.manual_seed(0)
    models = [torch.nn.Linear(args.size, args.size, bias=False) for _ in range(args.peers)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    x = torch.randn(8, args.size)
    for m in models:  # the gradients are the model's, not the swarm's: allocate them first
        m(x).pow(2).mean().backward()
    before = proc_status_mb("VmRSS") or peak_rss_mb()
    swarms: list[AsyncSwarm] = []
    try:
        for i, m in enumerate(models):
            swarms.append(
                await AsyncSwarm.create(
                    m,
                    torch.optim.SGD(m.parameters(), lr=1e-3),
                    run_id="training-memory",
                    listen=f"127.0.0.{60 + i}:0",
                    initial_peers=[swarms[0].address] if swarms else [],
                    codec=codec,
                    inner_steps=args.inner_steps,
                    min_group_size=args.peers,
                    matchmaking_timeout_s=10.0,
                    round_timeout_s=120.0,
                    sync_on_join=False,
                    anchor_sync_every=args.anchor_sync_every,
                )
            )

        async def train(swarm: AsyncSwarm) -> None:
            for _ in range(args.steps):
                swarm.model(x).pow(2).mean().backward()
                await swarm.step(samples=len(x))
                swarm.optimizer.zero_grad()
            await swarm.wait_round()

        await asyncio.gather(*(train(s) for s in swarms))
        peak = peak_rss_mb()
        model_mb = args.size * args.size * 4 / 2**20
        return {
            "codec": codec,
            "peers": args.peers,
            "parameters": args.size * args.size,
            "rounds": [s.engine.round for s in swarms],
            "outer_momentum": len(swarms[0].engine.outer.momentum),
            "model_mb": round(model_mb, 1),
            "rss_before_mb": round(before, 1),
            "peak_rss_mb": round(peak, 1),
            "vectors_per_peer": round((peak - before) / args.peers / model_mb, 2),
        }
    finally:
        await asyncio.gather(*(s.close() for s in swarms), return_exceptions=True)


SETTINGS = ("size", "peers", "steps", "inner_steps", "anchor_sync_every")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--codecs", nargs="+", default=["sparse", "int8"])
    p.add_argument("--size", type=at_least(1), default=5000, help="the layer is size x size")
    p.add_argument("--peers", type=at_least(1), default=2)
    p.add_argument("--steps", type=at_least(1), default=12)
    p.add_argument("--inner-steps", type=at_least(1), default=3)
    p.add_argument("--anchor-sync-every", type=at_least(0), default=0)
    args = p.parse_args()
    if len(args.codecs) > 1:  # one process per codec: the peak RSS is the process's
        settings = [x for k in SETTINGS for x in (f"--{k.replace('_', '-')}", str(vars(args)[k]))]
        for codec in args.codecs:
            subprocess.run([sys.executable, __file__, "--codecs", codec, *settings], check=True)
        return
    print(json.dumps(asyncio.run(measure(args, args.codecs[0]))), flush=True)


if __name__ == "__main__":
    main()
