"""Quickstart: a local swarm of 4 peers on this machine trains one model with DiLoCo.

    python examples/quickstart.py            # offline, CPU, synthetic data, well under 2 minutes

Peer 0 starts a new swarm on 127.0.0.1; peers 1-3 join through its address, download its weights,
and each trains on its own shard of the data (``swarm.shard``). Every ``--inner-steps`` local
steps the peers average their pseudo-gradients (int8 + error feedback) and apply the outer
Nesterov step; peer 0 prints one line per round. On several machines, run the same loop with
``initial_peers=["HOST:PORT"]`` of any live peer and ``listen="0.0.0.0:7000"``.
"""

from __future__ import annotations

import argparse
import logging
import threading

import torch

from swarm.api import Swarm

DIM, CLASSES, ITEMS = 32, 8, 8192


def make_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed teacher network labels random points: learnable, offline, deterministic."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ITEMS, DIM, generator=g)
    teacher = torch.randn(DIM, CLASSES, generator=g)
    return x, (torch.tanh(x) @ teacher).argmax(dim=1)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(DIM, 128), torch.nn.GELU(), torch.nn.Linear(128, CLASSES)
    )


def train_peer(
    rank: int,
    args: argparse.Namespace,
    x: torch.Tensor,
    y: torch.Tensor,
    initial_peers: list[str],
    ready: threading.Barrier,
    out: list[Swarm | None],
) -> None:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with Swarm(
        model,
        optimizer,
        run_id="quickstart",
        initial_peers=initial_peers,
        listen="127.0.0.1:0",
        inner_steps=args.inner_steps,
        codec=args.codec,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        matchmaking_timeout_s=5.0,
        round_timeout_s=60.0,
    ) as swarm:
        out[rank] = swarm
        ready.wait()  # every peer is up: now the shards are disjoint
        mine = torch.tensor(swarm.shard(ITEMS))
        g = torch.Generator().manual_seed(rank)
        for _ in range(args.rounds * args.inner_steps):
            batch = mine[torch.randint(len(mine), (args.batch,), generator=g)]
            loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            report = swarm.step(samples=args.batch)  # instead of optimizer.step()
            optimizer.zero_grad()
            if report.round_due and rank == 0:
                with torch.no_grad():
                    full = torch.nn.functional.cross_entropy(model(x), y).item()
                print(f"peer 0 {report.line(full)}", flush=True)
        ready.wait()  # stay up until everyone has finished their last round


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--inner-steps", type=int, default=25)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--codec", default="int8")
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)  # DiLoCo's, the default
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)  # 4 peers share this machine's cores
    x, y = make_data()
    ready = threading.Barrier(args.peers)
    swarms: list[Swarm | None] = [None] * args.peers
    first = threading.Thread(target=train_peer, args=(0, args, x, y, [], ready, swarms))
    first.start()
    while swarms[0] is None and first.is_alive():
        first.join(0.05)
    if swarms[0] is None:
        raise SystemExit("peer 0 failed to start")
    print(f"peer 0 listening on {swarms[0].address}; starting {args.peers - 1} more peers")
    others = [
        threading.Thread(
            target=train_peer, args=(r, args, x, y, [swarms[0].address], ready, swarms)
        )
        for r in range(1, args.peers)
    ]
    for t in others:
        t.start()
    for t in [first, *others]:
        t.join()


if __name__ == "__main__":
    main()
