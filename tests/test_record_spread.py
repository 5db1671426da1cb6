"""Update scoring's rule widens with the records a scorer holds: unlike data, not attackers."""

from __future__ import annotations

import math

import pytest

from swarm.averaging.butterfly.scoring import (
    LOWERED_BELOW,
    POPULATION_CAP,
    POPULATION_MIN,
    TRUST_FLOOR,
    WARMUP_PARTS,
    PartScores,
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
