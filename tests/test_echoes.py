"""Update scoring's echoes: how closely a contribution repeats an update applied rounds before."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.averaging.butterfly import echoes
from swarm.averaging.butterfly.echoes import (
    ECHO_SPREAD,
    ECHO_WINDOW,
    HISTORY,
    MIN_LAG,
    PartEchoes,
    UpdateHistory,
    loudest,
)
from swarm.averaging.butterfly.kept import MAX_LAYOUTS
from swarm.averaging.butterfly.scoring import (
    LOWERED_BELOW,
    WARMUP_PARTS,
    PartScores,
    Reputation,
    part_scores,
)
from swarm.identity import Identity
from swarm.net.progress import MAX_REASON_CHARS

LAYOUT = (None, 0)


def test_the_history_keeps_the_applied_updates_newest_first_at_its_positions() -> None:
    history = UpdateHistory()
    assert history.sample(LAYOUT, 10) is None  # nothing applied yet
    rounds = [[torch.full((4,), float(r)), torch.arange(6.0) * r] for r in range(HISTORY + 3)]
    for tensors in rounds:
        history.record(LAYOUT, tensors)
    sample = history.sample(LAYOUT, 10)
    assert sample is not None and sample.positions.tolist() == list(range(10))
    assert sample.past.shape == (HISTORY, 10)  # the oldest rounds dropped
    for k in range(HISTORY):
        applied = torch.cat(rounds[-1 - k])
        assert torch.equal(sample.past[k], applied), k
    assert history.sample(LAYOUT, 11) is None  # another size: not this history
    assert history.sample(("fragment", 1), 10) is None  # nor another layout's


def test_the_history_keeps_at_most_max_layouts_the_oldest_dropped() -> None:
    history = UpdateHistory()
    for f in range(MAX_LAYOUTS + 2):
        history.record((f, 3), [torch.full((3,), float(f))])
    assert history.sample((0, 3), 3) is None and history.sample((1, 3), 3) is None
    for f in range(2, MAX_LAYOUTS + 2):
        sample = history.sample((f, 3), 3)
        assert sample is not None and sample.past.tolist() == [[float(f)] * 3], f


def test_a_large_vector_is_sampled_at_private_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(echoes, "SAMPLE", 64)
    a, b = UpdateHistory(), UpdateHistory()
    update = [torch.randn(1000), torch.randn(24, 10)]
    for h in (a, b):
        h.record(LAYOUT, update)
    sa, sb = a.sample(LAYOUT, 1240), b.sample(LAYOUT, 1240)
    assert sa is not None and sb is not None
    assert 0 < len(sa.positions) <= 64 and sa.positions.tolist() == sorted(
        set(sa.positions.tolist())
    )
    assert not torch.equal(sa.positions, sb.positions)  # each peer's own secret
    flat = torch.cat([t.reshape(-1) for t in update])
    assert torch.equal(sa.past[0], flat[sa.positions])


@settings(max_examples=40, deadline=None)
@given(
    numel=st.integers(1, 300),
    lags=st.integers(1, 5),
    members=st.integers(1, 5),
    cut=st.integers(1, 64),
    part=st.tuples(st.integers(0, 300), st.integers(0, 300)),
    seed=st.integers(0, 2**31),
)
def test_part_echoes_are_the_cosines_over_the_sampled_positions_in_the_part(
    numel: int, lags: int, members: int, cut: int, part: tuple[int, int], seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    history = UpdateHistory()
    for _ in range(lags):
        history.record(LAYOUT, [torch.randn(numel, generator=g)])
    sample = history.sample(LAYOUT, numel)
    assert sample is not None
    start, end = sorted(min(x, numel) for x in part)
    rows = torch.randn(members, end - start, generator=g)
    meter = PartEchoes(sample, start, end)
    for a in range(0, end - start, cut):  # chunk by chunk, a copy each, as the clip overwrites
        b = min(end - start, a + cut)
        meter.add_chunk(list(range(members)), rows[:, a:b].clone(), a, b)
    got = meter.cosines(set(range(members)))
    if end == start:
        assert got == {}
        return
    past = sample.past[:, start:end].double()
    for m in range(members):
        want = torch.nn.functional.cosine_similarity(rows[m].double()[None], past, dim=1)
        assert got[m] == pytest.approx(want.tolist(), abs=1e-9)


def test_huge_or_zero_contributions_give_finite_cosines() -> None:
    history = UpdateHistory()
    history.record(LAYOUT, [torch.ones(8)])
    sample = history.sample(LAYOUT, 8)
    assert sample is not None
    meter = PartEchoes(sample, 0, 8)
    rows = torch.stack([torch.full((8,), 3.4e38), torch.zeros(8), -torch.ones(8)])
    meter.add_chunk([0, 1, 2], rows, 0, 8)
    got = meter.cosines({0, 1, 2})
    assert got == {0: (1.0,), 1: (0.0,), 2: (-1.0,)}
    meter.reset()
    assert meter.cosines({0, 1, 2}) == {}


def test_the_loudest_echo_is_a_window_of_lags_from_the_minimum_lag() -> None:
    assert loudest(None) is None
    assert loudest((0.9,) * (MIN_LAG + ECHO_WINDOW - 2)) is None  # no whole window yet
    echo = [0.0] * HISTORY
    echo[0] = echo[1] = echo[2] = 0.9  # recent lags: ordinary
    echo[12] = 0.5  # one loud lag alone: noise, averaged over its window
    assert loudest(echo) == (9, pytest.approx(0.1))
    echo[12] = 0.0
    echo[7:12] = [0.2] * 5  # lags 8-12
    assert loudest(echo) == (8, pytest.approx(0.2))


def _scorer() -> tuple[Reputation, dict[int, object]]:
    """A scorer past its warm-up, with four ordinary peers on record."""
    rep = Reputation()
    peers = {i: Identity.generate().peer_id for i in range(1, 6)}
    for n in range(WARMUP_PARTS + 4):
        rep.observe(PartScores(0.8 + 0.02 * (n % 3), {i: 0.8 for i in range(1, 5)}), peers)
    return rep, peers


def _echoes(over: float, at: range) -> tuple[float, ...]:
    return tuple(over if k + 1 in at else 0.0 for k in range(HISTORY))


def test_a_stale_sender_falls_below_half_and_ordinary_ones_keep_their_weight() -> None:
    rep, peers = _scorer()
    stale, fresh = peers[1], peers[2]
    for n in range(30):
        noise = 0.03 * math.sin(n)
        scores = PartScores(
            0.8,
            {i: 0.8 for i in range(1, 5)},
            echoes={
                1: _echoes(0.2, range(8, 13)),
                2: _echoes(noise, range(1, HISTORY + 1)),
                3: _echoes(-noise, range(1, HISTORY + 1)),
                4: _echoes(0.6, range(1, MIN_LAG)),  # the last rounds' direction: ordinary
            },
        )
        rep.observe(scores, peers)
    assert rep.trust(stale) < LOWERED_BELOW
    standing = rep.standing(stale)
    assert standing is not None and "echoes updates" in standing.low
    assert len(standing.low) <= MAX_REASON_CHARS
    assert all(rep.trust(peers[i]) == 1.0 for i in (2, 3, 4)), [rep.trust(fresh)]


def test_a_sender_below_the_scorers_own_keeps_its_weight() -> None:
    """Unlike data: the scorer's own data is in every update it applied, another's not."""
    rep, peers = _scorer()
    for _ in range(30):
        below = {i: _echoes(-0.4, range(1, HISTORY + 1)) for i in range(1, 5)}
        rep.observe(PartScores(0.8, {i: 0.8 for i in range(1, 5)}, echoes=below), peers)
    assert all(rep.trust(peers[i]) == 1.0 for i in range(1, 5))


def test_records_that_swing_widen_the_echo_rule() -> None:
    """With unlike data honest records echo far from the scorer's own, both ways: a sender
    4 spreads above it keeps its weight there, and falls to the floor where records lie close."""
    peers = {i: Identity.generate().peer_id for i in range(1, 7)}
    kept = {}
    for swing in (0.0, 0.1):
        rep = Reputation()
        for _ in range(WARMUP_PARTS + 40):
            echoes_of = {i: _echoes(swing * (i - 3), range(1, HISTORY + 1)) for i in peers}
            echoes_of[6] = _echoes(4 * ECHO_SPREAD, range(5, 10))
            rep.observe(PartScores(0.8, dict.fromkeys(peers, 0.8), echoes=echoes_of), peers)
        kept[swing] = rep.trust(peers[6])
    assert kept[0.0] < LOWERED_BELOW < kept[0.1] == 1.0


def test_part_scores_give_each_senders_echo_over_the_owners_own() -> None:
    cos = {0: 0.9, 1: 0.8, 2: 0.7}
    own, theirs = (0.1, 0.2), (0.3, -0.1)
    got = part_scores(cos, 0, echoes={0: own, 1: theirs, 2: own})
    assert got is not None
    assert got.echoes == {1: pytest.approx((0.2, -0.3)), 2: (0.0, 0.0)}
    missing = part_scores(cos, 0, echoes={0: own, 1: theirs})  # one member unmeasured
    assert missing is not None and missing.echoes == {}
