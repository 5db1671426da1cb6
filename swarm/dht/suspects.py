"""Contacts that failed to answer (sans-I/O): skipped by lookups for a while, evicted after two
misses in a row, and the last few evicted remembered to rejoin through.

The paper evicts a contact that does not answer; one timeout on a busy host is no proof of
death, though, and a burst that overflows a UDP buffer must not empty the routing table, so a
contact is evicted after :data:`EVICT_AFTER_FAILURES` consecutive failures. The paper keeps
stale contacts when nothing replaces them; we drop them from the table (lookups must not wait
on them) but remember the last :data:`MAX_EVICTED` to rejoin through should the table empty.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from swarm.dht.routing import Contact, SwarmRoutingTable

logger = logging.getLogger(__name__)

EVICT_AFTER_FAILURES = 2
SUSPECT_FOR_S = 30.0  # a node that failed twice in a row is skipped by lookups this long
MAX_SUSPECTS = 4096
MAX_EVICTED = 64  # contacts evicted lately, kept to rejoin through should the table empty


class Suspects:
    """Failures in a row per contact, the suspects they made, and the contacts evicted lately.

    Args:
        router: the routing table a twice-failed contact is removed from.
    """

    def __init__(self, router: SwarmRoutingTable):
        self.router = router
        self._failures: dict[bytes, int] = {}
        self._since: dict[bytes, float] = {}  # node id -> monotonic time of last failure
        self.evicted: OrderedDict[bytes, Contact] = OrderedDict()

    def answered(self, node_id: bytes) -> None:
        """The node answered: its failures no longer count toward an eviction."""
        self._failures.pop(node_id, None)

    def welcomed(self, node_id: bytes) -> None:
        """The node was heard from (and enters the routing table): neither suspect nor evicted."""
        self._since.pop(node_id, None)
        self.evicted.pop(node_id, None)

    def is_suspect(self, node_id: bytes) -> bool:
        """Whether the node recently failed to answer (and has not been heard from since)."""
        failed_at = self._since.get(node_id)
        if failed_at is None:
            return False
        if time.monotonic() - failed_at > SUSPECT_FOR_S:
            del self._since[node_id]
            return False
        return True

    def failed(self, contact: Contact) -> None:
        """The contact did not answer in time; the second time in a row, evict it."""
        count = self._failures.get(contact.id, 0) + 1
        if count < EVICT_AFTER_FAILURES:
            if count == 1 and len(self._failures) >= MAX_SUSPECTS:  # contacts that never
                self._failures.pop(next(iter(self._failures)))  # answered again nor failed
            self._failures[contact.id] = count
            return
        # one timeout on a busy host is no proof of death: skipping the node in every lookup for
        # a minute after a single miss made stores and gets take different routes, and a get
        # could miss every holder of a key
        if len(self._since) >= MAX_SUSPECTS:
            self._since.pop(next(iter(self._since)))
        self._since[contact.id] = time.monotonic()
        self._failures.pop(contact.id, None)
        logger.debug("%s did not answer twice; removed from the routing table", contact)
        self.router.remove_contact(contact)
        self.evicted[contact.id] = contact
        self.evicted.move_to_end(contact.id)
        while len(self.evicted) > MAX_EVICTED:
            self.evicted.popitem(last=False)
