"""Stale updates: a peer sending its update of 10 rounds ago, which scoring does not name."""

from __future__ import annotations

import asyncio

import pytest
import torch
from poison_run import run

from swarm.averaging import Fault
from swarm.averaging.poison import STALE_ROUNDS, History


def test_stale_updates_are_ten_rounds_old() -> None:
    history = History()
    xs = torch.randn(STALE_ROUNDS + 3, 100, generator=torch.Generator().manual_seed(0))
    sent = [history.stale(x) for x in xs]
    assert torch.equal(sent[0], xs[0]) and torch.equal(sent[STALE_ROUNDS], xs[0])
    assert torch.equal(sent[STALE_ROUNDS + 2], xs[2])


# six runs of 40 rounds: about 170 s on an idle 2-core machine, 300 s beside a busy core
@pytest.mark.timeout(900)
def test_stale_updates_leave_the_honest_peers_where_they_would_be_alone() -> None:
    """2 of 8 send their update of 10 rounds ago, every round, unnamed by scoring: with the
    anchors synced in one group of 2 (scoring's default) the worst honest peer ends about where
    the 6 honest peers alone end. Syncing one group in 4, 16 of 33 runs ended above 0.25 (to
    1.68) where the honest peers alone ended at 0.185-0.209 (11 runs); syncing one group in 2,
    0.167-0.196 (8 runs). One seed moves either side by up to 15%: one run against one ran
    0.84-1.24x (7 pairs, seeds 0-2; seeds 0-4 later 0.164-0.211 against 0.187-0.196). Beside a
    busy core one honest anchor parts in some runs (0.239 where the honest mean was 0.169), and
    a loaded suite once ended a seed at 1.5x (0.275 against 0.184): three seeds are held to
    1.25x together, below the blow-ups syncing one group in 4 (mean 0.382 against 0.199)."""
    stale = {"peers": 8, "attackers": 2, "fault": Fault.STALE}
    seeds = (0, 1, 2)
    got = [asyncio.run(run(**stale, rounds=40, seed=s)) for s in seeds]
    alone = [
        asyncio.run(run(peers=6, attackers=0, fault=Fault.NONE, rounds=40, seed=s)) for s in seeds
    ]
    assert all(g["attack_fired"] and not g["nan"] for g in got), got
    losses = [g["final_loss"] for g in got], [a["final_loss"] for a in alone]
    assert sum(losses[0]) <= 1.25 * sum(losses[1]), losses
