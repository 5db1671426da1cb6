"""Iterative node lookup (kademlia section 2.3) that really ends at the k closest nodes.

Unlike kademlia 2.2.3's ``SpiderCrawl``, the lookup keeps ``alpha`` requests in flight at all
times (a slow node does not hold up a whole round of requests), only ends when each of the k
closest contacts it knows has answered or failed, and, for a value lookup, collects the entries
of every node it asks instead of stopping at the first one that has any: records are
dictionaries merged from several nodes, not single values to vote on. Once one holder answered,
the lookup is among the key's holders and asks every holder it still needs at once.

A node meeting us for the first time answers no more bytes than we sent (see
:mod:`swarm.dht.cookies`), so its list of contacts may be cut. Once every contact among the k
closest has been asked, those whose answers were cut are asked again, all at once (they answered
moments ago, and now hold our cookie): the lookup still ends at the true k closest.

A request unanswered after ``protocol.stall_after`` (a few smoothed RTTs) counts as *stalled*, as
in the paper: the lookup asks the next contact instead of waiting for the full timeout, and ends
without it; the request itself runs on in the background so that a dead node is still recorded
(and skipped by later lookups for a while).
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field
from typing import Any

from swarm.dht.protocol import SwarmProtocol
from swarm.dht.provenance import reported_age
from swarm.dht.records import KEY_DIGEST_BYTES, DHTEntry
from swarm.dht.routing import Contact
from swarm.errors import DHTError

logger = logging.getLogger(__name__)

STALL_GRACE = 3.0  # stall periods, from its request, a stalled node closer than any answer gets
MAX_REFRESH_BANDS = 24  # covers swarms of millions of nodes
REFRESH_IN_PARALLEL = 6
REFRESH_KSIZE = 4


@dataclass
class LookupResult:
    """What one lookup found."""

    closest: list[Contact]  # the k closest nodes that answered, closest first
    entries: list[DHTEntry] = field(default_factory=list)  # unverified, possibly duplicated
    asked: int = 0  # requests sent
    failed: int = 0  # requests that got no answer
    truncated: bool = False  # some node held more entries than one datagram carries
    more: list[tuple[Contact, list[int]]] = field(default_factory=list)  # holder, next cursor
    # slot -> {holder's node id: the slot's age it reported}: the material of DHTEntry.age_s
    ages: dict[tuple[bytes, str], dict[bytes, float]] = field(default_factory=dict)


async def lookup(
    protocol: SwarmProtocol,
    target: bytes,
    *,
    ksize: int,
    alpha: int,
    value: bool = False,
    holders: int | None = None,
    skip_suspects: bool = True,
) -> LookupResult:
    """Find the ``ksize`` nodes closest to ``target``; with ``value``, also their entries.

    Args:
        protocol: the node's protocol (its routing table seeds the lookup).
        target: a 20-byte node id or key digest.
        ksize: how many closest nodes to find.
        alpha: requests in flight at once.
        value: send ``find_value`` (collect entries) instead of ``find_node``.
        holders: with ``value``, end as soon as this many nodes answered with entries (they are
            asked closest first, so they are the ones that hold the key).
        skip_suspects: count nodes that failed to answer moments ago as failed without asking
            (False for a second, thorough pass).
    """
    search = Lookup(protocol, target, ksize, alpha, value, holders, skip_suspects)
    return await search.run()


class Lookup:
    """One iterative lookup (see :func:`lookup` for its arguments): what it knows, what it asked
    and what came back, one method per step of a round."""

    def __init__(
        self,
        protocol: SwarmProtocol,
        target: bytes,
        ksize: int,
        alpha: int,
        value: bool,
        holders: int | None,
        skip_suspects: bool,
    ):
        self.protocol = protocol
        self.target = target
        self.ksize, self.alpha = ksize, alpha
        self.value, self.holders = value, holders
        self.skip_suspects = skip_suspects
        self.method = "find_value" if value else "find_node"
        self.goal = int.from_bytes(target, "big")
        self.known: dict[bytes, Contact] = {c.id: c for c in protocol.router.closest(target, ksize)}
        # answers repeat contacts (and us): each is parsed once
        self.known_keys = {_keys_of(c) for c in (*self.known.values(), protocol.source_node)}
        self.queried: set[bytes] = set()
        self.answered: set[bytes] = set()
        self.failed: set[bytes] = set()
        self.cut: set[bytes] = (
            set()
        )  # answered with part of their contacts: to ask again at the end
        self.asked_again: set[bytes] = set()
        self.in_flight: dict[asyncio.Task[Any], tuple[Contact, float]] = {}  # -> (contact, sent)
        self.stalled: set[asyncio.Task[Any]] = set()
        self.holding = 0  # nodes that answered with entries
        self.result = LookupResult(closest=[])
        self.loop = asyncio.get_running_loop()

    async def run(self) -> LookupResult:
        """Ask, wait, take the answers, until the k closest have answered or failed."""
        while True:
            closest = self._ranked()
            self._ask_closest(closest)
            self._ask_cut_again(closest)
            active = [t for t in self.in_flight if t not in self.stalled]
            if active:
                await self._wait_for_active(active)
            elif not await self._wait_for_stalled():
                break
            self._take_answers()
            if self.holders is not None and self.holding >= self.holders:
                break
        self.result.closest = [c for c in self._ranked() if c.id in self.answered]
        return self.result

    def _ranked(self) -> list[Contact]:
        """The k closest contacts that may still be results, closest first."""
        # a node asked again after it answered (its answer was cut) stays a result meanwhile
        waiting = {self.in_flight[t][0].id for t in self.stalled} - self.answered
        live = [c for c in self.known.values() if c.id not in self.failed and c.id not in waiting]
        return sorted(live, key=lambda c: c.long_id ^ self.goal)[: self.ksize]

    def _ask(self, contact: Contact) -> bool:
        task = self.protocol.spawn(self.protocol.call(contact, self.method, self.target))
        if task is None:  # the node is closing
            return False
        self.in_flight[task] = (contact, self.loop.time())
        self.result.asked += 1
        return True

    def _ask_closest(self, closest: list[Contact]) -> None:
        """Keep ``alpha`` requests in flight to the closest contacts not asked yet."""
        # once a holder answered, the lookup is among the key's holders: ask all the holders
        # still missing at once rather than alpha at a time (a round trip less per get)
        width = self.alpha
        if self.holders is not None and self.holding:
            width = max(self.alpha, self.holders - self.holding)
        for contact in closest:
            if len(self.in_flight) - len(self.stalled) >= width:
                break
            if contact.id in self.queried:
                continue
            self.queried.add(contact.id)
            if self.skip_suspects and self.protocol.is_suspect(contact.id):
                self.failed.add(contact.id)  # failed moments ago: do not wait for it again
                continue
            if not self._ask(contact):
                break

    def _ask_cut_again(self, closest: list[Contact]) -> None:
        """Once all of the closest were asked, ask those whose answers were cut once more."""
        if len(self.in_flight) != len(self.stalled):
            return
        if not all(c.id in self.queried for c in closest):
            return
        for contact in closest:  # once each: a node that always cuts is not asked forever
            if contact.id in self.cut and contact.id not in self.asked_again:
                self.asked_again.add(contact.id)
                self._ask(contact)

    async def _wait_for_active(self, active: list[asyncio.Task[Any]]) -> None:
        """Wake on an answer, or when the oldest active request stalls: a dead node then stops
        holding up the lookup, while its request runs on to count the failure."""
        oldest = min(self.in_flight[t][1] for t in active)
        wait_s = max(0.0, oldest + self.protocol.stall_after - self.loop.time())
        done, _ = await asyncio.wait(active, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        now = self.loop.time()
        for task in active:
            if task not in done and now - self.in_flight[task][1] >= self.protocol.stall_after:
                self.stalled.add(task)

    async def _wait_for_stalled(self) -> bool:
        """Nothing left to ask: wait for the stalled requests still worth an answer; False when
        none is (the lookup ends).

        A stalled request to a node closer than any that answered may be a slow node, not a
        dead one, and the only way into the target's region: on a busy host, ending without it
        put stores and gets in different places. Those are waited for a little longer, counted
        from when each was asked: a dead node must not cost a full timeout, nor a fresh wait
        once the rest of the lookup is done. Requests to nodes that answered moments ago (cut
        answers asked again) and, until anyone answered, all requests are waited for until their
        own timeout: the former are alive and hold the ranks a cut answer hid, and without the
        latter the lookup has nothing to end with (on a busy host, both ended lookups with a few
        or no nodes).
        """
        goal, in_flight = self.goal, self.in_flight
        best = min(
            (c.long_id ^ goal for c in self.known.values() if c.id in self.answered), default=None
        )
        patient = [t for t in self.stalled if best is None or in_flight[t][0].id in self.answered]
        closer = [
            t for t in self.stalled if t not in patient and in_flight[t][0].long_id ^ goal < best
        ]
        wait_s = None
        if not patient:
            if not closer:
                return False
            last_sent = max(in_flight[t][1] for t in closer)
            wait_s = last_sent + STALL_GRACE * self.protocol.stall_after - self.loop.time()
            if wait_s <= 0:
                return False
        done, _ = await asyncio.wait(
            patient + closer, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED
        )
        return bool(done)

    def _take_answers(self) -> None:
        """Take in every finished request: the contacts it found, the entries it carried."""
        for task in [t for t in self.in_flight if t.done()]:
            contact, _ = self.in_flight.pop(task)
            self.stalled.discard(task)
            body = None if task.cancelled() else task.result()
            if not isinstance(body, dict) or "error" in body:
                self.failed.add(contact.id)
                self.result.failed += 1
                continue
            self.answered.add(contact.id)
            if body.get("cut") is True:
                self.cut.add(contact.id)
            for found in _contacts(body.get("nodes"), self.known_keys):
                if found.id != self.protocol.source_node.id and found.id not in self.known:
                    self.known[found.id] = found
                    self.known_keys.add(_keys_of(found))
            if self.value and _collect(body, self.target, self.result, contact.id):
                self.holding += 1
                cursor = _cursor(body.get("next"))
                if cursor is not None:
                    self.result.more.append((contact, cursor))


def _keys_of(contact: Contact) -> tuple[bytes, bytes]:
    return (contact.keys.public_key, contact.keys.agreement_key)


def _contacts(nodes: Any, known_keys: set[tuple[bytes, bytes]]) -> list[Contact]:
    """The contacts in an answer, less those whose keys (hence id) are already known."""
    if not isinstance(nodes, list):
        return []
    found = []
    for obj in nodes[:64]:
        if isinstance(obj, list) and len(obj) == 5:
            keys = obj[0], obj[1]
            if all(isinstance(k, bytes) for k in keys) and keys in known_keys:
                continue
        try:
            found.append(Contact.from_wire(obj))
        except DHTError as e:
            logger.debug("ignoring a malformed contact in an answer: %s", e)
    return found


def _cursor(value: Any) -> list[int] | None:
    if (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 20 for v in value)
    ):
        return value
    return None


async def more_pages(
    protocol: SwarmProtocol, key: bytes, holder: Contact, cursor: list[int], pages: int
) -> LookupResult:
    """Follow a holder's ``next`` cursors for up to ``pages`` more answer pages; the result's
    ``entries`` and ``ages`` are what they carried."""
    result = LookupResult(closest=[])
    for _ in range(pages):
        body = await protocol.call(holder, "find_value", key, cursor)
        if not isinstance(body, dict) or "error" in body:
            break
        _collect(body, key, result, holder.id)
        next_cursor = _cursor(body.get("next"))
        if next_cursor is None or next_cursor <= cursor:
            break
        cursor = next_cursor
    return result


def _collect(body: dict[str, Any], key: bytes, result: LookupResult, holder: bytes) -> bool:
    """Add the answer's valid-looking entries, and the ages ``holder`` reported for their
    slots, to ``result``; True when there was any entry."""
    entries = body.get("entries")
    if not isinstance(entries, list):
        return False
    ages = body.get("ages")
    if not isinstance(ages, list) or len(ages) != len(entries):
        ages = [None] * len(entries)  # an older node, or a malformed list: no ages from it
    before = len(result.entries)
    if body.get("truncated") is True:
        result.truncated = True
    for obj, reported in zip(entries, ages, strict=True):
        try:
            entry = DHTEntry.from_wire(key, obj)
        except DHTError as e:
            logger.debug("ignoring a malformed entry in an answer: %s", e)
            continue
        result.entries.append(entry)
        age = reported_age(reported)
        if age is not None:
            result.ages.setdefault(entry.slot, {})[holder] = age
    return len(result.entries) > before


async def refresh_bands(protocol: SwarmProtocol, node_id: bytes, alpha: int) -> None:
    """Look up a random id at each distance from ``node_id`` (kademlia section 2.3: a joining
    node refreshes every bucket further away than its closest neighbour).

    A lookup of our own id only meets nodes near us; without this, a node may know nobody
    in the other half of the key space, and its stores then land on the closest nodes of
    *its* half, where no reader looks. Band ``d`` holds the ids that share exactly ``d``
    leading bits with ours; bands are refreshed until one comes back empty.
    """
    own = int.from_bytes(node_id, "big")
    bits = KEY_DIGEST_BYTES * 8
    for first in range(0, MAX_REFRESH_BANDS, REFRESH_IN_PARALLEL):
        bands = range(first, min(first + REFRESH_IN_PARALLEL, MAX_REFRESH_BANDS))
        targets = []
        for depth in bands:
            flip = 1 << (bits - 1 - depth)
            below = flip - 1
            target = ((own ^ flip) & ~below) | (random.getrandbits(bits) & below)
            targets.append(target.to_bytes(KEY_DIGEST_BYTES, "big"))
        # a few nodes per band are enough (and much cheaper than k): each one that answers
        # enters the routing table, and its bucket fills as it is used
        found = await asyncio.gather(
            *(lookup(protocol, t, ksize=REFRESH_KSIZE, alpha=alpha) for t in targets)
        )
        for depth, result in zip(bands, found, strict=True):
            in_band = [c for c in result.closest if shared_bits(c.long_id, own) == depth]
            if not in_band:
                return


async def announce(protocol: SwarmProtocol) -> None:
    """Ping every contact once more, now with its cookie, so that it takes us in.

    A node adds a sender to its routing table only once the sender proved its address (echoed
    a cookie, see :mod:`swarm.dht.cookies`); a joining node asks most nodes once, so without
    this the nodes that were there first may never learn of it (64 nodes: in 1 of 30 joins an
    early node knew nobody in a band where only later ones sat). A contact whose cookie we do
    not hold is left out: a ping without it would not be taken in either.
    """
    held = [c for c in protocol.router.contacts() if protocol.caller.holds_cookie(c.address)]
    await asyncio.gather(*(protocol.call(c, "ping") for c in held))


def shared_bits(a: int, b: int) -> int:
    """How many leading bits two 160-bit ids share."""
    return KEY_DIGEST_BYTES * 8 - (a ^ b).bit_length()
