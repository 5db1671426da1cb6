"""One rank of a torchrun node for tests/test_distributed.py; writes its result as JSON.

Run as ``torchrun --standalone --nproc-per-node 2 tests/torchrun_worker.py --node-id N ...``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from swarm.distributed import NodeSwarm


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--node-id", type=int, required=True)
    p.add_argument("--listen", required=True)
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--address-file")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--mode", default="diloco")
    p.add_argument("--gather-window", type=float, help="seconds; a long one keeps rounds in flight")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step takes")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(100 * args.node_id + rank)  # different initial weights: rank 0's win
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    options = {
        "run_id": "torchrun-test",
        "listen": args.listen,
        "initial_peers": args.initial_peers,
        "codec": "none",
        "mode": args.mode,
        "inner_steps": 3,
        "matchmaking_timeout_s": 5.0,
        "round_timeout_s": 60.0,
    }
    if args.gather_window is not None:
        options["gather_window_s"] = args.gather_window
    averaged = []
    launches_alone = 0  # steps where a round started in flight and none ended
    with NodeSwarm(model, opt, **options) as swarm:
        if swarm.is_peer and args.address_file:
            Path(args.address_file).write_text(swarm.address)
        if swarm.is_peer:  # both nodes present before the first round
            deadline = time.monotonic() + 60
            while len(swarm.swarm.known_peers()) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
        g = torch.Generator().manual_seed(1000 * args.node_id + rank)
        for _ in range(args.steps):
            x = torch.randn(16, 5, generator=g)
            y = x.sum(dim=1, keepdim=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
            time.sleep(args.step_sleep)
            report = swarm.step(samples=len(x))
            opt.zero_grad()
            if report is not None and report.round_started and not report.round_due:
                launches_alone += 1
            if report is not None and report.round_due:
                averaged.append([report.averaged, report.group_size])
    digest = hashlib.sha256()
    for t in model.state_dict().values():
        digest.update(t.detach().numpy().tobytes())
    result = {
        "node": args.node_id,
        "rank": rank,
        "params": digest.hexdigest(),
        "rounds": averaged,
        "launches_alone": launches_alone,
    }
    Path(args.out, f"node{args.node_id}_rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
