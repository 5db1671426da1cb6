"""Peers kept apart: the lists records carry, the pairs they make, and plans that separate them."""

from __future__ import annotations

import hashlib
import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.address import PeerAddress
from swarm.averaging.groups.apart import (
    APART_FIELD,
    MAX_APART_LISTED,
    KeptApart,
    apart_pairs,
    separate,
)
from swarm.averaging.groups.coordinates import Coordinate
from swarm.averaging.groups.peer_tags import tag_of, tags_in
from swarm.averaging.groups.regions import (
    NEAR,
    GroupingConfig,
    GroupPlan,
    group_key_of,
    plan_groups,
)
from swarm.identity import Identity, PeerID
from swarm.net.record import PeerRecord

CONFIG = GroupingConfig(min_group_size=2, target_group_size=4, cross_every=3, region_rtt=0.05)


def _peer(i: int) -> PeerID:
    return PeerID(hashlib.sha256(b"apart %d" % i).digest())


def _record(identity: Identity, extra: dict | None = None) -> PeerRecord:
    return PeerRecord.create(
        identity, address=PeerAddress("127.0.0.1", 9), run_id="apart", extra=extra or {}
    )


def _plan(groups: list[list[PeerID]], regions: tuple[tuple[PeerID, ...], ...] = ()) -> GroupPlan:
    keyed = {f"r1.n.{i}": tuple(g) for i, g in enumerate(groups)}
    everyone = tuple(p for g in groups for p in g)
    return GroupPlan(1, NEAR, regions or (everyone,), keyed)


def _pairs_within(plan: GroupPlan, pairs: set[frozenset[PeerID]]) -> int:
    return sum(
        frozenset(pq) in pairs for g in plan.groups.values() for pq in itertools.combinations(g, 2)
    )


def test_kept_apart_holds_each_peer_for_a_while_and_lists_the_latest() -> None:
    apart = KeptApart(hold_s=10.0, limit=3)
    for i in range(4):
        apart.add(_peer(i), now=float(i))
    assert apart.listed(now=4.0) == [_peer(1), _peer(2), _peer(3)]  # the oldest went first
    apart.add(_peer(1), now=5.0)  # renewed: now the latest
    assert apart.listed(now=12.5) == [_peer(3), _peer(1)]  # 2's hold ran out at 12
    assert apart.tags(now=12.5) == [tag_of(_peer(3)), tag_of(_peer(1))]
    assert apart.listed(now=15.0) == []


def test_hostile_apart_lists_are_ignored_whole_or_in_part() -> None:
    identity = Identity.generate()
    good = tag_of(_peer(1))

    def listed(value: object) -> list[str]:
        return tags_in(_record(identity, {APART_FIELD: value}), APART_FIELD, MAX_APART_LISTED)

    assert listed([good]) == [good]
    for hostile in ("not a list", {"a": 1}, [good] * (MAX_APART_LISTED + 1), None, 7):
        assert listed(hostile) == []
    assert listed([good, 5, "short", good + "x", None, ["nested"]]) == [good]


def test_a_peer_can_only_pair_itself_with_the_peers_it_names() -> None:
    """A liar that lists every honest peer keeps only itself away from them; a tag of nobody
    known, or its own, makes no pair."""
    ids = [Identity.generate() for _ in range(5)]
    peers = [i.peer_id for i in ids]
    liar, me = peers[0], peers[1]
    records = {
        liar: _record(ids[0], {APART_FIELD: [tag_of(p) for p in peers] + ["0" * 12]}),
        peers[2]: _record(ids[2], {APART_FIELD: [tag_of(peers[3])]}),
        peers[3]: _record(ids[3]),
        peers[4]: _record(ids[4]),
    }
    pairs = apart_pairs(records, me, mine=[peers[4], me])
    assert pairs == {
        frozenset((liar, me)),
        frozenset((liar, peers[2])),
        frozenset((liar, peers[3])),
        frozenset((liar, peers[4])),
        frozenset((peers[2], peers[3])),
        frozenset((me, peers[4])),
    }
    assert all(len(p) == 2 for p in pairs)


def test_a_victim_planned_with_its_accusers_trades_places() -> None:
    """Two accusers and their victim dealt into one group: the victim swaps with a member of
    another group, the accusers' list of whom they refuse costs nobody else anything."""
    p = [_peer(i) for i in range(8)]
    victim, accusers = p[0], (p[1], p[2])
    plan = _plan([[p[0], p[1], p[2], p[3]], [p[4], p[5], p[6], p[7]]])
    pairs = {frozenset((victim, a)) for a in accusers}
    out = separate(plan, pairs)
    assert _pairs_within(out, pairs) == 0
    assert sorted(len(g) for g in out.groups.values()) == [4, 4]
    assert {q for g in out.groups.values() for q in g} == set(p)
    assert all(key == group_key_of(1, NEAR, g) for key, g in out.groups.items())
    assert separate(plan, pairs) == out  # every planner with the same view agrees
    assert separate(plan, set()) is plan
    assert separate(plan, pairs, budget=0) is plan  # the work is bounded: none, no swap


def test_a_swap_stays_in_the_region_when_it_can() -> None:
    p = [_peer(i) for i in range(12)]
    eu, us = tuple(p[:8]), tuple(p[8:])
    plan = _plan([list(p[0:4]), list(p[4:8]), list(p[8:12])], regions=(eu, us))
    out = separate(plan, {frozenset((p[0], p[1]))})
    moved = next(g for g in out.groups.values() if p[0] in g or p[1] in g)
    assert not {p[0], p[1]} <= set(moved)
    assert all(set(g) <= set(eu) or set(g) <= set(us) for g in out.groups.values())


def test_a_pair_that_cannot_be_separated_leaves_the_plan_as_it_was() -> None:
    p = [_peer(i) for i in range(3)]
    plan = _plan([p])
    assert separate(plan, {frozenset((p[0], p[1]))}) is plan


@settings(max_examples=60, deadline=None)
@given(
    st.integers(4, 40),
    st.integers(0, 30),
    st.integers(0, 2**32 - 1),
)
def test_separation_keeps_members_and_sizes_and_never_adds_a_pair(n, count, seed) -> None:
    rng = random.Random(seed)
    view = {
        _peer(i): Coordinate((rng.uniform(0, 0.2), rng.uniform(0, 0.2)), 0.001, 0.1)
        for i in range(n)
    }
    plan = plan_groups(view, rng.randrange(10), CONFIG)
    peers = list(view)
    pairs = {frozenset(rng.sample(peers, 2)) for _ in range(count)}
    out = separate(plan, pairs)
    assert sorted(map(len, out.groups.values())) == sorted(map(len, plan.groups.values()))
    assert sorted(q.digest for g in out.groups.values() for q in g) == sorted(
        q.digest for g in plan.groups.values() for q in g
    )
    assert out.idle == plan.idle
    assert _pairs_within(out, pairs) <= _pairs_within(plan, pairs)
    assert separate(plan, pairs) == out
