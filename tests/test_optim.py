"""SwarmOptimizer: LR schedulers, GradScaler, non-finite steps, state_dict, outer lr schedule."""

from __future__ import annotations

import io

import pytest
import torch

from swarm.api import Swarm
from swarm.errors import ConfigError
from swarm.optim import SwarmOptimizer

# A lone peer: each round looks for partners for matchmaking_timeout_s, then DiLoCo applies its
# own pseudo-gradient, which exercises the whole step sequence deterministically.
OPTIONS = {
    "listen": "127.0.0.1:0",
    "codec": "none",
    "inner_steps": 4,
    "overlap": False,  # rounds land at a fixed step, so both runs can agree to the bit
    "matchmaking_timeout_s": 0.2,
    "round_timeout_s": 30.0,
    "run_id": "optim-test",
}
STEPS, OVERFLOW_AT, BATCH = 14, {5, 10}, 8


def model_and_data(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    g = torch.Generator().manual_seed(42)
    data = [(torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 1, generator=g))]
    return model, data * 4


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def overflow(model) -> None:
    """What an fp16 overflow leaves in the gradients."""
    next(model.parameters()).grad[0, 0] = float("inf")


def run_with_swarm_step():
    model, data = model_and_data()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(inner, step_size=3, gamma=0.5)
    with Swarm(model, inner, **OPTIONS) as swarm:
        for i in range(STEPS):
            x, y = data[i % len(data)]
            inner.zero_grad()
            loss_of(model, x, y).backward()
            if i in OVERFLOW_AT:
                overflow(model)  # the user checks and skips by hand
            else:
                swarm.step(samples=BATCH)
            scheduler.step()
        swarm.wait_round()  # the last round may still be in flight (overlapped DiLoCo)
        counters = (swarm.engine.step_count, swarm.round)
    return model, inner, counters


def run_with_swarm_optimizer():
    model, data = model_and_data()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer = SwarmOptimizer(inner, model=model, samples_per_step=BATCH, **OPTIONS)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    # Powers of two: scaling and unscaling are exact, so both runs must agree to the bit.
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=3)
    with optimizer:
        for i in range(STEPS):
            x, y = data[i % len(data)]
            optimizer.zero_grad()
            scaler.scale(loss_of(model, x, y)).backward()
            if i in OVERFLOW_AT:
                overflow(model)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
        optimizer.wait_round()
        counters = (optimizer.swarm.engine.step_count, optimizer.swarm.round)
    return model, inner, counters, scaler


def test_scheduler_and_grad_scaler_reach_the_same_loss_as_swarm_step() -> None:
    ref_model, ref_inner, ref_counters = run_with_swarm_step()
    model, inner, counters, scaler = run_with_swarm_optimizer()
    assert counters == ref_counters == (STEPS - len(OVERFLOW_AT), 3)  # skipped steps not counted
    assert scaler.get_scale() < 16.0 * 2 ** (STEPS // 3)  # the overflows did lower the scale
    assert (
        inner.param_groups[0]["lr"] == ref_inner.param_groups[0]["lr"] == 0.1 * 0.5 ** (STEPS // 3)
    )
    _, data = model_and_data()
    x, y = data[0]
    with torch.no_grad():
        assert loss_of(model, x, y).item() == loss_of(ref_model, x, y).item()
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_non_finite_gradients_are_skipped_without_a_scaler() -> None:
    model, data = model_and_data()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with SwarmOptimizer(inner, model=model, **OPTIONS) as optimizer:
        before = [p.detach().clone() for p in model.parameters()]
        x, y = data[0]
        loss_of(model, x, y).backward()
        next(model.parameters()).grad[1, 1] = float("nan")
        optimizer.step()
        assert optimizer.skipped_steps == 1 and optimizer.swarm.engine.step_count == 0
        for p, q in zip(before, model.parameters(), strict=True):
            assert torch.equal(p, q)
        optimizer.zero_grad()
        assert optimizer.step(closure=lambda: loss_of(model, x, y).backward() or 1.5) == 1.5
        assert optimizer.swarm.engine.step_count == 1
        assert optimizer.last_report is not None and not optimizer.last_report.round_due


def test_state_dict_survives_torch_save_and_restores_all_or_nothing() -> None:
    model, data = model_and_data()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    with SwarmOptimizer(inner, model=model, **OPTIONS) as optimizer:
        for x, y in data:  # 4 steps
            optimizer.zero_grad()
            loss_of(model, x, y).backward()
            optimizer.step()
        state = optimizer.state_dict()
        assert "model" not in state
        buffer = io.BytesIO()
        torch.save(state, buffer)  # as Lightning and the HF Trainer do
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
    other_model, _ = model_and_data(seed=1)
    other_model.load_state_dict(model.state_dict())
    other_inner = torch.optim.AdamW(other_model.parameters(), lr=0.01)
    with SwarmOptimizer(other_inner, model=other_model, **OPTIONS) as other:
        bad = {**saved, "optimizer": {**saved["optimizer"], "state": {0: {"step": "x"}}}}
        with pytest.raises(Exception, match="optimizer"):
            other.load_state_dict(bad)
        assert other.swarm.engine.step_count == 0
        other.load_state_dict(saved)
        assert other.swarm.engine.step_count == 4
        assert torch.equal(
            other_inner.state_dict()["state"][0]["exp_avg"],
            inner.state_dict()["state"][0]["exp_avg"],
        )


def test_outer_learning_rate_follows_its_scheduler() -> None:
    model, data = model_and_data()
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    with SwarmOptimizer(inner, model=model, **OPTIONS) as optimizer:
        outer = torch.optim.lr_scheduler.LambdaLR(optimizer.outer, lambda r: 0.5**r)
        for i in range(8):
            x, y = data[i % len(data)]
            optimizer.zero_grad()
            loss_of(model, x, y).backward()
            optimizer.step()
            if optimizer.last_report.round_due:
                outer.step()
        optimizer.zero_grad()
        loss_of(model, *data[0]).backward()
        optimizer.step()  # the next round reads the scheduled rate
        assert optimizer.swarm.engine.config.outer_lr == pytest.approx(0.7 * 0.25)


def test_wrong_wiring_is_refused() -> None:
    model, _ = model_and_data()
    other, _ = model_and_data(seed=2)
    with pytest.raises(ConfigError, match="every trainable parameter"):
        SwarmOptimizer(torch.optim.SGD(other.parameters(), lr=0.1), model=model, **OPTIONS)
    with pytest.raises(ConfigError, match="samples_per_step"):
        SwarmOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, samples_per_step=0)


def test_scheduler_still_drives_the_inner_optimizer_after_a_state_round_trip() -> None:
    # accelerate (HF Trainer) calls load_state_dict(state_dict()) to place the state; the inner
    # optimizer then holds new param_groups, which the scheduler must keep driving.
    model, data = model_and_data()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    with SwarmOptimizer(inner, model=model, **OPTIONS) as optimizer:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / 4)
        optimizer.load_state_dict(optimizer.state_dict())
        before = [p.detach().clone() for p in model.parameters()]
        for _ in range(3):
            optimizer.zero_grad()
            loss_of(model, *data[0]).backward()
            optimizer.step()
            scheduler.step()
        assert optimizer.param_groups is inner.param_groups
        assert inner.param_groups[0]["lr"] == pytest.approx(0.01)
        assert all(not torch.equal(p, q) for p, q in zip(before, model.parameters(), strict=True))
