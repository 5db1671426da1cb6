"""Iterative node lookup (kademlia section 2.3) that really ends at the k closest nodes.

Unlike kademlia 2.2.3's ``SpiderCrawl``, the lookup keeps ``alpha`` requests in flight at all
times (a slow node does not hold up a whole round of requests), only ends when each of the k
closest contacts it knows has answered or failed, and, for a value lookup, collects the entries
of every node it asks instead of stopping at the first one that has any: records are
dictionaries merged from several nodes, not single values to vote on. Once one holder answered,
the lookup is among the key's holders and asks every holder it still needs at once.

A node meeting us for the first time answers no more bytes than we sent (see the protocol's
cookies), so its list of contacts may be cut. Once every contact among the k closest has been
asked, those whose answers were cut are asked again, all at once (they answered moments ago, and
now hold our cookie): the lookup still ends at the true k closest.

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
    goal = int.from_bytes(target, "big")
    own_id = protocol.source_node.id
    known: dict[bytes, Contact] = {c.id: c for c in protocol.router.closest(target, ksize)}
    # answers repeat contacts (and us): each is parsed once
    known_keys = {_keys_of(c) for c in (*known.values(), protocol.source_node)}
    answered: set[bytes] = set()
    cut: set[bytes] = set()  # answered with part of their contacts: to ask again at the end
    asked_again: set[bytes] = set()
    failed: set[bytes] = set()
    queried: set[bytes] = set()
    in_flight: dict[asyncio.Task[Any], tuple[Contact, float]] = {}  # task -> (contact, sent)
    stalled: set[asyncio.Task[Any]] = set()
    result = LookupResult(closest=[])
    holding = 0
    method = "find_value" if value else "find_node"
    loop = asyncio.get_running_loop()

    def ranked() -> list[Contact]:
        # a node asked again after it answered (its answer was cut) stays a result meanwhile
        waiting = {in_flight[t][0].id for t in stalled} - answered
        live = [c for c in known.values() if c.id not in failed and c.id not in waiting]
        return sorted(live, key=lambda c: c.long_id ^ goal)[:ksize]

    def ask(contact: Contact) -> bool:
        task = protocol.spawn(protocol.call(contact, method, target))
        if task is None:  # the node is closing
            return False
        in_flight[task] = (contact, loop.time())
        result.asked += 1
        return True

    while True:
        closest = ranked()
        # once a holder answered, the lookup is among the key's holders: ask all the holders
        # still missing at once rather than alpha at a time (a round trip less per get)
        width = max(alpha, holders - holding) if holders is not None and holding else alpha
        for contact in closest:
            if len(in_flight) - len(stalled) >= width:
                break
            if contact.id in queried:
                continue
            queried.add(contact.id)
            if skip_suspects and protocol.is_suspect(contact.id):
                failed.add(contact.id)  # failed moments ago: do not wait for it again
                continue
            if not ask(contact):
                break
        if len(in_flight) == len(stalled) and all(c.id in queried for c in closest):
            for contact in closest:  # once each: a node that always cuts is not asked forever
                if contact.id in cut and contact.id not in asked_again:
                    asked_again.add(contact.id)
                    ask(contact)
        active = [t for t in in_flight if t not in stalled]
        if not active:
            # nothing left to ask; but a stalled request to a node closer than any that answered
            # may be a slow node, not a dead one, and the only way into the target's region: on
            # a busy host, ending without it put stores and gets in different places. Wait for
            # those a little longer, counted from when each was asked: a dead node must not cost
            # a full timeout, nor a fresh wait once the rest of the lookup is done. Requests to
            # nodes that answered moments ago (cut answers asked again) and, until anyone
            # answered, all requests are waited for until their own timeout: the former are
            # alive and hold the ranks a cut answer hid, and without the latter the lookup has
            # nothing to end with (on a busy host, both ended lookups with a few or no nodes).
            best = min((c.long_id ^ goal for c in known.values() if c.id in answered), default=None)
            patient = [t for t in stalled if best is None or in_flight[t][0].id in answered]
            closer = [
                t for t in stalled if t not in patient and in_flight[t][0].long_id ^ goal < best
            ]
            wait_s = None
            if not patient:
                if not closer:
                    break
                last_sent = max(in_flight[t][1] for t in closer)
                wait_s = last_sent + STALL_GRACE * protocol.stall_after - loop.time()
                if wait_s <= 0:
                    break
            done, _ = await asyncio.wait(
                patient + closer, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                break
        else:
            # wake on an answer, or when the oldest active request stalls: a dead node then
            # stops holding up the lookup, while its request runs on to count the failure
            oldest = min(in_flight[t][1] for t in active)
            wait_s = max(0.0, oldest + protocol.stall_after - loop.time())
            done, _ = await asyncio.wait(
                active, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED
            )
        now = loop.time()
        for task in active:
            if task not in done and now - in_flight[task][1] >= protocol.stall_after:
                stalled.add(task)
        for task in [t for t in in_flight if t.done()]:
            contact, _ = in_flight.pop(task)
            stalled.discard(task)
            body = None if task.cancelled() else task.result()
            if not isinstance(body, dict) or "error" in body:
                failed.add(contact.id)
                result.failed += 1
                continue
            answered.add(contact.id)
            if body.get("cut") is True:
                cut.add(contact.id)
            for found in _contacts(body.get("nodes"), known_keys):
                if found.id != own_id and found.id not in known:
                    known[found.id] = found
                    known_keys.add(_keys_of(found))
            if value and _collect(body, target, result, contact.id):
                holding += 1
                cursor = _cursor(body.get("next"))
                if cursor is not None:
                    result.more.append((contact, cursor))
        if holders is not None and holding >= holders:
            break
    result.closest = [c for c in ranked() if c.id in answered]
    return result


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


def shared_bits(a: int, b: int) -> int:
    """How many leading bits two 160-bit ids share."""
    return KEY_DIGEST_BYTES * 8 - (a ^ b).bit_length()
