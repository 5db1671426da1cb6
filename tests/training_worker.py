"""A training peer in its own process, driven by tests/test_training_swarm.py.

Prints ``ADDRESS host:port`` once up, ``ROUND <json>`` after every round (full-data loss,
report fields), ``SAVED <round>`` after a checkpoint, ``DONE`` at the end, and writes its final
parameters to ``--out`` (torch.save of the model's state_dict).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

from swarm.api import Swarm

DIM, ITEMS = 16, 4096


def task() -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic regression: a fixed tanh teacher; same data in every process."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ITEMS, DIM, generator=g)
    w = torch.randn(DIM, 1, generator=g) / 4
    return x, torch.tanh(2 * x @ w)


def make_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "bn":
        return torch.nn.Sequential(
            torch.nn.Linear(DIM, 32),
            torch.nn.BatchNorm1d(32),
            torch.nn.Tanh(),
            torch.nn.Linear(32, 1),
        )
    return torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def full_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    was_training = model.training
    model.eval()
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(model(x), y).item()
    model.train(was_training)
    return loss


def barrier(folder: str, name: str, rank: int, peers: int) -> None:
    """Wait until ``peers`` processes reached the barrier ``name`` in ``folder``."""
    Path(folder, f"{name}-{rank}").touch()
    deadline = time.monotonic() + 120
    while len(list(Path(folder).glob(f"{name}-*"))) < peers:
        if time.monotonic() > deadline:
            raise SystemExit(f"the other peers never reached the {name} barrier")
        time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--mode", default="diloco")
    p.add_argument("--codec", default="none")
    p.add_argument("--model", default="mlp")
    p.add_argument("--inner-steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=0, help="train this many steps (not --rounds)")
    p.add_argument("--overlap", choices=["on", "off"], default=None)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--min-group", type=int, default=2)
    p.add_argument("--matchmaking-timeout", type=float, default=5.0)
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--save", default=None)
    p.add_argument("--save-at-round", type=int, default=-1)
    p.add_argument("--load", default=None)
    p.add_argument("--final-average", action="store_true")
    p.add_argument("--barrier", default=None, help="a folder: start and end with --wait-peers")
    p.add_argument("--linger", type=float, default=0.0, help="stay up to serve state/averaging")
    p.add_argument("--out", default=None)
    p.add_argument("--wait-peers", type=int, default=1, help="train once this many peers are up")
    p.add_argument("--wait-reachable", type=int, default=0, help="... and this many dialable")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    torch.set_num_threads(1)
    x, y = task()
    mine = torch.arange(args.rank, ITEMS, args.shards)
    model = make_model(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    swarm = Swarm(
        model,
        optimizer,
        run_id="train-test",
        initial_peers=args.initial_peers,
        listen=args.listen,
        mode=args.mode,
        codec=args.codec,
        inner_steps=args.inner_steps,
        min_group_size=args.min_group,
        matchmaking_timeout_s=args.matchmaking_timeout,
        round_timeout_s=60.0,
        heartbeat_s=2.0,
        overlap=None if args.overlap is None else args.overlap == "on",
    )
    try:
        print(f"ADDRESS {swarm.address}", flush=True)
        if args.load:
            swarm.load(args.load)
            print(f"LOADED {swarm.round}", flush=True)
            if args.out:
                torch.save(model.state_dict(), args.out + ".loaded")
        deadline = time.monotonic() + 60
        while len(swarm.known_peers()) < args.wait_peers and time.monotonic() < deadline:
            time.sleep(0.2)
        while args.wait_reachable and time.monotonic() < deadline + 60:
            reach = [r.extra.get("reach") for r in swarm.known_peers().values()]
            if sum(r in ("direct", "mapped", "relayed") for r in reach) >= args.wait_reachable:
                break
            time.sleep(0.2)
        if args.barrier:  # the last to start finds the others a moment later than they find it
            barrier(args.barrier, "start", args.rank, args.wait_peers)
        print(f"START {swarm.round} {full_loss(model, x, y)}", flush=True)

        def print_round(report) -> None:
            fields = {
                "round": report.round,
                "step": report.step,
                "loss": full_loss(model, x, y),
                "averaged": report.averaged,
                "group": report.group_size,
                "reason": report.reason,
                "bytes_sent": report.bytes_sent,
                "wait_s": report.wait_s,
                "round_s": report.round_s,
            }
            print("ROUND " + json.dumps(fields), flush=True)

        g = torch.Generator().manual_seed(1000 + args.rank)
        start_round, steps = swarm.round, 0
        while (steps < args.steps) if args.steps else (swarm.round < start_round + args.rounds):
            steps += 1
            batch = mine[torch.randint(len(mine), (args.batch,), generator=g)]
            loss = torch.nn.functional.mse_loss(model(x[batch]), y[batch])
            loss.backward()
            report = swarm.step(samples=args.batch)
            optimizer.zero_grad()
            if args.step_delay:
                time.sleep(args.step_delay)
            reports = [report]
            if args.steps and steps == args.steps and report.in_flight:
                reports.append(swarm.wait_round())  # land the last round before the end
            for report in reports:
                if report.round_due:
                    print_round(report)
                if report.round_due and report.round == args.save_at_round and args.save:
                    landed = swarm.wait_round()  # save() lands a round in flight first
                    if landed is not None:
                        print_round(landed)
                    swarm.save(args.save)
                    if args.out:
                        torch.save(model.state_dict(), args.out + ".saved")
                    print(f"SAVED {swarm.round}", flush=True)
        if args.barrier:  # peers on busy cores finish apart: the final average waits for all
            barrier(args.barrier, "end", args.rank, args.wait_peers)
        if args.final_average:
            outcome = swarm.average_parameters()
            final = {
                "averaged": outcome.averaged,
                "group": outcome.group_size,
                "reason": outcome.reason,
                "refusals": list(outcome.refusals),
            }
            print(f"FINAL {json.dumps(final)}", flush=True)
        if args.out:
            torch.save(model.state_dict(), args.out)
        print("DONE", flush=True)
        time.sleep(args.linger)
    finally:
        swarm.close()


if __name__ == "__main__":
    main()
