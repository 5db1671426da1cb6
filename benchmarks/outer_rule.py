"""Stability of the DiLoCo outer rule across group sizes and inner loop lengths.

    python benchmarks/outer_rule.py [--steps 1500] [--groups 1 2 4 8] [--inner 8 32 100 500]

``k`` peers in one process train the MLP of :mod:`mlp_task` (Adam 3e-3, batch 64, fresh data per
step) and average their pseudo-gradients exactly in memory every ``inner`` steps, through the
real :class:`~swarm.training.engine.TrainingEngine` with the default outer settings; ``k = 1``
is a peer that averages with nobody. Every peer takes ``--steps`` local steps. One JSON object per
(group size, inner steps): ``group_size``, ``inner_steps``, ``outer_lr``, ``outer_momentum``,
``final_loss`` (test loss of peer 0's model at the end), ``max_round_loss`` (worst test loss seen
after any round), ``alone_adam_loss`` (plain Adam, one peer, same steps) and ``ratio``
(final / alone). Stable means ``ratio`` <= 1.05: averaging never does worse than training alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mlp_task import BATCH, evaluate, make_data, make_model, make_optimizer, test_set

from swarm.config import SwarmConfig
from swarm.training.engine import TrainingEngine
from swarm.training.rounds import RoundOutcome


def average(engines: list[TrainingEngine], weights: list[float]) -> RoundOutcome:
    """Weighted mean of the engines' slots in place: what a group's all-reduce computes."""
    total = sum(weights)
    for parts in zip(*(e.outer.slots for e in engines), strict=True):
        mean = sum(w * t for w, t in zip(weights, parts, strict=True)) / total
        for t in parts:
            t.copy_(mean)
    return RoundOutcome(True, len(engines), 0, 0)


def alone_adam(steps: int, test) -> float:
    model, g = make_model(), torch.Generator().manual_seed(0)
    opt = make_optimizer(model)
    for _ in range(steps):
        x, y = make_data(BATCH, g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return evaluate(model, test)


def run(k: int, inner: int, steps: int, test, **outer: float) -> dict:
    engines = []
    for _ in range(k):
        model = make_model()
        config = SwarmConfig.build(inner_steps=inner, codec="none", **outer)
        engines.append(TrainingEngine(model, make_optimizer(model), config))
    gens = [torch.Generator().manual_seed(r) for r in range(k)]
    worst = 0.0
    for step in range(1, steps + 1):
        due = False
        for e, g in zip(engines, gens, strict=True):
            x, y = make_data(BATCH, g)
            e.optimizer.zero_grad()
            loss = nn.functional.cross_entropy(e.model(x), y)
            loss.backward()
            due = e.count(BATCH)
            e.inner_step()
        if due or step == steps:
            plans = [e.begin_round() for e in engines]
            if k == 1:
                outcome = RoundOutcome(False, 0, 0, 0, "alone")
            else:
                outcome = average(engines, [p.weight for p in plans])
            for e, plan in zip(engines, plans, strict=True):
                e.finish_round(plan, outcome)
            worst = max(worst, evaluate(engines[0].model, test))
    cfg = engines[0].config
    return {
        "group_size": k,
        "inner_steps": inner,
        "outer_lr": cfg.outer_lr,
        "outer_momentum": cfg.outer_momentum,
        "final_loss": round(evaluate(engines[0].model, test), 4),
        "max_round_loss": round(worst, 4),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--inner", type=int, nargs="+", default=[8, 32, 100, 500])
    p.add_argument("--outer-lr", type=float, default=None)
    p.add_argument("--outer-momentum", type=float, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    test = test_set()
    outer = {}
    if args.outer_lr is not None:
        outer["outer_lr"] = args.outer_lr
    if args.outer_momentum is not None:
        outer["outer_momentum"] = args.outer_momentum
    alone = alone_adam(args.steps, test)
    for inner in args.inner:
        for k in args.groups:
            row = run(k, inner, args.steps, test, **outer)
            row["alone_adam_loss"] = round(alone, 4)
            row["ratio"] = round(row["final_loss"] / alone, 3)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
