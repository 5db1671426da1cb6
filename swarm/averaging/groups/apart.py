"""Peers kept out of each other's groups: a member that refuses another cannot average with it.

An owner that excludes a member (it accused it twice, rightly or not) answers its part streams
with 403 and sends it nothing; a group of the excluded member and its excluders then averages
nothing for it, however honest it is (two colluders that slander one peer left it in groups of
only its accusers in 3 rounds of 12, and those rounds were lost). So every peer lists in its
record the peers it will not average with: the owners it excludes and the owners that refused
it with 403 lately (:class:`KeptApart`, at most :data:`MAX_APART_LISTED`). Planners keep every
listed pair out of one group (:func:`separate`), swapping one of the two with a member of
another group. A pair needs only one side to list it, so an excluder that does not say so is
named by the peer it refused; and a peer can only name pairs it is part of, so a liar listing
honest peers keeps only itself away from them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

from swarm.averaging.groups.regions import GroupPlan, group_key_of
from swarm.identity import PeerID
from swarm.net.record import PeerRecord

APART_FIELD = "ap"  # key of the peers this peer will not average with, in PeerRecord.extra
MAX_APART_LISTED = 8
APART_TAG_CHARS = 12  # a listed peer: the first hex characters of its PeerID digest
# how long a refusal keeps a pair apart: kept apart, the two never meet to refuse again, so
# this is about how often a lasting refusal costs one of the refused peer's rounds
APART_HOLD_S = 600.0


class KeptApart:
    """The peers this peer will not be grouped with, each until its hold runs out."""

    def __init__(self, hold_s: float = APART_HOLD_S, limit: int = MAX_APART_LISTED):
        self.hold_s = hold_s
        self.limit = limit
        self._until: OrderedDict[PeerID, float] = OrderedDict()  # the latest added last
        self.on_new: Callable[[], None] | None = None  # called when a peer joins the list

    def add(self, peer: PeerID, now: float | None = None) -> None:
        """Keep ``peer`` apart from this one for ``hold_s`` from now."""
        now = time.monotonic() if now is None else now
        new = self._until.pop(peer, None) is None
        self._until[peer] = now + self.hold_s
        while len(self._until) > self.limit:
            del self._until[next(iter(self._until))]
        if new and self.on_new is not None:
            self.on_new()

    def listed(self, now: float | None = None) -> list[PeerID]:
        """The peers kept apart now, oldest first."""
        now = time.monotonic() if now is None else now
        for peer in [p for p, until in self._until.items() if until <= now]:
            del self._until[peer]
        return list(self._until)

    def tags(self, now: float | None = None) -> list[str]:
        """:meth:`listed` as the record carries it."""
        return [tag_of(p) for p in self.listed(now)]


def tag_of(peer: PeerID) -> str:
    return peer.digest.hex()[:APART_TAG_CHARS]


def listed_tags(record: PeerRecord) -> list[str]:
    """The tags ``record`` lists as kept apart; [] when the entry is missing or malformed."""
    raw = record.extra.get(APART_FIELD)
    if not isinstance(raw, list) or len(raw) > MAX_APART_LISTED:
        return []
    return [t for t in raw if isinstance(t, str) and len(t) == APART_TAG_CHARS]


def apart_pairs(
    records: Mapping[PeerID, PeerRecord], me: PeerID, mine: Iterable[PeerID] = ()
) -> set[frozenset[PeerID]]:
    """Every pair of known peers that one of the two lists (``mine``: this peer's own list,
    newer than its record in ``records``)."""
    by_tag = {tag_of(p): p for p in records}
    by_tag.setdefault(tag_of(me), me)
    pairs = {frozenset((me, p)) for p in mine if p != me}
    for owner, record in records.items():
        if owner == me:
            continue
        for tag in listed_tags(record):
            other = by_tag.get(tag)
            if other is not None and other != owner:
                pairs.add(frozenset((owner, other)))
    return pairs


def separate(plan: GroupPlan, pairs: set[frozenset[PeerID]]) -> GroupPlan:
    """``plan`` with no listed pair in one group where a swap can avoid it.

    A member that shares its group with a peer it is paired with trades places with a member
    of another group, chosen so that neither group gets a pair: one of its own region first,
    then the earliest group. The same view and pairs give the same plan on every peer.
    """
    if not pairs:
        return plan
    groups = [list(members) for members in plan.groups.values()]
    region_of = {p: i for i, region in enumerate(plan.regions) for p in region}

    def clashes(members: Iterable[PeerID], peer: PeerID) -> bool:
        return any(frozenset((peer, q)) in pairs for q in members if q != peer)

    moved = False
    for gi, group in enumerate(groups):
        for peer in sorted(group, key=lambda p: p.digest):
            if peer not in group or not clashes(group, peer):
                continue
            best: tuple[tuple[bool, int, bytes], int, PeerID] | None = None
            for hi, other in enumerate(groups):
                if hi == gi:
                    continue
                for q in other:
                    if clashes([x for x in other if x != q], peer):
                        continue
                    if clashes([x for x in group if x != peer], q):
                        continue
                    rank = (region_of.get(q) != region_of.get(peer), hi, q.digest)
                    if best is None or rank < best[0]:
                        best = (rank, hi, q)
            if best is not None:
                _, hi, q = best
                group[group.index(peer)] = q
                groups[hi][groups[hi].index(q)] = peer
                moved = True
    if not moved:
        return plan
    keyed = {group_key_of(plan.round, plan.kind, tuple(g)): tuple(g) for g in groups}
    return GroupPlan(plan.round, plan.kind, plan.regions, keyed, plan.idle)
