"""Slow poison: attacks inside the clip radius, update scoring and the records peers keep."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from poison_run import LOSS_BOUND, honest_only_loss, run, shown
from poison_run import data as poison_data
from poison_run import model as poison_model
from torch import nn

from swarm.api import AsyncSwarm
from swarm.averaging import Fault
from swarm.averaging.butterfly.alignment import AlignmentSums
from swarm.averaging.butterfly.robust import centered_clip
from swarm.averaging.butterfly.scoring import (
    LOWERED_BELOW,
    MIN_SPREAD,
    NEW_TRUST,
    TRUST_FLOOR,
    WARMUP_PARTS,
    PartScores,
    Progress,
    Reputation,
    part_scores,
    trust_of,
)
from swarm.averaging.faults import FaultInjector
from swarm.averaging.poison import Collusion, alie, inside_radius
from swarm.config import (
    DENSE_ANCHOR_SYNC_EVERY,
    SCORED_ANCHOR_SYNC_EVERY,
    SPARSE_ANCHOR_SYNC_EVERY,
    AveragingConfig,
    SwarmConfig,
)
from swarm.identity import Identity
from swarm.net.progress import MAX_REASON_CHARS


def updates(n: int, numel: int = 2000, noise: float = 0.5, seed: int = 0) -> torch.Tensor:
    """``n`` honest updates: a shared direction plus each peer's noise."""
    g = torch.Generator().manual_seed(seed)
    trend = torch.randn(numel, generator=g)
    return trend + noise * torch.randn(n, numel, generator=g)


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(3, 7),
    numel=st.integers(1, 300),
    scale=st.floats(1e-3, 1e3),
    overwrite=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_alignment_sums_are_those_of_the_rows_and_the_center(k, numel, scale, overwrite, seed):
    rows = updates(k, numel, seed=seed) * scale
    raw = rows.clone()
    clip = centered_clip(rows, [1.0] * k, overwrite=overwrite, score=True)
    center = clip.center.double()
    tol = 1e-3 * float(raw.double().norm(dim=1).max() * center.norm() + 1e-12)
    assert torch.allclose(torch.tensor(clip.dots).double(), raw.double() @ center, atol=tol)
    norms2 = raw.double().pow(2).sum(1)
    assert torch.allclose(torch.tensor(clip.norms2).double(), norms2, rtol=1e-3, atol=tol)
    assert clip.center_norm2 == pytest.approx(float(center @ center), rel=1e-3, abs=tol)
    # values above the center minus values below, counted in a frame shifted by one row: one
    # within rounding of the center's may land on the other side
    near = ((raw - clip.center).abs() <= 1e-5 * raw.abs().max()).sum(dim=1)
    sides = torch.tensor(clip.sides) - (raw - clip.center).sign().sum(dim=1)
    assert (sides.abs() <= 2 * near).all()


def test_no_scores_without_a_majority_or_unless_asked() -> None:
    assert centered_clip(updates(2, 10), [1.0, 1.0], score=True).dots == ()
    assert centered_clip(updates(4, 10), [1.0] * 4).dots == ()


def test_part_scores_leave_the_owner_out_need_three_and_a_common_direction() -> None:
    assert part_scores({0: 0.9, 1: -0.5}, owner=0) is None
    assert part_scores({0: 0.02, 1: -0.5, 2: 0.01}, owner=0) is None  # no common direction
    scores = part_scores({0: 0.9, 1: 0.8, 2: -0.5, 3: 0.7}, owner=0)
    assert scores == PartScores(0.9, {1: 0.8, 2: -0.5, 3: 0.7})


def test_trust_is_full_within_two_spreads_and_floored_past_four() -> None:
    assert trust_of(0.8, 0.8, 0.1) == 1.0
    assert trust_of(0.61, 0.8, 0.1) == 1.0  # two spreads below: an unusual honest peer
    assert trust_of(0.5, 0.8, 0.1) == pytest.approx(0.5)
    assert trust_of(0.4, 0.8, 0.1) == TRUST_FLOOR and trust_of(-0.8, 0.8, 0.1) == TRUST_FLOOR
    # peers that agree closely are not judged on a difference smaller than MIN_SPREAD allows
    assert trust_of(0.8, 0.99, 0.001) == 1.0 and trust_of(0.99 - 2 * MIN_SPREAD, 0.99, 0.0) == 1.0
    # where one part's alignment varies widely (peers holding unlike data), so does what passes
    assert trust_of(-0.1, 0.5, 0.45) == 1.0


def warm(rep: Reputation, own: float = 0.8) -> None:
    """Let ``rep`` see ``WARMUP_PARTS`` of its own parts (scoring a bystander)."""
    for _ in range(WARMUP_PARTS):
        rep.observe(PartScores(own, {0: own}), {0: BYSTANDER})


BYSTANDER = Identity.generate().peer_id


def test_the_reference_is_the_scorers_own_alignment_not_the_groups() -> None:
    """Two colluders in a group of four pull the group's median and spread their way; the
    scorer's own alignment is its own."""
    rep = Reputation()
    warm(rep)
    honest, a, b = (Identity.generate().peer_id for _ in range(3))
    peers = {1: honest, 2: a, 3: b}
    for _ in range(6):
        rep.observe(PartScores(0.8, {1: 0.75, 2: -0.5, 3: -0.6}), peers)
    assert rep.reference == (pytest.approx(0.8), MIN_SPREAD)
    assert rep.trust(honest) == 1.0
    assert rep.trust(a) < LOWERED_BELOW and rep.trust(b) < LOWERED_BELOW


def test_nobody_is_judged_before_the_scorer_saw_its_own_parts_vary() -> None:
    rep, peer = Reputation(), Identity.generate().peer_id
    assert rep.reference is None
    for _ in range(WARMUP_PARTS - 1):
        standing = rep.observe(PartScores(0.8, {0: -0.9}), {0: peer})[0]
        assert standing.trust == NEW_TRUST and "warming up" in standing.why
    assert rep.observe(PartScores(0.8, {0: -0.9}), {0: peer})[0].trust < NEW_TRUST
    assert rep.reference == (pytest.approx(0.8), MIN_SPREAD)


def test_a_record_falls_within_four_scorings_never_to_zero_and_recovers() -> None:
    rep, peer = Reputation(), Identity.generate().peer_id
    honest, bad = PartScores(0.8, {0: 0.8}), PartScores(0.8, {0: -0.8})
    assert rep.trust(peer) == NEW_TRUST
    warm(rep)
    rep.observe(honest, {0: peer})
    assert rep.trust(peer) == 1.0
    trusts = [rep.observe(bad, {0: peer})[0].trust for _ in range(4)]
    assert trusts[0] > LOWERED_BELOW > trusts[-1]  # one bad part is not a verdict
    for _ in range(50):
        rep.observe(bad, {0: peer})
    assert rep.trust(peer) == TRUST_FLOOR
    for _ in range(20):
        standing = rep.observe(honest, {0: peer})[0]
    assert standing.trust == 1.0 and standing.rounds == 75
    assert "alignment 0.80" in standing.why and "own 0.80 +- 0.10" in standing.why
    assert rep.lowered(8) == ()


def test_a_newcomer_starts_as_an_ordinary_peer_and_the_lowest_are_published() -> None:
    rep = Reputation()
    new, bad = (Identity.generate().peer_id for _ in range(2))
    for own in (0.1, 0.9) * 10:  # a scorer whose parts differ widely (unlike data)
        rep.observe(PartScores(own, {0: 0.3}), {0: BYSTANDER})
    ref, spread = rep.reference
    assert spread > 0.3
    standing = rep.observe(PartScores(0.5, {0: -0.2}), {0: new})[0]
    ref = rep.reference[0]
    assert standing.alignment == pytest.approx(0.85 * ref + 0.15 * -0.2)
    assert standing.trust == 1.0
    for _ in range(30):
        rep.observe(PartScores(0.5, {0: -0.9}), {0: bad})
    (short, trust, why), *rest = rep.lowered(8)
    assert not rest and short == bad.short and trust == TRUST_FLOOR and "aligned -0." in why


def test_records_are_bounded_least_recently_scored_first() -> None:
    rep = Reputation(limit=3)
    peers = [Identity.generate().peer_id for _ in range(4)]
    for p in [*peers, peers[1]]:
        rep.observe(PartScores(0.8, {0: 0.5}), {0: p})
    assert set(rep.snapshot()) == {peers[1], peers[2], peers[3]}


def test_progress_is_the_projection_on_the_center_also_per_unit_of_weight() -> None:
    rows = updates(4, noise=0.3)
    rows[3] *= 0.3  # an update shrunk inside the radius
    clip = centered_clip(rows.clone(), [1.0] * 4, score=True)
    progress = {i: d / clip.center_norm2 for i, d in enumerate(clip.dots)}
    center = clip.center.double()
    expected = (rows.double() @ center / (center @ center)).tolist()
    assert list(progress.values()) == pytest.approx(expected, rel=1e-4)
    cosines = {
        i: d / (n * clip.center_norm2) ** 0.5
        for i, (d, n) in enumerate(zip(clip.dots, clip.norms2, strict=True))
    }
    scores = part_scores(cosines, 0, progress, {i: 1.0 for i in range(4)})
    assert scores.own_progress == Progress(progress[0], pytest.approx(progress[0]))
    assert scores.progress[3].total < 0.4 < 0.8 < scores.progress[1].total
    # weights 2, 1, 1, 1: each member that delivers in proportion reads 1 per unit of weight
    scores = part_scores(
        {i: 0.9 for i in range(4)},
        1,
        {0: 10 / 7, 1: 5 / 7, 2: 5 / 7, 3: 5 / 7},
        {0: 2.0, 1: 1.0, 2: 1.0, 3: 1.0},
    )
    per_weight = [scores.own_progress.per_weight] + [
        scores.progress[i].per_weight for i in (0, 2, 3)
    ]
    assert per_weight == pytest.approx([1.0] * 4)
    # a claim past 8x the lower median counts as 8x; missing measures: alignments only
    capped = part_scores(
        {i: 0.9 for i in range(3)}, 1, {0: 1.2, 1: 0.9, 2: 0.9}, {0: 100.0, 1: 1.0, 2: 1.0}
    )
    assert capped.progress[0].per_weight == pytest.approx(1.2 * 6.6 / 8.0)
    assert part_scores({i: 0.9 for i in range(3)}, 1, {0: 1.0}, {0: 1.0}).progress == {}
    # a row past float32's range delivers nothing a record can hold
    assert AlignmentSums(math.inf, math.inf).progress(1.0) == 0.0
    assert AlignmentSums(-math.inf, 1.0).progress(1.0) == AlignmentSums(1.0, 1.0).progress(0.0) == 0


def progress_scores(own: float, other: float, other_per_weight: float) -> PartScores:
    return PartScores(0.8, {0: 0.8}, Progress(own, own), {0: Progress(other, other_per_weight)})


@pytest.mark.parametrize(
    ("total", "per_weight", "lowered"),
    [
        (0.3, 0.3, True),  # aligned, but a third of what its weight claims: shrunk
        (0.3, 1.0, False),  # a slow peer: little progress, and a weight to match
        (1.0, 0.4, False),  # a peer of large batches: a large claim for the same steps
        (0.9, 0.9, False),
    ],
)
def test_an_aligned_update_that_delivers_little_for_its_weight_loses_trust(
    total: float, per_weight: float, lowered: bool
) -> None:
    rep, peer = Reputation(), Identity.generate().peer_id
    for _ in range(WARMUP_PARTS):
        rep.observe(progress_scores(1.0, 1.0, 1.0), {0: BYSTANDER})
    for _ in range(12):
        standing = rep.observe(progress_scores(1.0, total, per_weight), {0: peer})[0]
    assert (standing.trust < LOWERED_BELOW) is lowered, standing
    assert standing.alignment == pytest.approx(0.8)
    if lowered:
        (short, _, why), *_ = rep.lowered(8)
        assert short == peer.short and "delivered 0.4 " in why and "own 1+-0.1" in why
    else:
        assert rep.lowered(8) == ()


@pytest.mark.parametrize("own", [1.0, -9.99e29])
@pytest.mark.parametrize("value", [-1e30, -123.456, 1e-7, 9.99e29])
def test_published_reasons_fit_the_record_whatever_the_values(value: float, own: float) -> None:
    """A lowered peer's reason goes into the scorer's published record (64 characters at most:
    a longer one failed every heartbeat)."""
    rep, peers = Reputation(), [Identity.generate().peer_id for _ in range(2)]
    for _ in range(WARMUP_PARTS):
        rep.observe(PartScores(0.9, {0: 0.9}, Progress(own, own), {}), {0: BYSTANDER})
    for _ in range(30):
        scores = PartScores(0.9, {0: 0.9, 1: -1.0}, Progress(own, own), {})
        scores.progress.update({0: Progress(value, value), 1: Progress(own, own)})
        rep.observe(scores, {0: peers[0], 1: peers[1]})
    lowered = rep.lowered(8)
    assert peers[1].short in {short for short, _, _ in lowered}, lowered  # on its alignment
    assert all(len(why) <= MAX_REASON_CHARS for _, _, why in lowered), lowered


def test_slow_poison_acts_in_update_rounds_only() -> None:
    x = updates(1)[0]
    for fault in (Fault.IPM, Fault.FREE_RIDE, Fault.ALIE, Fault.STALE, Fault.INSIDE_RADIUS):
        assert FaultInjector(fault).contribution(x) is x
    assert torch.equal(FaultInjector(Fault.IPM).contribution(x, True), -0.5 * x)
    assert not FaultInjector(Fault.FREE_RIDE).contribution(x, True).any()


def test_alie_pools_the_colluders_updates() -> None:
    xs = updates(3)
    assert torch.equal(alie([xs[0]]), xs[0] - xs[0].abs())
    collusion, members = Collusion(), [object() for _ in range(3)]
    for m, x in zip(members, xs, strict=True):
        got = collusion.alie(m, x)
    assert torch.allclose(got, xs.mean(0) - xs.std(0))


def test_inside_radius_turns_the_update_around_by_the_radius() -> None:
    x = updates(1)[0]
    assert inside_radius(x, None) is x
    norm = float(x.norm())
    for distance in (0.5 * norm, 3.0 * norm):
        sent = inside_radius(x, distance)
        assert float((sent - x).norm()) == pytest.approx(distance, rel=1e-4)
    assert float(inside_radius(x, 3.0 * norm) @ x) < 0  # past zero: the update inverted
    injector = FaultInjector(Fault.INSIDE_RADIUS)
    assert torch.equal(injector.contribution(x, True), x)  # no radius seen yet: honest
    injector.observe_radius(2.0, 100)
    expected = 0.9 * 2.0 * (x.numel() / 100) ** 0.5
    assert float((injector.contribution(x, True) - x).norm()) == pytest.approx(expected, 1e-4)


def test_update_scoring_is_off_by_default() -> None:
    assert AveragingConfig().score_updates is False


def test_scoring_syncs_dense_anchors_twice_as_often() -> None:
    assert SwarmConfig.build().anchor_sync_period == DENSE_ANCHOR_SYNC_EVERY == 4
    assert SwarmConfig.build(score_updates=True).anchor_sync_period == SCORED_ANCHOR_SYNC_EVERY
    assert SCORED_ANCHOR_SYNC_EVERY == 2
    sparse = SwarmConfig.build(score_updates=True, codec="sparse")
    assert sparse.anchor_sync_period == SPARSE_ANCHOR_SYNC_EVERY  # its syncs cost 40 rounds
    assert SwarmConfig.build(score_updates=True, anchor_sync_every=5).anchor_sync_period == 5


@pytest.mark.flaky(reruns=1)  # 6 peers in one loop on 2 shared cores (see the comment below)
@pytest.mark.parametrize(
    "fault", [Fault.IPM, Fault.FREE_RIDE, Fault.INSIDE_RADIUS, Fault.ALIE, Fault.STALE]
)
def test_an_attacker_loses_its_weight_and_honest_peers_keep_theirs(fault: Fault) -> None:
    """1 of 6 through real sockets: in the median view of the honest peers that scored it, the
    attacker's record falls below half within the run, and every honest peer's stays above;
    the worst honest peer ends within 5% of the 5 honest peers alone (0.90-1.02 of them in the
    benchmark's runs, 2 seeds each; a stale update 0.88-0.99 in 12 seeds, named by round
    14-17)."""
    # 30 rounds: a scorer meets the attacker in about 2 of 5 rounds, and needs up to 8 scorings
    # of a free rider where its own parts vary most (spread 0.165). With 20 the median scorer of
    # a loaded suite had scored it too few times and held it at 0.54 at the end (0.60 with 16);
    # in 6 runs beside three CPU hogs, 30 rounds left every median view at the floor (0.02).
    # An update shrunk inside the radius is named on its progress, not its direction: in the
    # median view by round 13-29 (40-round runs, 3 seeds), a scorer needing 7-12 scorings of it;
    # after 30 rounds one run's median view still held it at 0.55, and after 40 one run beside
    # a CPU hog at 0.505, so it gets 50. ALIE, named on its balance, fell below half by round
    # 7-14 (5 runs; the median view ended at 0.09-0.26 after 30 rounds): 40. A stale update,
    # named on its echo once the scorers kept 10 rounds of updates, fell below half by round
    # 16-17 (the median view ended at 0.04-0.11 after 40 rounds): 40.
    rounds = {Fault.INSIDE_RADIUS: 50, Fault.ALIE: 40, Fault.STALE: 40}.get(fault, 30)
    got = asyncio.run(run(peers=6, attackers=1, fault=fault, rounds=rounds, score_updates=True))
    assert not got["nan"]
    assert got["rounds_to_downweight"] is not None, shown(got)
    assert got["attacker_record_max"] < LOWERED_BELOW < got["honest_record_min"], shown(got)
    assert got["final_loss"] <= LOSS_BOUND * honest_only_loss(5, rounds), shown(got)


@pytest.mark.flaky(reruns=1)  # 8 peers in one loop on 2 shared cores
@pytest.mark.parametrize("fault", [Fault.FREE_RIDE, Fault.INSIDE_RADIUS])
def test_two_of_eight_attackers_lose_their_weight_and_honest_peers_keep_theirs(
    fault: Fault,
) -> None:
    """2 of 8 (ALIE's colluders: tests/test_offset_balance.py; stale updates:
    tests/test_stale_updates.py; IPM below): in the median honest view both fall below half
    within the run, and no honest peer does, and the worst honest peer ends within 5% of the 6
    honest peers alone (0.81-0.92 of them in the benchmark's runs). Named by round 8 (free
    riding) in the benchmark's runs, and an update shrunk inside the radius by round 14-26,
    ending at the floor (8 runs; before progress's rule narrowed to the records, the higher
    attacker ended at 0.06-0.55 in 19 runs, above half in 5)."""
    rounds = {Fault.INSIDE_RADIUS: 50}.get(fault, 40)
    got = asyncio.run(run(peers=8, attackers=2, fault=fault, rounds=rounds))
    assert got["attack_fired"] and not got["nan"], shown(got)
    assert got["rounds_to_downweight"] is not None, shown(got)
    assert got["attacker_record_max"] < LOWERED_BELOW < got["honest_record_min"], shown(got)
    assert got["honest_excluded"] == [], shown(got)
    assert got["final_loss"] <= LOSS_BOUND * honest_only_loss(6, rounds), shown(got)


@pytest.mark.flaky(reruns=1)  # 8 peers in one loop on 2 shared cores
def test_two_of_eight_ipm_attackers_lose_weight_and_honest_peers_keep_their_loss() -> None:
    """2 of 8 send -0.5 x their own update: in the median honest view both lose weight (below
    ``LOWER_LEVEL``, 0.9) within 16 rounds, no honest peer is held below half, and the worst
    honest peer ends within 5% of the 6 honest peers alone (0.84-0.97 of them in 7 runs).
    Measured over 12 runs: below 0.9 by round 6-12 in all; both below half by round 6-13 in
    10, one or both never in 2 (0.51-0.72 at their lowest); one back above half at the end in
    4 (0.53-0.99). Why: the signal fades. Over a run the scorers read the IPM peers' alignment
    rise from -0.68 (its first eighth) to about 0 to +0.2 (its second half) while honest
    members' falls from 0.87 to about 0.55 and the scorers' own spread widens (up to
    0.25-0.37), so late records recover by the rule that lowered them; no part went unscored
    for want of a shared direction (4 runs: none). Alone among 6 IPM is named every time."""
    got = asyncio.run(run(peers=8, attackers=2, fault=Fault.IPM, rounds=40))
    assert got["attack_fired"] and not got["nan"], shown(got)
    assert got["rounds_to_lower"] is not None and got["rounds_to_lower"] <= 16, shown(got)
    assert got["honest_excluded"] == [] and got["honest_record_min"] > LOWERED_BELOW, shown(got)
    assert got["final_loss"] <= LOSS_BOUND * honest_only_loss(6, 40), shown(got)


def test_a_calm_run_clips_and_lowers_no_honest_peer() -> None:
    """Measured without other load: 0-0.3% of honest contributions clipped below 0.5 (a peer
    whose rounds failed while the others averaged); the bound leaves room for a busy machine."""
    got = asyncio.run(run(peers=6, attackers=0, fault=Fault.NONE, rounds=16, score_updates=True))
    assert got["honest_record_min"] > LOWERED_BELOW, shown(got)
    assert got["honest_clip_rate"] < 0.1, shown(got)
    assert got["averaged_rounds_min"] >= 8, shown(got)


def test_honest_peers_with_unlike_data_keep_their_weight() -> None:
    """8 peers holding 2 of the 10 classes each: a quarter of their parts point away from the
    group's mean, yet no honest peer is ever held below half weight by half of the other honest
    peers or in the median view, and each ends at full weight there. Measured with two CPU hogs
    beside the run: in 14 runs of 68 one or more honest peers (holding classes that no other
    peer or one other held) fell below half in some views, never in more than 2 of the 7."""
    peers = 8
    got = asyncio.run(
        run(peers=peers, attackers=0, fault=Fault.NONE, rounds=16, score_updates=True, non_iid=True)
    )
    assert not got["nan"] and got["averaged_rounds_min"] >= 4, shown(got)
    assert got["honest_lowered_by_most"] < (peers - 1) / 2, got  # fewer than half the others
    assert got["honest_excluded"] == [], got  # the median view never below half
    assert got["honest_record_min"] >= LOWERED_BELOW, shown(got)


@pytest.mark.flaky(reruns=1)  # 8 peers in one loop on 2 shared cores: planners read records late
def test_colluders_cannot_get_an_honest_peer_excluded() -> None:
    """2 of 8 accuse one honest peer and hold its record at the floor every round: only their
    own view changes. Every honest view keeps its full weight and it keeps averaging with every
    honest peer in its group (before accusers answered 403, it missed a third of its rounds).

    Nor are they grouped with it for long: the victim lists the peers that refused it (403) in
    its record, the colluders say nothing, and every planner keeps the pairs apart. Without
    that the victim met an accuser again in 7-10 of 13-14 rounds (4 runs), and a round whose
    group held only the victim and its accusers (a planned honest member came late) averaged
    nothing for it (0-3 rounds of 12 unloaded, 6 in one loaded suite); with it, 0-3 of 13-14
    rounds (12 runs; 4 of 14 and 5 of 18 in loaded suites), the next round's planners not
    having read the list yet. So the bound is a share of the rounds run, below the 50-75%
    without the list."""
    got = asyncio.run(
        run(peers=8, attackers=2, fault=Fault.NONE, rounds=12, score_updates=True, slander=True)
    )
    assert got["victim_accused_by_honest"] == 0, shown(got)
    assert got["victim_trust_min"] >= LOWERED_BELOW, shown(got)
    # an accused member's part no longer waits for its accusers until the stall limit (they
    # say so), so an honest peer in its group is all it needs
    run_ = got["victim_rounds_run"]
    assert got["victim_failed_beside_honest"] <= 0.2 * run_, shown(got)
    assert got["victim_rounds_averaged"] + got["victim_among_accusers_only"] >= 0.5 * run_, shown(
        got
    )
    assert got["victim_slandered"], got  # the colluders did accuse and down-score it
    assert got["victim_with_accusers_again"] <= 0.4 * run_, shown(got)


def test_peers_with_and_without_scoring_never_group() -> None:
    """Scoring turns the part layout with every group: a peer without it would cut the vector
    differently, and honest members would refuse each other's parts. They never group."""

    async def mixed() -> list[bool]:
        swarms, averaged = [], []
        try:
            for flag in (True, False, True):
                m = poison_model()
                swarms.append(
                    await AsyncSwarm.create(
                        m,
                        torch.optim.Adam(m.parameters(), lr=1e-3),
                        run_id="mixed-scoring",
                        initial_peers=[swarms[0].address] if swarms else [],
                        listen="127.0.0.1:0",
                        inner_steps=2,
                        matchmaking_timeout_s=2.0,
                        heartbeat_s=1.0,
                        score_updates=flag,
                    )
                )
            await asyncio.sleep(2.0)

            async def train(swarm: AsyncSwarm) -> None:
                g = torch.Generator().manual_seed(0)
                while swarm.round < 3:
                    x, y = poison_data(32, g)
                    nn.functional.cross_entropy(swarm.model(x), y).backward()
                    report = await swarm.step(samples=32)
                    swarm.optimizer.zero_grad()
                    if report.round_due:
                        averaged.append((swarm is swarms[1], report.group_size))

            await asyncio.gather(*(train(s) for s in swarms))
        finally:
            for swarm in swarms:
                await swarm.close()
        return averaged

    got = asyncio.run(mixed())
    assert all(size in (0, 1) for plain, size in got if plain), got  # it averaged with nobody
    assert any(size == 2 for plain, size in got if not plain), got  # the two scoring peers did


def test_attackers_attack_whether_or_not_the_victims_score() -> None:
    """Scoring is the honest peers' setting: an attacker's poison must not depend on it (it
    once did, which made every undefended run an honest one)."""

    async def attack() -> bool:
        got = await run(peers=4, attackers=1, fault=Fault.IPM, rounds=3, score_updates=False)
        return got["attack_fired"]

    assert asyncio.run(attack())
