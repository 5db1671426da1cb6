"""inner_steps="auto": the steps between rounds fitted to measured step and round times."""

from __future__ import annotations

import math
import time

import pytest
import torch

from swarm.config import SwarmConfig
from swarm.errors import ConfigError
from swarm.training.cadence import BLOCKING_UTILIZATION, HIDE_MARGIN, Cadence
from swarm.training.driver import run_step
from swarm.training.engine import TrainingEngine
from swarm.training.rounds import RoundOutcome


def _steps(cadence: Cadence, seconds: float, count: int, start: float = 0.0) -> float:
    now = start
    for _ in range(count):
        now += seconds
        cadence.step(0.0, now=now)
    return now


def test_a_fixed_cadence_never_moves() -> None:
    cadence = Cadence(40, fragments=4)
    _steps(cadence, 0.01, 5)
    assert cadence.round_ended(100.0) == 40 and cadence.interval == 10


def test_overlapped_rounds_hide_behind_the_steps_they_need() -> None:
    cadence = Cadence(None, lowest=5, highest=1000, overlapped=True, start=5)
    assert cadence.inner_steps == 5
    _steps(cadence, 0.02, 10)  # steps of 20 ms
    chosen = cadence.round_ended(1.0)  # a round of 1 s: 50 steps
    assert abs(chosen - HIDE_MARGIN * 50) <= 1  # float sums of the step times
    assert cadence.interval == chosen


def test_blocking_rounds_cost_at_most_five_percent() -> None:
    cadence = Cadence(None, lowest=1, highest=10_000, overlapped=False, start=1)
    _steps(cadence, 0.01, 10)
    chosen = cadence.round_ended(0.1)  # 10 steps' worth
    utilization = chosen * 0.01 / (chosen * 0.01 + 0.1)
    assert utilization >= BLOCKING_UTILIZATION - 1e-9
    assert (chosen - 1) * 0.01 / ((chosen - 1) * 0.01 + 0.1) < BLOCKING_UTILIZATION


def test_bounds_fragments_and_waits_are_respected() -> None:
    cadence = Cadence(None, fragments=4, lowest=10, highest=100, overlapped=True, start=10)
    assert cadence.inner_steps == 8 and cadence.interval == 2  # 10 rounded down to 4's multiple
    now = _steps(cadence, 0.01, 5)
    cadence.step(5.0, now=now + 5.01)  # a step that waited 5 s on the swarm: 10 ms of compute
    assert cadence.step_s == pytest.approx(0.01)
    assert cadence.round_ended(60.0) == 100  # capped
    assert cadence.round_ended(0.0) == 100  # a nonsense round time changes nothing
    fast = Cadence(None, fragments=4, lowest=10, highest=100, start=10)
    _steps(fast, 1.0, 5)
    assert fast.round_ended(0.001) == 8  # at least the lowest, a multiple of fragments


def test_auto_is_a_config_value_with_its_range() -> None:
    config = SwarmConfig.build(inner_steps="auto", min_inner_steps=3, max_inner_steps=30)
    assert config.auto_inner_steps and config.round_interval == 3
    assert SwarmConfig.build(inner_steps="12").inner_steps == 12  # from text (an env variable)
    for bad in (
        {"inner_steps": "often"},
        {"inner_steps": "auto", "min_inner_steps": 0},
        {"inner_steps": "auto", "min_inner_steps": 9, "max_inner_steps": 3},
        {"inner_steps": True},
    ):
        with pytest.raises(ConfigError):
            SwarmConfig.build(**bad)


def test_an_engine_with_auto_steps_fits_them_and_reports_them() -> None:
    """Blocking rounds of about 10 steps' time: the engine moves from its lowest count to its
    highest (19 x 10 steps would keep the rounds under 5%, capped at 40)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    config = SwarmConfig.build(
        inner_steps="auto", min_inner_steps=2, max_inner_steps=40, overlap=False, codec="none"
    )
    engine = TrainingEngine(model, opt, config)

    def slow_round(plan) -> RoundOutcome:
        time.sleep(0.05)
        return RoundOutcome(True, 2, 0, 0)

    reports = []
    for _ in range(60):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        time.sleep(0.005)  # a step's compute
        reports.append(run_step(engine.step(8), slow_round))
        opt.zero_grad()
    rounds = [r for r in reports if r.round_due]
    assert rounds[0].inner_steps > 2  # fitted after the first round
    assert reports[-1].inner_steps == 40
    assert sum(r.round_due for r in reports[-40:]) <= 2  # rounds now come every 40 steps


def test_rounds_on_the_wall_clock_fall_due_at_the_same_instants_for_fast_and_slow_peers() -> None:
    """inner_steps="30s": due at the first step after each multiple of 30 s, whatever the speed;
    the steps a round took are what inner_steps then reports."""
    fast, slow = Cadence(None, period_s=30.0), Cadence(None, period_s=30.0)
    due_at: dict[str, list[float]] = {"fast": [], "slow": []}
    for name, cadence, step_s in (("fast", fast, 0.5), ("slow", slow, 2.0)):
        steps, now = 0, 1000.0 + step_s  # the first step ends 5 s before a boundary (1005)
        while now < 1100.0:
            steps += 1
            if cadence.due(steps, now=now):
                due_at[name].append(now)
                steps = 0
            now += step_s
    assert [math.floor(t / 30) for t in due_at["fast"]] == [34, 35, 36]
    assert [math.floor(t / 30) for t in due_at["slow"]] == [34, 35, 36]
    assert all(t - 30 * math.floor(t / 30) < 2.0 for t in due_at["fast"] + due_at["slow"])
    assert fast.inner_steps == 60 and slow.inner_steps == 15
    assert fast.interval > 10**9  # no step count ever ends a round on the clock


def test_a_clock_round_needs_a_step_and_fragments_split_the_period() -> None:
    cadence = Cadence(None, fragments=3, period_s=30.0)
    assert not cadence.due(1, now=1.0)  # the first boundary is the next one (10 s)
    assert not cadence.due(0, now=10.5)  # no step taken in this round yet
    assert cadence.due(1, now=10.6)
    assert not cadence.due(5, now=19.9) and cadence.due(6, now=20.0)
    assert cadence.inner_steps == 18  # 6 steps per fragment round, 3 fragments


def test_rounds_longer_than_their_period_are_warned_about_once(caplog) -> None:
    """int8 at 10 Mbit/s with rounds every 10 s: 21 s rounds left one step between them,
    silently; the peer now says so once, and again only after its rounds fit for a while."""
    blocking = Cadence(None, period_s=10.0, overlapped=False)
    with caplog.at_level("WARNING", logger="swarm.training.cadence"):
        blocking.round_ended(2.0)
        assert not caplog.records
        for _ in range(3):
            blocking.round_ended(21.0)
        assert len(caplog.records) == 1
        assert "longer than their period" in caplog.text and "few steps" in caplog.text
        for _ in range(10):
            blocking.round_ended(1.0)
        blocking.round_ended(60.0)
        assert len(caplog.records) == 2
        caplog.clear()
        fragments = Cadence(None, period_s=10.0, fragments=2)
        fragments.round_ended(6.0)  # over a 5 s slot, but a first round is not judged alone
        assert not caplog.records
        fragments.round_ended(6.0)
        fragments.round_ended(6.0)
        assert "starts late" in caplog.text and "2 fragments" in caplog.text
        caplog.clear()
        Cadence(20).round_ended(60.0)  # counted steps: no period to outlast
        assert not caplog.records


def test_a_clock_set_back_does_not_stop_the_rounds() -> None:
    cadence = Cadence(None, period_s=30.0)
    assert not cadence.due(1, now=10_000.0) and cadence.due(5, now=10_020.0)  # due at 10020
    # an NTP step sets the clock back an hour: the next round is the next boundary from there
    assert not cadence.due(1, now=6_400.0)
    assert cadence.due(3, now=6_420.5)


@pytest.mark.parametrize("text", ["30s", "0.5s", " 2 s", "12", "auto", "0.0000001s"])
def test_inner_steps_takes_counts_auto_and_durations(text: str) -> None:
    config = SwarmConfig.build(inner_steps=text)
    assert config.inner_steps == (int(text) if text.isdigit() else text.replace(" ", ""))
    # what the config keeps parses again to the same (a config rebuilt, e.g. replace())
    assert SwarmConfig.build(inner_steps=config.inner_steps).inner_steps == config.inner_steps


@pytest.mark.parametrize("text", ["0s", "-3s", "s", "30m", "1e3s", "many", "0", "9" * 400 + "s"])
def test_inner_steps_refuses_what_is_no_count_or_duration(text: str) -> None:
    with pytest.raises(ConfigError, match="inner_steps"):
        SwarmConfig.build(inner_steps=text)


def test_clock_rounds_are_ordered_by_their_instant_not_by_how_many_ran() -> None:
    """Two peers on 5 s rounds, one of which ran a round late (in flight across an instant, so
    one round fewer counted): rounds started after the same instant carry the same order, which
    plans the same groups; rounds counted in steps carry none (the engine's count serves)."""
    on_time, behind = Cadence(None, period_s=5.0), Cadence(None, period_s=5.0)
    assert on_time.clock_order(now=1000.2) == behind.clock_order(now=1003.9) == 200
    assert on_time.clock_order(now=1005.0) == 201
    assert Cadence(None, fragments=5, period_s=5.0).clock_order(now=1003.9) == 1003
    assert Cadence(10).clock_order(now=1000.0) is None


def test_an_engine_on_the_clock_plans_with_the_instants_order() -> None:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine = TrainingEngine(model, opt, SwarmConfig.build(inner_steps="5s", codec="none"))
    engine.round = 3  # rounds counted so far do not matter on the clock
    before = math.floor(time.time() / 5.0)
    order = engine.begin_round().order
    assert before <= order <= math.floor(time.time() / 5.0)
    counted = TrainingEngine(model, opt, SwarmConfig.build(inner_steps=10, codec="none"))
    counted.round = 3
    # counted: the count starts the planner (a resumed peer), then the groups keep it in step
    assert counted.begin_round().order == 3
    assert counted.begin_round().order is None
