"""16 unequal peers in one process (issue 32): speeds 1x and 0.25x, uplinks 100 and 10 Mbit/s.

Rounds on the wall clock (``inner_steps="5s"``) let the slow peers arrive with the fast ones,
so nobody waits for anybody: measured on this 2-core machine (one event loop for all 16),
every peer averaged in 0.90-1.0 of its due rounds (0.97 of all) and every fast peer's
utilization was 1.0. With rounds every 50 steps instead (5 s for a fast peer) the fast peers'
groups planned the slow ones in and went without them: 0.82 of all due rounds, 0.40 for one
slow peer, and twice the spread. On a slower CI machine rounds took 5.3 s, longer than their
period, and the fast peers waited 8-26% of the time for the round before (utilization
0.74-0.92); a clock round due in flight now starts when that one lands, without a wait.
"""

from __future__ import annotations

import json
import math

import pytest
from many_peers import RunConfig, mixed_specs, run

# the anchors' spread (max over peers of ||anchor - mean|| / ||mean||) at the end, with groups
# of 4 among 16 peers and a cross round every 4th: measured 0.14, 0.20, 0.30 and 0.30 on this
# task in 4 runs of 100 s measured (0.15-0.17 in 3 earlier ones; 0.33 with rounds every 50
# steps), 0.20 with 70 s measured (every peer averaged in all of its 14 due rounds); anchors of
# groups that never meet reach about 1
SPREAD_BOUND = 0.4
CONSENSUS_BOUND = 0.01  # after the finishing rounds (issue 32's goal)
# all 16 peers share one event loop: when it cannot keep the fast peers at half their emulated
# speed (seen once on a loaded CI machine: a quarter), the run measures the machine, not the swarm
MIN_SPEED_KEPT = 0.5


# a loaded floors suite once ended the anchors' spread at 0.416 (alone: 0.11-0.23 in 3 runs)
@pytest.mark.flaky(reruns=1)
async def test_sixteen_unequal_peers_average_without_waiting_for_each_other() -> None:
    specs = mixed_specs(16, (1.0, 0.25), (100.0, 10.0))
    # 85 s of training (14 due rounds of 5 s measured after the first 15 s), then 3
    # average_parameters() calls
    config = RunConfig(
        specs, duration_s=70.0, warmup_s=15.0, options={"inner_steps": "5s"}, finish_rounds=3
    )
    figures = await run(config)
    per_peer = figures.pop("per_peer")
    seen = json.dumps(figures) + "".join(f"\n{p}" for p in per_peer)
    assert not figures["nan"] and math.isfinite(figures["final_loss"]), seen
    if figures["speed_kept_fast_min"] < MIN_SPEED_KEPT:
        pytest.skip(
            f"the shared event loop ran the fast peers at {figures['speed_kept_fast_min']:.0%} "
            f"of their emulated speed (loop CPU {figures['loop_cpu_share']:.0%}): this machine "
            "is too loaded to emulate 16 peers"
        )
    assert all(p["due"] >= 10 for p in per_peer), seen
    assert all(p["averaged"] >= 0.8 * p["due"] for p in per_peer), seen
    assert all(p["utilization"] > 0.9 for p in per_peer if p["speed"] == 1.0), seen
    assert figures["anchor_spread_trained"] < SPREAD_BOUND, seen
    # the finishing rounds follow a 4 x 4 grid: two full ones leave one model (measured 1.1e-7
    # and 1.2e-7 in two runs side by side, all 48 rounds in groups of 4; near groups, before,
    # left 0.019 and 0.058 after 4 rounds in loaded suites)
    assert figures["consensus_spread"] < CONSENSUS_BOUND, seen
