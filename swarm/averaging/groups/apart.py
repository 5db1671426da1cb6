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

from swarm.averaging.groups.peer_tags import by_tag, tag_of, tags_in
from swarm.averaging.groups.regions import GroupPlan, group_key_of
from swarm.identity import PeerID
from swarm.net.record import PeerRecord

APART_FIELD = "ap"  # key of the peers this peer will not average with, in PeerRecord.extra
MAX_APART_LISTED = 8
# candidates weighed per plan, a bound on the work free identities can make every planner do
# (1024 peers each listing 8: 52 ms on this machine, 300 ms before separation had a budget)
SEPARATION_BUDGET = 20_000
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


def apart_pairs(
    records: Mapping[PeerID, PeerRecord], me: PeerID, mine: Iterable[PeerID] = ()
) -> set[frozenset[PeerID]]:
    """Every pair of known peers that one of the two lists (``mine``: this peer's own list,
    newer than its record in ``records``)."""
    tagged = by_tag([*records, me])
    pairs = {frozenset((me, p)) for p in mine if p != me}
    for owner, record in records.items():
        if owner == me:
            continue
        for tag in tags_in(record, APART_FIELD, MAX_APART_LISTED):
            other = tagged.get(tag)
            if other is not None and other != owner:
                pairs.add(frozenset((owner, other)))
    return pairs


def separate(
    plan: GroupPlan, pairs: set[frozenset[PeerID]], budget: int = SEPARATION_BUDGET
) -> GroupPlan:
    """``plan`` with no listed pair in one group where a swap can avoid it.

    A member that shares its group with a peer it is paired with trades places with a member
    of another group, chosen so that neither group gets a pair: one of its own region first,
    then the earliest group, then the lowest digest. The same view and pairs give the same plan
    on every peer. At most ``budget`` candidates are weighed in all (free identities that list
    8 peers each cost the plan that many, not a scan of the swarm per pair).
    """
    partners: dict[PeerID, set[PeerID]] = {}
    for pair in pairs:
        a, b = tuple(pair)
        partners.setdefault(a, set()).add(b)
        partners.setdefault(b, set()).add(a)
    groups = [list(members) for members in plan.groups.values()]
    region_of = {p: i for i, region in enumerate(plan.regions) for p in region}

    def clashes(peer: PeerID, members: list[PeerID], leaving: PeerID) -> bool:
        """Whether ``peer`` is paired with one of ``members`` other than ``leaving``."""
        mine = partners.get(peer, ())
        return any(q in mine for q in members if q != leaving)

    def swap_for(peer: PeerID, gi: int) -> tuple[list[PeerID], PeerID] | None:
        """The group and member ``peer`` (of group ``gi``) trades places with, if any."""
        nonlocal budget
        group = groups[gi]
        for same_region in (True, False):
            for other in (g for hi, g in enumerate(groups) if hi != gi):
                if budget <= 0:
                    return None
                budget -= len(other)
                fits = [
                    q
                    for q in other
                    if (region_of.get(q) == region_of.get(peer)) == same_region
                    and not clashes(peer, other, q)
                    and not clashes(q, group, peer)
                ]
                if fits:
                    return other, min(fits, key=lambda q: q.digest)
        return None

    moved = False
    for gi, group in enumerate(groups):
        for peer in sorted((p for p in group if p in partners), key=lambda p: p.digest):
            if peer not in group or not clashes(peer, group, peer):
                continue
            swap = swap_for(peer, gi)
            if swap is not None:
                other, q = swap
                group[group.index(peer)] = q
                other[other.index(q)] = peer
                moved = True
    if not moved:
        return plan
    keyed = {group_key_of(plan.round, plan.kind, tuple(g)): tuple(g) for g in groups}
    return GroupPlan(plan.round, plan.kind, plan.regions, keyed, plan.idle)
