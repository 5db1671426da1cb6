"""Stale updates: a peer sending its update of 10 rounds ago, named by its echo (see
swarm.averaging.butterfly.echoes)."""

from __future__ import annotations

import asyncio
import statistics

import pytest
import torch
from poison_run import LOSS_BOUND, run, shown

from swarm.averaging import Fault
from swarm.averaging.poison import STALE_ROUNDS, History


def test_stale_updates_are_ten_rounds_old() -> None:
    history = History()
    xs = torch.randn(STALE_ROUNDS + 3, 100, generator=torch.Generator().manual_seed(0))
    sent = [history.stale(x) for x in xs]
    assert torch.equal(sent[0], xs[0]) and torch.equal(sent[STALE_ROUNDS], xs[0])
    assert torch.equal(sent[STALE_ROUNDS + 2], xs[2])


# six runs of 40 rounds: about 170 s on an idle 2-core machine, 300 s beside a busy core; a
# rerun for the tail of parted anchors on a loaded machine (see the docstring)
@pytest.mark.timeout(900)
@pytest.mark.flaky(reruns=1)
def test_stale_updates_leave_the_honest_peers_where_they_would_be_alone() -> None:
    """2 of 8 send their update of 10 rounds ago, every round: the honest peers name them on their
    echo (below half in the median honest view by round 13-16 in 5 runs), and with the anchors
    synced in one group of 2 (scoring's default) the worst honest peer of the median seed ends
    about where the 6 honest peers alone end. Before the echo, unnamed: syncing one group in 4,
    16 of 33 runs ended above 0.25 (to 1.68) where the honest peers alone ended at 0.185-0.209
    (11 runs); syncing one group in 2, 0.167-0.196 (8 runs) on an idle machine. Under load the
    tail stays: two of these runs at once on 2 cores, 3 of 40 runs above 0.24 (0.243-0.447), and
    9 of 30 (0.241-0.323, once 8.9) with the dependencies at their floors; CI once ended a seed
    at 0.64 against 0.19 alone. So the median of three seeds was held to 1.25x, below the
    blow-ups syncing one group in 4 (median 0.241 against 0.199). Since the echo names them (by
    round 12-14), the worst honest peer ended at 0.82-0.98 of the honest peers alone in 6 seeds
    of 2 of 8 (and at 0.88-0.99 in 12 of 1 of 6, tests/test_poison.py), so the median of three
    seeds is held to the issue's 5%; one seed's tail under load does not move a median."""
    stale = {"peers": 8, "attackers": 2, "fault": Fault.STALE}
    seeds = (0, 1, 2)
    got = [asyncio.run(run(**stale, rounds=40, seed=s)) for s in seeds]
    alone = [
        asyncio.run(run(peers=6, attackers=0, fault=Fault.NONE, rounds=40, seed=s)) for s in seeds
    ]
    assert all(g["attack_fired"] and not g["nan"] for g in got), shown(got)
    assert all(g["rounds_to_downweight"] is not None for g in got), shown(got)
    assert all(g["honest_excluded"] == [] for g in got), shown(got)
    losses = [g["final_loss"] for g in got], [a["final_loss"] for a in alone]
    assert statistics.median(losses[0]) <= LOSS_BOUND * statistics.median(losses[1]), losses
