"""A training peer for churn runs (tests/test_churn.py, benchmarks/churn.py), one per process.

Trains with the default mode and codec (``diloco``, int8) until the wall-clock time ``--stop-at``
(so peers restarted late end with the others), passing its loss to ``step``. Prints
``JOINED <json>`` once its state is adopted, ``ROUND <json>`` after every round (time, round,
averaged, group size, test loss of the model right after the round, diverging, seconds
the step waited for the round) and ``END``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import torch
from churn_run import LOG_FORMAT  # beside this script: sys.path[0]
from torch import nn

from swarm.api import Swarm
from swarm.averaging import Fault
from swarm.errors import SwarmError

ROOT = Path(__file__).resolve().parent.parent
SMALL_DIM, SMALL_CLASSES = 32, 8


class SmallTask:
    """A fixed tanh teacher labels fresh random points; MLP 32-64-8, Adam 3e-3, batch 128."""

    lr, batch = 3e-3, 128
    _teacher = torch.randn(SMALL_DIM, SMALL_CLASSES, generator=torch.Generator().manual_seed(99))

    def data(self, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, SMALL_DIM, generator=g)
        return x, (torch.tanh(x) @ self._teacher).argmax(dim=1)

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(SMALL_DIM, 64), nn.ReLU(), nn.Linear(64, SMALL_CLASSES))

    def test_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data(2048, torch.Generator().manual_seed(10**6))


class MlpTask:
    """The benchmark's MLP 784-256-10 (benchmarks/mlp_task.py)."""

    def __init__(self) -> None:
        spec = importlib.util.spec_from_file_location("mlp_task", ROOT / "benchmarks/mlp_task.py")
        self.m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self.m)
        self.lr, self.batch = self.m.LR, self.m.BATCH

    def data(self, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return self.m.make_data(n, g)

    def model(self) -> nn.Module:
        return self.m.make_model()

    def test_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.m.test_set()


def evaluate(model: nn.Module, test: tuple[torch.Tensor, torch.Tensor]) -> float:
    with torch.no_grad():
        return nn.functional.cross_entropy(model(test[0]), test[1]).item()


def emit(kind: str, **fields: object) -> None:
    print(f"{kind} {json.dumps(fields)}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task", choices=["small", "mlp"], default="small")
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--inner-steps", type=int, default=16)
    p.add_argument("--target-group", type=int, default=4)
    p.add_argument("--matchmaking-timeout", type=float, default=3.0)
    p.add_argument("--round-timeout", type=float, default=10.0)
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--score-updates", action="store_true")
    p.add_argument("--fault", default="none", help="a Fault for the peers of --fault-seeds")
    p.add_argument("--fault-seeds", type=int, nargs="*", default=[])
    p.add_argument("--stop-at", type=float, required=True, help="time.time() to stop at")
    p.add_argument("--go-file", help="train once this file exists (the run's clock starts)")
    p.add_argument(
        "--peers-file",
        help="a warm standby: wait for this file, then join through the addresses it lists",
    )
    args = p.parse_args()
    # the time first: tests/churn_run.py counts what was logged before the run's end
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format=LOG_FORMAT)
    for name in os.environ.get("SWARM_TEST_INFO", "").split(","):  # loggers to hear at INFO
        if name:
            logging.getLogger(name).setLevel(logging.INFO)
    torch.set_num_threads(1)
    task = SmallTask() if args.task == "small" else MlpTask()
    test = task.test_set()
    model = task.model()
    opt = torch.optim.Adam(model.parameters(), lr=task.lr)
    if args.peers_file:
        emit("STANDBY")
        while not Path(args.peers_file).exists():
            time.sleep(0.01)
        args.initial_peers = Path(args.peers_file).read_text().split()
    started = time.time()
    for _ in range(10):
        try:
            swarm = Swarm(
                model,
                opt,
                run_id="churn",
                initial_peers=args.initial_peers,
                listen="127.0.0.1:0",
                inner_steps=args.inner_steps,
                target_group_size=args.target_group,
                matchmaking_timeout_s=args.matchmaking_timeout,
                round_timeout_s=args.round_timeout,
                state_timeout_s=args.round_timeout,
                heartbeat_s=2.0,
                score_updates=args.score_updates,
            )
            break
        except SwarmError as e:  # no agreed state, or no answer yet (peers restarting): retry
            print(f"JOIN-FAILED {e}", file=sys.stderr, flush=True)
            time.sleep(1.0)
    else:
        raise SystemExit("could not join")
    try:
        joined_loss = evaluate(model, test)
        emit(
            "JOINED",
            t=time.time(),
            started=started,
            round=swarm.round,
            address=swarm.address,
            loss=joined_loss if math.isfinite(joined_loss) else None,
        )
        if args.seed in args.fault_seeds:
            swarm._async.averager.faults.fault = Fault(args.fault)  # a hostile peer
        while args.go_file and not Path(args.go_file).exists():
            time.sleep(0.01)  # the first peers start training together, when all are up
        g = torch.Generator().manual_seed(args.seed)
        while time.time() < args.stop_at:
            x, y = task.data(task.batch, g)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            report = swarm.step(samples=task.batch, loss=loss.item())
            opt.zero_grad()
            if args.step_delay:
                time.sleep(args.step_delay)
            if report.round_due:
                test_loss = evaluate(model, test)
                emit(
                    "ROUND",
                    t=time.time(),
                    round=report.round,
                    averaged=report.averaged,
                    group=report.group_size,
                    loss=test_loss if math.isfinite(test_loss) else None,
                    nan=not math.isfinite(test_loss),
                    diverging=report.diverging,
                    wait=round(report.wait_s, 4),
                )
        print("END", flush=True)
    finally:
        swarm.close()


if __name__ == "__main__":
    main()
