"""Quickstart: a local swarm of 4 peers on this machine trains one model with DiLoCo.

    python examples/quickstart.py            # offline, CPU, synthetic data, well under 2 minutes

Peer 0 starts a new swarm on 127.0.0.1; peers 1-3 join through its address, download its weights,
and each trains on its own shard of the data (``swarm.shard``). Every ``--inner-steps`` local
steps the peers average their pseudo-gradients (int8 + error feedback) and apply the outer
Nesterov step; peer 0 prints one line per round. On several machines, run the same loop with
``initial_peers=["HOST:PORT"]`` of any live peer and ``listen="0.0.0.0:7000"``.

While it runs, open the printed dashboard address in a browser (peers, loss and samples/s over
time, groups of the last rounds), or run the printed ``swarm-peer status`` command in another
terminal. At the end every peer's summary is printed.
"""

from __future__ import annotations

import argparse
import logging
import threading

import torch

from swarm.api import Swarm
from swarm.compression import get_codec
from swarm.config import SwarmConfig
from swarm.dashboard.web import DashboardThread
from swarm.errors import SwarmError

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
    summaries: list[str],
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
        heartbeat_s=2.0,  # publish progress often: the dashboard updates at this pace
    ) as swarm:
        out[rank] = swarm
        ready.wait()  # every peer is up: now the shards are disjoint
        mine = torch.tensor(swarm.shard(ITEMS))
        g = torch.Generator().manual_seed(rank)
        for _ in range(args.rounds * args.inner_steps):
            batch = mine[torch.randint(len(mine), (args.batch,), generator=g)]
            loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            # instead of optimizer.step(); the loss is optional, shown by the dashboard
            report = swarm.step(samples=args.batch, loss=loss.detach())
            optimizer.zero_grad()
            if report.round_due and rank == 0:
                with torch.no_grad():
                    full = torch.nn.functional.cross_entropy(model(x), y).item()
                print(f"peer 0 {report.line(full)}", flush=True)
        swarm.wait_round()  # the last round runs in the background: land it
        summaries[rank] = (
            f"peer {rank} ({swarm.peer.peer_id.short}): {report.round} rounds, {report.step} "
            f"steps, last loss {loss.item():.4f}, utilization {report.utilization:.0%}"
        )
        ready.wait()  # stay up until everyone has finished their last round


def count(text: str) -> int:
    """argparse type: a positive integer."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def codec_spec(text: str) -> str:
    """argparse type: a codec swarm knows, so a typo is a one-line error, not a traceback."""
    try:
        get_codec(text)
    except SwarmError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--peers", type=count, default=4, help="peers to run in this process")
    parser.add_argument("--rounds", type=count, default=10, help="averaging rounds to train")
    parser.add_argument("--inner-steps", type=count, default=25, help="local steps per round")
    parser.add_argument("--batch", type=count, default=32, help="samples per step and peer")
    parser.add_argument(
        "--codec",
        type=codec_spec,
        default="int8",
        help="none, fp16, int8, sparse (home uplinks), topk:0.1, 1bit, ...",
    )
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo outer learning rate")
    parser.add_argument(
        "--outer-momentum", type=float, default=0.9, help="outer Nesterov momentum (DiLoCo's)"
    )
    parser.add_argument(
        "--dashboard", default="127.0.0.1:0", help="HOST:PORT of the run's web page (port 0: any)"
    )
    args = parser.parse_args()
    try:  # check the options here, so that a bad value is one line, not a thread's traceback
        SwarmConfig.build(
            codec=args.codec, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum
        )
    except SwarmError as e:
        parser.error(str(e))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)  # 4 peers share this machine's cores
    x, y = make_data()
    ready = threading.Barrier(args.peers)
    swarms: list[Swarm | None] = [None] * args.peers
    summaries = [""] * args.peers
    first = threading.Thread(target=train_peer, args=(0, args, x, y, [], ready, swarms, summaries))
    first.start()
    while swarms[0] is None and first.is_alive():
        first.join(0.05)
    if swarms[0] is None:
        raise SystemExit("peer 0 failed to start")
    address = swarms[0].address
    print(f"peer 0 listening on {address}; starting {args.peers - 1} more peers")
    with DashboardThread([address], "quickstart", http=args.dashboard) as dashboard:
        print(f"dashboard: {dashboard.url}")
        print(f"status:    swarm-peer status --initial-peers {address} --run-id quickstart")
        others = [
            threading.Thread(
                target=train_peer, args=(r, args, x, y, [address], ready, swarms, summaries)
            )
            for r in range(1, args.peers)
        ]
        for t in others:
            t.start()
        for t in [first, *others]:
            t.join()
    print("summary:")
    for line in summaries:
        print(f"  {line}")


if __name__ == "__main__":
    main()
