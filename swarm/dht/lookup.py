"""Iterative node lookup (kademlia section 2.3) that really ends at the k closest nodes.

Unlike kademlia 2.2.3's ``SpiderCrawl``, the lookup keeps ``alpha`` requests in flight at all
times (a slow node does not hold up a whole round of requests), only ends when each of the k
closest contacts it knows has answered or failed, and, for a value lookup, collects the entries
of every node it asks instead of stopping at the first one that has any: records are
dictionaries merged from several nodes, not single values to vote on.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from swarm.dht.protocol import SwarmProtocol
from swarm.dht.records import DHTEntry
from swarm.dht.routing import Contact
from swarm.errors import DHTError

logger = logging.getLogger(__name__)


@dataclass
class LookupResult:
    """What one lookup found."""

    closest: list[Contact]  # the k closest nodes that answered, closest first
    entries: list[DHTEntry] = field(default_factory=list)  # unverified, possibly duplicated
    asked: int = 0  # requests sent
    failed: int = 0  # requests that got no answer
    truncated: bool = False  # some node held more entries than one datagram carries


async def lookup(
    protocol: SwarmProtocol,
    target: bytes,
    *,
    ksize: int,
    alpha: int,
    value: bool = False,
) -> LookupResult:
    """Find the ``ksize`` nodes closest to ``target``; with ``value``, also their entries.

    Args:
        protocol: the node's protocol (its routing table seeds the lookup).
        target: a 20-byte node id or key digest.
        ksize: how many closest nodes to find.
        alpha: requests in flight at once.
        value: send ``find_value`` (collect entries) instead of ``find_node``.
    """
    goal = int.from_bytes(target, "big")
    own_id = protocol.source_node.id
    known: dict[bytes, Contact] = {c.id: c for c in protocol.router.closest(target, ksize)}
    answered: set[bytes] = set()
    failed: set[bytes] = set()
    queried: set[bytes] = set()
    in_flight: dict[asyncio.Task[Any], Contact] = {}
    result = LookupResult(closest=[])
    method = "find_value" if value else "find_node"

    def ranked() -> list[Contact]:
        live = [c for c in known.values() if c.id not in failed]
        return sorted(live, key=lambda c: c.long_id ^ goal)[:ksize]

    try:
        while True:
            for contact in ranked():
                if len(in_flight) >= alpha:
                    break
                if contact.id in queried:
                    continue
                queried.add(contact.id)
                task = asyncio.ensure_future(protocol.call(contact, method, target))
                in_flight[task] = contact
                result.asked += 1
            if not in_flight:
                break
            done, _ = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                contact = in_flight.pop(task)
                body = task.result()
                if not isinstance(body, dict) or "error" in body:
                    failed.add(contact.id)
                    result.failed += 1
                    continue
                answered.add(contact.id)
                for found in _contacts(body.get("nodes")):
                    if found.id != own_id and found.id not in known:
                        known[found.id] = found
                if value:
                    _collect(body, target, result)
    finally:
        for task in in_flight:
            task.cancel()
        if in_flight:
            await asyncio.gather(*in_flight, return_exceptions=True)
    result.closest = [c for c in ranked() if c.id in answered]
    return result


def _contacts(nodes: Any) -> list[Contact]:
    if not isinstance(nodes, list):
        return []
    found = []
    for obj in nodes[:64]:
        try:
            found.append(Contact.from_wire(obj))
        except DHTError as e:
            logger.debug("ignoring a malformed contact in an answer: %s", e)
    return found


def _collect(body: dict[str, Any], key: bytes, result: LookupResult) -> None:
    entries = body.get("entries")
    if not isinstance(entries, list):
        return
    if body.get("truncated") is True:
        result.truncated = True
    for obj in entries:
        try:
            result.entries.append(DHTEntry.from_wire(key, obj))
        except DHTError as e:
            logger.debug("ignoring a malformed entry in an answer: %s", e)
