"""An engine driven step by step, its rounds held until the test finishes them: the driver's
``start_round`` (:class:`Rounds`) and a small model with a batch per step (shared by
tests/test_overlap.py and tests/test_fragments.py)."""

from __future__ import annotations

import concurrent.futures

import torch

from swarm.config import SwarmConfig
from swarm.training.engine import TrainingEngine
from swarm.training.rounds import RoundOutcome, RoundPlan

INNER = 3


def make(overlap: bool = True, seed: int = 0, **kw: object) -> TrainingEngine:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    kw = {"inner_steps": INNER, **kw}
    config = SwarmConfig.build(codec="none", overlap=overlap, **kw)
    return TrainingEngine(model, opt, config)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)


def backward(e: TrainingEngine, step: int) -> None:
    x, y = batch(step)
    e.optimizer.zero_grad()
    torch.nn.functional.mse_loss(e.model(x), y).backward()


class Rounds:
    """A driver's ``start_round``: rounds finish when the test says so, with a chosen average."""

    def __init__(self) -> None:
        self.started: list[tuple[RoundPlan, concurrent.futures.Future]] = []
        self.on_wait = None  # called when a step blocks on an unfinished round
        self.waits = 0

    def start(self, plan: RoundPlan) -> concurrent.futures.Future:
        future = _Pending(self)
        self.started.append((plan, future))
        return future

    def finish(self, average: list[torch.Tensor] | None, reason: str = "") -> None:
        plan, future = self.started[-1]
        if average is None:
            for t in plan.tensors:
                t.fill_(float("nan"))  # a cut round leaves garbage behind
            future.set_result(RoundOutcome(False, 0, 0, 0, reason))
            return
        for t, value in zip(plan.tensors, average, strict=True):
            t.copy_(value)
        future.set_result(RoundOutcome(True, 2, 10, 10))


class _Pending(concurrent.futures.Future):
    """A round's future; a step that blocks on it first lets the test finish the round."""

    def __init__(self, rounds: Rounds):
        super().__init__()
        self.rounds = rounds

    def result(self, timeout: float | None = None) -> RoundOutcome:
        if not self.done():
            self.rounds.waits += 1
            if self.rounds.on_wait is not None:
                self.rounds.on_wait()
        return super().result(timeout)


def no_blocking_round(plan: RoundPlan) -> RoundOutcome:
    raise AssertionError("an overlapped engine asked for a blocking round")
