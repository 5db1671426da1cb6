"""A member that claims a round order far ahead in every round cannot split the swarm's plans."""

from __future__ import annotations

import asyncio

import pytest
from poison_run import run, shown

from swarm.averaging import Fault


@pytest.mark.flaky(reruns=1)  # 7 peers in one loop on 2 shared cores
def test_a_member_claiming_a_round_order_far_ahead_does_not_split_the_swarm() -> None:
    """7 peers train 40 rounds, the last claiming an order ``ORDER_SLACK`` ahead in every part
    stream: every honest peer still averages in (nearly) every round. With the rule before
    (every member went on from the largest order in its leader's answer) the same runs
    averaged 28-36 rounds of 40, in 3x the time; with the second largest claim, 40 of 40 in
    3 seeds (a calm run misses one round now and then)."""
    got = asyncio.run(run(peers=7, attackers=1, fault=Fault.ORDER_AHEAD, rounds=40))
    assert got["attack_fired"] and not got["nan"], shown(got)
    assert got["averaged_rounds_min"] >= 38, shown(got)
