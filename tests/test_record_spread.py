"""Update scoring's rule widens with the records a scorer holds: unlike data, not attackers;
and progress's rule narrows with them where they agree closer than one part does."""

from __future__ import annotations

import math

import pytest

from swarm.averaging.butterfly.scoring import (
    LOWERED_BELOW,
    MIN_SPREAD,
    POPULATION_CAP,
    POPULATION_MIN,
    PROGRESS_NARROWEST,
    TRUST_FLOOR,
    WARMUP_PARTS,
    PartScores,
    Progress,
    Reputation,
    widened,
)
from swarm.identity import Identity, PeerID

OWN = (0.8, 0.1)  # the scorer's own alignment: mean and spread


def test_the_rule_widens_to_the_records_median_distance_up_to_a_cap() -> None:
    assert widened(None, [0.0] * 8) is None
    assert widened(OWN, [0.2] * (POPULATION_MIN - 1)) == OWN  # too few to say
    assert widened(OWN, [0.8, 0.75, 0.85, 0.8]) == OWN  # equal data: records lie close
    mean, spread = widened(OWN, [0.7, 0.65, 0.95, 0.6, 0.9])
    assert mean == 0.8 and spread == pytest.approx(1.4826 * 0.15)
    assert widened(OWN, [-5.0, -4.0, 3.0]) == (0.8, POPULATION_CAP * 0.1)
    # a record that is no number widens nothing, and does not count towards the minimum
    assert widened(OWN, [0.2, 0.2, math.nan, math.inf]) == OWN
    assert widened(OWN, [0.7, 0.6, 0.9, math.nan])[1] == pytest.approx(1.4826 * 0.1)
    # two attackers far off among five records close by cannot move the median
    assert widened(OWN, [0.8, 0.78, 0.82, 0.79, 0.81, -0.9, -0.8]) == OWN


def test_the_progress_rule_narrows_to_close_records_down_to_a_share_of_the_own_spread() -> None:
    wide = (1.1, 0.3)  # one part's progress varies by 0.3
    mean, spread = widened(wide, [1.0, 0.95, 1.25, 1.0, 0.3], PROGRESS_NARROWEST)
    assert mean == 1.1 and spread == pytest.approx(1.4826 * 0.15)  # the records' median distance
    assert widened(wide, [1.1] * 5, PROGRESS_NARROWEST) == (1.1, PROGRESS_NARROWEST * 0.3)
    assert widened((1.1, 0.15), [1.1] * 5, PROGRESS_NARROWEST)[1] == MIN_SPREAD  # never below
    assert widened(wide, [1.1] * (POPULATION_MIN - 1), PROGRESS_NARROWEST) == wide  # too few
    # records far apart (unlike data) widen it as they widen the others
    assert widened(wide, [0.2, 2.0, 0.3, 1.9], PROGRESS_NARROWEST) == (1.1, POPULATION_CAP * 0.3)
    assert widened(wide, [1.1] * 5) == wide  # the other measures never narrow
    assert widened((0.0, 0.035), [0.0] * 5, PROGRESS_NARROWEST) == (0.0, 0.035)  # kept as it is


def score_progress(rep: Reputation, delivered: dict[PeerID, float], rounds: int) -> dict:
    """``rounds`` parts in which the scorer's own progress reads 0.8 and 1.4 by turns (1.1,
    +-0.3) and each peer in ``delivered`` that much; the records' trust at the end."""
    peers = dict(enumerate(delivered))
    trust = {}
    for r in range(rounds):
        own = 0.8 if r % 2 else 1.4
        scores = PartScores(
            0.8,
            dict.fromkeys(peers, 0.8),
            Progress(own, own),
            {i: Progress(delivered[p], delivered[p]) for i, p in peers.items()},
        )
        trust = {peers[i]: s.trust for i, s in rep.observe(scores, peers).items()}
    return trust


def test_an_update_shrunk_to_a_third_falls_where_honest_records_agree_closely() -> None:
    """The scorer's own parts vary by 0.3 (late in a run, as measured: 0.2-0.36 per part),
    so a record at 0.35 lies 2.5 of those spreads below its own 1.1 and kept 0.81 of its
    weight when the rule did not narrow; the other records lie within 0.15, so it falls to the
    floor and they keep theirs. With the others spread as unlike data spreads them, it keeps
    its weight."""
    shrunk = Identity.generate().peer_id
    honest = {Identity.generate().peer_id: v for v in (1.0, 1.05, 0.95, 1.1, 1.0)}
    got = score_progress(Reputation(), {**honest, shrunk: 0.35}, 24)
    assert got.pop(shrunk) == TRUST_FLOOR
    assert all(t == 1.0 for t in got.values()), got
    unlike = {Identity.generate().peer_id: v for v in (0.4, 1.9, 0.5, 1.8, 0.45)}
    got = score_progress(Reputation(), {**unlike, shrunk: 0.35}, 24)
    assert all(t == 1.0 for t in got.values()), got


def scorer() -> Reputation:
    rep, bystander = Reputation(), Identity.generate().peer_id
    for i in range(WARMUP_PARTS):
        rep.observe(PartScores(0.7 if i % 2 else 0.9, {0: 0.8}), {0: bystander})
    return rep


def score(rep: Reputation, peers: dict[PeerID, float], times: int) -> dict[PeerID, float]:
    trust = {}
    for _ in range(times):
        for peer, alignment in peers.items():
            trust[peer] = rep.observe(PartScores(0.8, {0: alignment}), {0: peer})[0].trust
    return trust


def test_peers_with_unlike_data_keep_their_weight_and_an_attacker_among_them_does_not() -> None:
    """Records 0.35 below the scorer's own (3.5 of its spreads: a quarter of the weight alone)
    keep full weight where every record the scorer holds lies that far; one turned around
    falls to the floor whether the others lie far or close."""
    unlike = {Identity.generate().peer_id: 0.45 for _ in range(5)}
    first = next(iter(unlike))
    assert score(scorer(), {first: 0.45}, 16)[first] < LOWERED_BELOW
    attacker = Identity.generate().peer_id
    got = score(scorer(), {**unlike, attacker: -0.5}, 16)
    assert got.pop(attacker) == TRUST_FLOOR
    assert all(t == 1.0 for t in got.values()), got
    equal = {Identity.generate().peer_id: 0.78 for _ in range(5)}
    assert score(scorer(), {**equal, attacker: -0.5}, 16)[attacker] == TRUST_FLOOR


def test_records_held_below_half_do_not_widen_the_rule() -> None:
    """Free riders (alignment 0) fall below half at once and are left out of the records that
    widen the rule: a fourth joining them later falls as the first did."""
    riders = {Identity.generate().peer_id: 0.0 for _ in range(4)}
    assert all(t == TRUST_FLOOR for t in score(scorer(), riders, 12).values())
    rep = scorer()
    score(rep, dict(list(riders.items())[:3]), 12)
    late = Identity.generate().peer_id
    assert score(rep, {late: 0.0}, 12)[late] == TRUST_FLOOR
