"""Update scoring's balance: which side of the robust mean a contribution's values lie on."""

from __future__ import annotations

import asyncio

import pytest
import torch
from poison_run import LOSS_BOUND, honest_only_loss, run, shown

from swarm.averaging import Fault
from swarm.averaging.butterfly.alignment import AlignmentSums, PartAlignment
from swarm.averaging.butterfly.robust import centered_clip
from swarm.averaging.butterfly.scoring import (
    BALANCE_SPREAD,
    LOWERED_BELOW,
    WARMUP_PARTS,
    PartScores,
    Reputation,
    part_scores,
)
from swarm.averaging.poison import alie
from swarm.identity import Identity
from swarm.net.progress import MAX_REASON_CHARS

BYSTANDER = Identity.generate().peer_id


def updates(n: int, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g) + 0.5 * torch.randn(n, numel, generator=g)


def test_balance_is_the_share_above_minus_the_share_below() -> None:
    part = PartAlignment()
    part.add_chunk([-1, 0, 1], (1.0, 1.0, 1.0), (1.0, 1.0, 1.0), 1.0, (0.0, 10.0, -10.0), 10)
    part.add_chunk([-1, 0, 1], (1.0, 1.0, 1.0), (1.0, 1.0, 1.0), 1.0, (0.0, 10.0, -4.0), 10)
    assert part.balance({-1, 0, 1}) == {-1: 0.0, 0: 1.0, 1: pytest.approx(-0.7)}
    assert AlignmentSums().balance() == 0.0
    got = part_scores({0: 0.9, 1: 0.8, 2: 0.7}, 0, balance={0: 0.1, 1: -0.6, 2: 0.2})
    assert got is not None and got.own_balance == 0.1 and got.balance == {1: -0.6, 2: 0.2}
    # unmeasured: no balance at all, never a partial one
    got = part_scores({0: 0.9, 1: 0.8, 2: 0.7}, 0, balance={0: 0.1})
    assert got is not None and got.own_balance is None and got.balance == {}


def test_alie_lies_below_the_mean_where_honest_noise_does_not() -> None:
    honest = updates(6, 4000, seed=1)
    rows = torch.cat([honest, alie(list(honest[:2])).unsqueeze(0)])
    clip = centered_clip(rows.clone(), [1.0] * 7, score=True)
    balance = [side / 4000 for side in clip.sides]
    assert all(abs(b) < 0.3 for b in balance[:6]), balance
    assert balance[6] < -0.6, balance


@pytest.mark.parametrize(
    ("balance", "lowered"),
    # 0.36: about how far honest records ran from their scorer's own in calm runs (8 peers
    # holding 2 of 10 classes each); judged on the scorer's own calm spread (0.1): below half
    [(-0.6, True), (0.6, True), (-0.15, False), (0.15, False), (-0.36, False), (0.36, False)],
)
def test_a_record_off_the_scorers_own_balance_on_either_side_loses_trust(
    balance: float, lowered: bool
) -> None:
    """Judged against the scorer's own balance (here 0 +- 0.1), on the spread BALANCE_SPREAD
    however little or much the scorer's own parts swing."""
    rep, peer = Reputation(), Identity.generate().peer_id
    for i in range(WARMUP_PARTS):
        own = 0.1 if i % 2 else -0.1
        rep.observe(PartScores(0.8, {0: 0.8}, own_balance=own, balance={0: own}), {0: BYSTANDER})
    for _ in range(12):
        scores = PartScores(0.8, {0: 0.8}, own_balance=0.0, balance={0: balance})
        standing = rep.observe(scores, {0: peer})[0]
    assert standing.balance == pytest.approx(balance, abs=0.15)
    assert (standing.trust < LOWERED_BELOW) is lowered, standing
    if lowered:
        (short, _, why), *_ = rep.lowered(8)
        assert short == peer.short and why.startswith("offset skewed")
        assert len(why) <= MAX_REASON_CHARS
    # a scorer whose own parts swing widely (an ALIE attacker in some of its groups pulls the
    # mean down) still judges on the capped spread
    wide = Reputation()
    for i in range(3 * WARMUP_PARTS):
        own = 0.5 if i % 2 else -0.5
        wide.observe(PartScores(0.8, {0: 0.8}, own_balance=own, balance={0: 0.0}), {0: BYSTANDER})
    assert wide._own_balance.reference()[1] > 2 * BALANCE_SPREAD
    for _ in range(12):
        scores = PartScores(0.8, {0: 0.8}, own_balance=0.0, balance={0: balance})
        standing = wide.observe(scores, {0: peer})[0]
    assert (standing.trust < LOWERED_BELOW) is lowered, standing


# in a loaded full suite one attacker's record ended back above half twice (0.66 in CI, 0.54
# locally; alone 0 of 3 that day), and its first run failed in 2 of 3 suites of one day: the
# record was read on the last round alone, where the median view jumps (0.02, 0.19, 0.02 in
# three rounds of a colluder held at the floor). The end is now the last 5 rounds averaged
# (see poison_run's END_ROUNDS); no verdict is final, so a second run still decides, and ALIE
# never named fails both
@pytest.mark.flaky(reruns=1)
def test_colluding_alie_attackers_lose_their_weight_and_honest_peers_keep_theirs() -> None:
    """2 of 8 send the mean of their updates minus their standard deviation (the paper's
    colluders): named on balance by round 10-21 (9 runs, seeds 0-7; end records 0.02-0.35 in
    the median honest view after 30 rounds), honest peers at full weight in that view, the worst
    of them within 5% of the 6 honest peers alone (0.85 and 0.88 of them in 2 seeds). A
    scorer judges nobody before its own parts warmed up (6 of them) and scores an attacker in
    about 3 rounds of 7, so a suite that leaves rounds short named one late: 40 rounds."""
    got = asyncio.run(run(peers=8, attackers=2, fault=Fault.ALIE, rounds=40))
    assert got["attack_fired"] and not got["nan"], shown(got)
    assert got["rounds_to_downweight"] is not None, shown(got)
    assert got["attacker_record_max"] < LOWERED_BELOW < got["honest_record_min"], shown(got)
    assert got["final_loss"] <= LOSS_BOUND * honest_only_loss(6, 40), shown(got)
