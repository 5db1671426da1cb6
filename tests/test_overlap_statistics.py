"""BatchNorm statistics under overlapped DiLoCo rounds that land a whole inner loop late.

On a slow link every round takes the whole inner loop and lands at the next due step. The
landing used to reset the model's floating buffers to their anchor, throwing away every
statistic the loop had gathered, so the next round's buffer change was zero and the running
statistics froze while the weights and the data moved on (the convergence benchmark's
evaluation loss reached 20-50). Real engines, the real step driver; the group's average is
computed in memory.
"""

from __future__ import annotations

import concurrent.futures

import torch

from swarm.config import SwarmConfig
from swarm.training.driver import run_step
from swarm.training.engine import TrainingEngine
from swarm.training.rounds import RoundOutcome, RoundPlan

INNER = 6
ROUNDS = 8
GROWTH = 1.06  # the inputs' scale grows by this per step, so the BatchNorm variance moves on


def make_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    )


def make_engine() -> TrainingEngine:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    config = SwarmConfig.build(inner_steps=INNER, codec="none", anchor_sync_every=0)
    assert config.overlap
    return TrainingEngine(model, opt, config)


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(32, 4, generator=g) * GROWTH**step + rank


def backward(model: torch.nn.Module, rank: int, step: int) -> None:
    model(batch(rank, step)).pow(2).mean().backward()


class LateGroup:
    """The members' background rounds, averaged (exact mean) only when a member blocks on
    one, at its next due step: every round takes the whole inner loop."""

    def __init__(self) -> None:
        self.pending: list[tuple[RoundPlan, concurrent.futures.Future]] = []
        self.averaged = 0

    def start(self, plan: RoundPlan) -> concurrent.futures.Future:
        handle = _LateHandle(self)
        self.pending.append((plan, handle))
        return handle

    def finish(self) -> None:
        pending, self.pending = self.pending, []
        for slots in zip(*(plan.tensors for plan, _ in pending), strict=True):
            mean = torch.stack(slots).mean(dim=0)
            for slot in slots:
                slot.copy_(mean)
        for _, handle in pending:
            handle.set_result(RoundOutcome(True, len(pending), 0, 0))
        self.averaged += 1


class _LateHandle(concurrent.futures.Future):  # type: ignore[type-arg]
    def __init__(self, group: LateGroup):
        super().__init__()
        self.group = group

    def result(self, timeout: float | None = None) -> RoundOutcome:
        if not self.done():
            self.group.finish()
        return super().result(timeout)


def no_blocking_round(plan: RoundPlan) -> RoundOutcome:
    raise AssertionError("an overlapped engine asked for a blocking round")


def variance_ratio(model: torch.nn.Sequential, step: int) -> float:
    """Median over features of running variance / the variance the latest batch gives."""
    with torch.no_grad():
        true = model[0](batch(0, step)).var(dim=0)
    return float((model[1].running_var / true).median())


def test_running_statistics_track_the_data_when_rounds_land_a_loop_late() -> None:
    engines, group = [make_engine(), make_engine()], LateGroup()
    local = make_model()  # the same model trained alone: how closely statistics can track
    local_opt = torch.optim.SGD(local.parameters(), lr=0.01)
    steps = INNER * ROUNDS
    for step in range(1, steps + 1):
        for rank, e in enumerate(engines):
            e.optimizer.zero_grad()
            backward(e.model, rank, step)
            report = run_step(e.step(32), no_blocking_round, group.start)
            if step % INNER == 0 and step > INNER:
                assert report.averaged and report.round_due, report  # landed at the due step
        local_opt.zero_grad()
        backward(local, 0, step)
        local_opt.step()
    assert group.averaged == ROUNDS - 1  # each round landed only when the next was due
    alone = variance_ratio(local, steps)
    assert alone > 0.2  # the statistics of one model alone follow the data
    for e in engines:
        # the bug froze them at the first round's value: ratio about GROWTH ** (-2 * 42) = 0.008
        assert variance_ratio(e.model, steps) > alone / 2, (variance_ratio(e.model, steps), alone)


def test_a_late_landing_keeps_the_buffers_and_moves_their_anchor_to_the_group_mean() -> None:
    engines, group = [make_engine(), make_engine()], LateGroup()
    launched: list[list[torch.Tensor]] = []
    for step in range(1, 2 * INNER + 1):
        before = []
        for rank, e in enumerate(engines):
            e.optimizer.zero_grad()
            backward(e.model, rank, step)  # the forward pass updates the running statistics
            before.append([b.clone() for b in e.tensors.buffers])
            run_step(e.step(32), no_blocking_round, group.start)
        if step == INNER:
            launched = before
    assert group.averaged == 1
    mean = [(a + b) / 2 for a, b in zip(*launched, strict=True)]
    n = len(engines[0].tensors.params)
    for e, own in zip(engines, before, strict=True):
        # the landing kept what the inner loop gathered (the launch after it rounds, anchor -
        # (anchor - b), and changes nothing else)
        for b, kept in zip(e.tensors.buffers, own, strict=True):
            torch.testing.assert_close(b, kept, rtol=1e-6, atol=1e-6)
        # the next round's buffer change is anchor - b, from the group's mean at the launch
        new_round = group.pending[engines.index(e)][0]
        for change, b, m in zip(new_round.tensors[n:], e.tensors.buffers, mean, strict=True):
            torch.testing.assert_close(change + b, m, rtol=1e-5, atol=1e-6)
        assert any(not torch.equal(b, m) for b, m in zip(e.tensors.buffers, mean, strict=True))
