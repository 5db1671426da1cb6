"""Training survives churn: 6 peer processes, 20% SIGKILLed and restarted on a schedule."""

from __future__ import annotations

import functools
import json
import logging
import math

import pytest
from churn_run import LOG_FORMAT, Life, losses_at_equal_rounds, run_swarm

pytestmark = pytest.mark.slow
ROUND_TIMEOUT_S = 8.0
SETTINGS = {
    "peers": 6,
    "duration_s": 40.0,
    "kill_every_s": 10.0,  # about 10 rounds at 16 inner steps on 2 loaded cores
    "worker_args": ["--inner-steps", "16", "--matchmaking-timeout", "3"],
    "round_timeout_s": ROUND_TIMEOUT_S,
}


@functools.cache
def _shared_runs() -> dict[str, dict]:
    return {
        "calm": run_swarm(kill_fraction=0.0, **SETTINGS),
        "churn": run_swarm(kill_fraction=0.2, warm_restarts=True, **SETTINGS),
    }


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    """One calm run and one with churn, shared by the tests below (each takes a minute). Kept
    for the process: a pytest-xdist worker that ran out of queued tests between two of them
    tears the module's fixtures down, and the runs were made twice (130-150 s each time)."""
    return _shared_runs()


def _figures(run: dict) -> dict:
    return {k: v for k, v in run.items() if k != "round_losses"}


def test_churn_keeps_every_peer_training_and_averaging(runs: dict[str, dict]) -> None:
    calm, churn = runs["calm"], runs["churn"]
    both = json.dumps({name: _figures(run) for name, run in runs.items()})
    assert churn["kills"] >= 2, both
    for run in (calm, churn):
        assert run["nan_rounds"] == 0, both
        assert all(math.isfinite(x) for x in run["final_losses"]), both
        assert run["max_gap_without_average_s"] <= 2 * ROUND_TIMEOUT_S, both
        assert run["averaged_share"] >= 0.8, both
    assert churn["join_to_first_average_s_max"] <= 2 * ROUND_TIMEOUT_S, both
    # well below the untrained model's 2.1: churn does not destroy the model
    assert churn["final_loss_max"] < 0.6 * 2.1, both


def test_a_calm_run_logs_nothing_above_info_about_honest_peers(runs: dict[str, dict]) -> None:
    """Honest peers left alone: no part refused, no owner accused or dropped, no streak of
    failed rounds, no task failure unread. Before, a member whose connection broke was refused
    at WARNING, and a round that failed now and then warned (2 of 3,537 rounds of 8 calm
    peers in 240 s). A peer's warning about its own loss is not about its peers, so it is left
    out here: it came once in 5 such runs (18,465 rounds; a short round's mean training loss
    1.51x the recent median, its test loss as before), before a rise had to stand out from the
    noise of the round's steps."""
    loud = [x for x in runs["calm"]["loud_lines"] if "looks divergent" not in x]
    assert loud == [], loud


def test_loud_lines_are_the_workers_lines_above_info_before_the_end() -> None:
    """What the calm-run check reads: lines in the workers' format, above INFO, up to the end."""

    def line(level: int, created: float) -> str:
        record = logging.LogRecord("swarm.x", level, __file__, 1, "said", None, None)
        record.created = created
        return logging.Formatter(LOG_FORMAT).format(record)

    life = Life(proc=None, slot=3, restarted=False)  # type: ignore[arg-type]
    life.lines = [
        line(logging.INFO, 10.0),
        line(logging.WARNING, 11.0),
        'ROUND {"t": 12.0}',
        line(logging.ERROR, 13.0),
        line(logging.WARNING, 21.0),  # after the end: the run's kills
    ]
    assert life.loud_lines(until=20.0) == [life.lines[1], life.lines[3]]


def _cost_check(runs: dict[str, dict]) -> str | None:
    """None when every churned peer is within 5% of the calm mean at equal rounds, else why."""
    calm_mean, churned, at_round = losses_at_equal_rounds(runs["calm"], runs["churn"])
    if at_round >= 50 and all(x <= 1.05 * calm_mean for x in churned):
        return None
    return (
        f"at round {at_round}: calm mean {calm_mean:.4f}, churned peers / calm mean "
        f"{[round(x / calm_mean, 3) for x in churned]}; at the end (wall clock): "
        + json.dumps({name: _figures(run) for name, run in runs.items()})
    )


def test_churn_costs_at_most_5_percent_of_the_loss(runs: dict[str, dict]) -> None:
    """Compared at the same round (the same samples per peer): see losses_at_equal_rounds.

    Over 15 pairs of runs the worst churned peer ended at 0.99-1.04x the calm mean in 14 and
    above 1.05x in one: a pair of 40 s runs on two shared cores still varies by a few percent,
    so when the first pair misses, a second pair decides (a real regression misses both).
    """
    first = _cost_check(runs)
    if first is None:
        return
    second = _cost_check(
        {
            "calm": run_swarm(kill_fraction=0.0, **SETTINGS),
            "churn": run_swarm(kill_fraction=0.2, warm_restarts=True, **SETTINGS),
        }
    )
    assert second is None, f"first pair: {first}\nsecond pair: {second}"
