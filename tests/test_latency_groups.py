"""Latency-aware groups on an emulated WAN: 8 in-process peers in 2 regions behind tests/wan.py.

One-way delay 2 ms inside a region and 60 ms between regions (RTT 4 ms / 120 ms); every peer
binds its own loopback address, so DHT datagrams, probes and all-reduce streams all cross the
emulated links. Probes every 0.3 s (4 peers each), so coordinates settle in a few seconds.
"""

from __future__ import annotations

import pytest
import wan_swarm as ws
from wan import WanEmulator

from swarm.averaging.groups.placement import LEAD_ROUNDS

DELAYS = {("a", "a"): 0.002, ("b", "b"): 0.002, ("a", "b"): 0.060}
PROBE_PERIOD = 0.3
pytestmark = pytest.mark.timeout(120)


@pytest.mark.flaky(reruns=2)  # 8 peers and a WAN emulator in one loop on 2 shared cores
async def test_near_groups_coordinates_and_consensus() -> None:
    async with WanEmulator(delays=DELAYS) as wan:
        swarm = await ws.start_swarm(wan, ["a"] * 4 + ["b"] * 4, probe_period=PROBE_PERIOD)
        try:
            await ws.wait_for_coordinates(swarm, samples=24, timeout=30)
            await ws.wait_for_regions(swarm, timeout=30)
            errors = await ws.rtt_prediction_errors(swarm)
            assert ws.median(errors) < 0.25, sorted(errors)

            # regular and cross-region rounds: odd rounds mix the regions; the placements of
            # the settled coordinates count from round LEAD_ROUNDS (no round ran before)
            ws.add_averagers(swarm, "mixed", cross_every=2)
            first = LEAD_ROUNDS
            mixed = await ws.average_until(swarm, "mixed", rounds=6, seed=1, first=first)
            near, cross = set(range(first, first + 6, 2)), set(range(first + 1, first + 6, 2))
            outcomes = [r for v in mixed.results.values() for _, r in v]
            failed = [r.reason for r in outcomes if not r.averaged]
            # a loaded 2-core machine may cost one peer one round; consensus below still holds
            assert len(failed) <= len(outcomes) // 10, failed
            # Regular rounds group by region. A random split of 4 + 4 peers is single-region
            # with probability 2/70 per group pair; a loaded machine may jolt one peer's
            # coordinate across the gap for a round (CI saw 4 of 6 groups single-region once).
            groups = ws.group_regions(swarm, mixed)
            assert ws.single_region_fraction(swarm, mixed, near) >= 0.6, groups
            # they do mix. A loaded machine splits some groups into 2-3 members, and a random
            # pair is single-region with probability 3/7 (CI saw 2 of 7 cross groups single)
            assert ws.single_region_fraction(swarm, mixed, cross) <= 0.5, groups
            assert mixed.final_error <= 1e-3, mixed.final_error

            # the same without cross-region rounds: each region agrees on its own mean only
            # (from settled regions again: the rounds above loaded the links and the loop; the
            # round numbers go on, as the placements in the records count by them)
            await ws.wait_for_regions(swarm, timeout=30)
            ws.add_averagers(swarm, "apart", cross_every=None)
            first += 6
            apart = await ws.average_until(swarm, "apart", rounds=6, seed=1, first=first)
            groups = ws.group_regions(swarm, apart)
            rounds = set(range(first, first + 6))
            assert ws.single_region_fraction(swarm, apart, rounds) >= 0.8, groups
            assert apart.final_error > 1e-2, apart.final_error
        finally:
            await swarm.close()


async def test_a_peer_that_moves_is_regrouped_with_its_new_neighbours() -> None:
    async with WanEmulator(delays=DELAYS) as wan:
        swarm = await ws.start_swarm(wan, ["a"] * 3 + ["b"] * 3, probe_period=PROBE_PERIOD)
        try:
            await ws.wait_for_regions(swarm, timeout=30)
            mover = swarm.members[0]
            b_ids = {m.peer.peer_id for m in swarm.members[3:]}
            wan.move(mover.node, "b")
            # every peer (the mover and its old and new neighbours) sees the new regions
            took = await ws.wait_for_regions(swarm, timeout=20 * PROBE_PERIOD)
            print(f"regrouped after {took / PROBE_PERIOD:.1f} probe periods")

            # its move counts from LEAD_ROUNDS rounds on (no round ran before: from that one)
            ws.add_averagers(swarm, "after", cross_every=None)
            progress = await ws.average_until(swarm, "after", rounds=1, first=LEAD_ROUNDS)
            result = progress.results[0][0][1]
            assert result.averaged, result
            assert set(result.members) == b_ids | {mover.peer.peer_id}
        finally:
            await swarm.close()
