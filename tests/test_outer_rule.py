"""The outer rule for lone and small rounds, divergence reports, and a lone peer against Adam."""

from __future__ import annotations

import logging
import math
import random

import pytest
import torch

from swarm.api import Swarm
from swarm.config import SwarmConfig
from swarm.training.divergence import DivergenceMonitor, as_loss
from swarm.training.engine import TrainingEngine
from swarm.training.outer_rule import NORM_BOUND, NORM_MIN_HISTORY, momentum_cosine, outer_rule
from swarm.training.rounds import RoundOutcome

DIM, CLASSES = 32, 8


def task_batch(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed tanh teacher labels fresh random points (a stream: nothing repeats)."""
    teacher = torch.randn(DIM, CLASSES, generator=torch.Generator().manual_seed(99))
    x = torch.randn(n, DIM, generator=g)
    return x, (torch.tanh(x) @ teacher).argmax(dim=1)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(DIM, 64), torch.nn.ReLU(), torch.nn.Linear(64, CLASSES)
    )


def test_rule_alone_small_and_large_groups() -> None:
    assert outer_rule(1, lr=0.7, beta=0.9).solitary
    assert outer_rule(0, lr=0.7, beta=0.9).lr == 0.0
    assert outer_rule(2, lr=0.7, beta=0.9).beta == pytest.approx(0.5)
    assert outer_rule(4, lr=0.7, beta=0.9).beta == pytest.approx(0.75)
    assert outer_rule(8, lr=0.7, beta=0.9).beta == pytest.approx(0.875)
    assert outer_rule(20, lr=0.7, beta=0.9).beta == pytest.approx(0.9)
    assert outer_rule(3, lr=0.7, beta=0.0).beta == 0.0


def test_plain_rule_folds_the_capped_momentum_into_the_step() -> None:
    """Error feedback in the model (sparse codecs): no momentum, the step it would give a
    steady pseudo-gradient instead, ``lr / (1 - β)``, with β capped at 1 - 1/k and 0.875; in a
    pair at 2/3 (its members apply each other's payloads whole)."""
    plain = [outer_rule(k, lr=0.7, beta=0.9, plain=True) for k in (2, 3, 4, 8, 20)]
    assert [s.lr for s in plain] == pytest.approx([2.1, 2.1, 2.8, 5.6, 5.6])
    assert outer_rule(2, lr=0.7, beta=0.5, plain=True).lr == pytest.approx(1.4)
    assert all(s.beta == 0.0 and not s.solitary for s in plain)
    assert outer_rule(2, lr=0.7, beta=0.0, plain=True).lr == pytest.approx(0.7)
    alone = outer_rule(1, lr=0.7, beta=0.9, plain=True)
    assert alone.solitary and alone.lr == 0.0


@pytest.mark.parametrize(("codec", "first_step"), [("sparse", 2.1), ("int8", 0.7 * 1.5)])
def test_sparse_diloco_takes_the_plain_step(codec: str, first_step: float) -> None:
    """In a group of 2, sparse DiLoCo moves the anchor by 2.1 Δ̄ every round, momentum or not;
    a dense codec by Nesterov's 0.7 (Δ̄ + 0.5 m), 1.05 Δ̄ in the first round."""
    model = make_model()
    config = SwarmConfig.build(codec=codec, overlap=False)
    e = TrainingEngine(model, torch.optim.Adam(model.parameters()), config)
    assert (e.outer.momentum == []) == (codec == "sparse")  # a plain step keeps none
    for _ in range(2 if codec == "sparse" else 1):
        before = [a.clone() for a in e.outer.anchor]
        round_of(e, 1e-3, group=2)
        for a, b, p in zip(e.outer.anchor, before, model.parameters(), strict=True):
            torch.testing.assert_close(
                b - a, torch.full_like(a, first_step * 1e-3), rtol=1e-4, atol=1e-9
            )
            assert torch.equal(p.detach(), a.to(p.dtype))


def round_of(e: TrainingEngine, delta: float, group: int = 2) -> object:
    """Finish a round whose averaged pseudo-gradient is ``delta`` everywhere."""
    plan = e.begin_round()
    for t in plan.tensors:
        t.fill_(delta)
    return e.finish_round(plan, RoundOutcome(True, group, 0, 0))


def test_norm_jump_is_bounded_flagged_and_logged(caplog) -> None:
    model = make_model()
    e = TrainingEngine(model, torch.optim.Adam(model.parameters()), SwarmConfig.build(codec="none"))
    for _ in range(NORM_MIN_HISTORY + 1):
        report = round_of(e, 1e-3)
        assert not report.diverging and report.pseudo_grad_norm > 0
    before = [a.clone() for a in e.outer.anchor]
    normal = report.pseudo_grad_norm
    with caplog.at_level(logging.WARNING, logger="swarm.training.engine"):
        report = round_of(e, 1.0)  # 1000x the usual round
    assert report.diverging and "norm jumped" in report.divergence
    assert "looks divergent" in caplog.text
    moved = math.sqrt(
        sum(((a - b) ** 2).sum().item() for a, b in zip(e.outer.anchor, before, strict=True))
    )
    # With momentum, one bounded round moves the anchor by at most lr * (1 + 2β) * bound.
    assert moved <= 0.7 * 2.8 * NORM_BOUND * normal * 1.01
    report = round_of(e, float("nan"))
    assert report.diverging and "not finite" in report.divergence
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.equal(p, a) for p, a in zip(model.parameters(), e.outer.anchor, strict=True))


def test_rounds_that_moved_nothing_set_no_bound() -> None:
    """Rounds whose averaged pseudo-gradient was zero (frozen weights, a group of free riders)
    leave no scale to judge a jump by: the next real round is applied whole and reported
    plainly (a bound of 0 cut it to nothing, and its report divided by the 0 scale)."""
    model = make_model()
    e = TrainingEngine(model, torch.optim.Adam(model.parameters()), SwarmConfig.build(codec="none"))
    for _ in range(NORM_MIN_HISTORY + 1):
        assert round_of(e, 0.0).pseudo_grad_norm == 0.0
    before = [a.clone() for a in e.outer.anchor]
    report = round_of(e, 1e-3)
    assert not report.diverging and report.pseudo_grad_norm > 0
    assert not any(torch.equal(a, b) for a, b in zip(e.outer.anchor, before, strict=True))


def test_momentum_restarts_when_the_update_turns_against_it() -> None:
    """Rounds that agree build the momentum (Nesterov steps); a round whose averaged
    pseudo-gradient points against it zeroes it, and that round's step is the plain lr·Δ."""
    model = make_model()
    e = TrainingEngine(model, torch.optim.Adam(model.parameters()), SwarmConfig.build(codec="none"))
    lr, beta = 0.7, outer_rule(4, lr=0.7, beta=0.9).beta
    for _ in range(3):
        before = [a.clone() for a in e.outer.anchor]
        m = e.outer.momentum[0].flatten()[0].item()
        round_of(e, 1e-3, group=4)
        step = before[0].flatten()[0].item() - e.outer.anchor[0].flatten()[0].item()
        assert step == pytest.approx(lr * (1e-3 + beta * (beta * m + 1e-3)), rel=1e-4)
    assert e.outer.restarts == 0
    before = [a.clone() for a in e.outer.anchor]
    round_of(e, -1e-3, group=4)  # past the target: momentum would carry the anchor further
    assert e.outer.restarts == 1
    for a, b, m in zip(e.outer.anchor, before, e.outer.momentum, strict=True):
        torch.testing.assert_close(a - b, torch.full_like(a, lr * 1e-3), rtol=1e-4, atol=1e-9)
        assert torch.equal(m, torch.full_like(m, -1e-3))
    round_of(e, -1e-3, group=4)  # agrees with the restarted momentum
    assert e.outer.restarts == 1


def test_momentum_cosine_is_over_every_tensor_and_zero_when_undefined() -> None:
    def cosine(m: list[torch.Tensor], d: list[torch.Tensor]) -> float:
        norm = math.sqrt(sum(float((t * t).sum()) for t in d))
        return momentum_cosine(m, d, norm)

    m = [torch.tensor([1.0, 0.0]), torch.tensor([0.0])]
    assert cosine(m, [torch.tensor([0.0, 1.0]), torch.tensor([1.0])]) == 0.0
    assert cosine(m, [torch.tensor([-2.0, 0.0]), torch.tensor([0.0])]) == -1.0
    assert cosine(m, [torch.tensor([1.0, 0.0]), torch.tensor([1.0])]) == pytest.approx(
        math.sqrt(0.5)
    )
    assert cosine([torch.zeros(2)], [torch.ones(2)]) == 0.0
    assert momentum_cosine([torch.ones(2)], [torch.ones(2)], math.inf) == 0.0
    assert momentum_cosine([torch.tensor([math.inf, 0.0])], [torch.ones(2)], 1.0) == 0.0
    assert momentum_cosine([], [], 1.0) == 0.0


def test_loss_rise_is_flagged_once_and_recovers(caplog) -> None:
    model = make_model()
    config = SwarmConfig.build(codec="none", inner_steps=2)
    e = TrainingEngine(model, torch.optim.SGD(model.parameters(), lr=0.0), config)
    reports = []
    with caplog.at_level(logging.WARNING, logger="swarm.training.engine"):
        for loss in [1.0, 1.0, 0.9, 0.9, 0.8, 0.8, 2.0, 2.4, 3.0, 3.0, 0.8, 0.8]:
            if e.count(1, torch.tensor(loss)):
                plan = e.begin_round()
                reports.append(e.finish_round(plan, RoundOutcome(False, 0, 0, 0, "alone")))
            else:
                local = e.local_report()
                assert local.loss == pytest.approx(loss) and not local.diverging
    assert [r.diverging for r in reports] == [False, False, False, True, True, False]
    assert reports[3].loss == pytest.approx(2.2) and "rose" in reports[3].divergence
    assert caplog.text.count("looks divergent") == 1
    e.count(1, float("nan"))
    assert e.local_report().diverging


def test_a_short_round_of_noisy_batches_is_no_rise_but_a_long_one_is() -> None:
    """Batches whose loss swings by +-0.2 around 0.6 (10% random labels): an overlapped round
    that lands two steps after the one before, at 1.5x the usual, is noise; 16 steps at the
    same mean are a rise."""
    rng = random.Random(0)
    m = DivergenceMonitor()
    for _ in range(8):
        for _ in range(16):
            m.add(rng.gauss(0.6, 0.2))
        assert m.end_round()[1] == ""
    m.add(0.85)
    m.add(0.95)
    assert m.end_round()[1] == ""
    for _ in range(16):
        m.add(rng.gauss(0.9, 0.2))
    assert "a mean of 16 steps" in m.end_round()[1]


def test_loss_values_are_checked() -> None:
    assert as_loss(torch.tensor([0.5])) == 0.5 and as_loss(2) == 2.0
    for bad in ["1.0", torch.ones(3), True, None]:
        with pytest.raises(ValueError):
            as_loss(bad)
    m = DivergenceMonitor()
    assert m.end_round() == (None, "")


def samples_to_reach(target: float, step, budget: int = 4000, batch: int = 32) -> int:
    """Samples until the loss on a fixed test set is below ``target`` (checked every 50 steps)."""
    g, test = torch.Generator().manual_seed(1), task_batch(torch.Generator().manual_seed(2), 2048)
    for i in range(1, budget + 1):
        x, y = task_batch(g, batch)
        step(x, y)
        if i % 50 == 0:
            with torch.no_grad():
                loss = torch.nn.functional.cross_entropy(step.model(test[0]), test[1]).item()
            if loss < target:
                return i * batch
    return math.inf


class AdamStep:
    def __init__(self) -> None:
        self.model = make_model()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=3e-3)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.opt.zero_grad()
        torch.nn.functional.cross_entropy(self.model(x), y).backward()
        self.opt.step()


class SwarmStep(AdamStep):
    def __init__(self, swarm_cls) -> None:
        super().__init__()
        self.swarm = swarm_cls(self.model, self.opt, run_id="alone", listen="127.0.0.1:0")

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        self.swarm.step(samples=len(x), loss=loss.item())


def test_lone_diloco_peer_with_defaults_matches_plain_adam() -> None:
    adam = AdamStep()
    target = 0.53  # ~8 rounds of Adam; the paper rule alone needs 2.5x
    adam_samples = samples_to_reach(target, adam)
    assert adam_samples < math.inf
    lone = SwarmStep(Swarm)
    try:
        assert lone.swarm.config.mode == "diloco"  # the defaults: diloco, 100 inner steps
        swarm_samples = samples_to_reach(target, lone)
        assert lone.swarm.round >= 2  # rounds did happen, alone
    finally:
        lone.swarm.close()
    assert swarm_samples <= 1.10 * adam_samples, (swarm_samples, adam_samples)
