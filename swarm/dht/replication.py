"""Replication to newcomers (kademlia section 2.5): hand a new node the records it should hold.

For each stored key, if the new node is among the k closest to the key and we are closer than
any other contact we know, we send it our entries for that key. Newcomers are handled in
batches, off the path of the answer that met them, and the stores go out of one bounded queue at
:data:`REPLICATION_RATE`, not as a task per key.

kademlia 2.2.3 looked up the key's neighbours with the key hashed a second time (its
``digest(key)`` of an already-digested key), sending records to the wrong nodes; here the stored
digest is used as is.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

from swarm.dht.records import DHTEntry, RecordStorage
from swarm.dht.routing import Contact, SwarmRoutingTable

REPLICATE_BATCH_S = 0.5  # newcomers met within this long get their records in one pass
REPLICATION_QUEUE = 4096  # (newcomer, key) pairs waiting; past this, the oldest are dropped
REPLICATION_RATE = 200.0  # replication stores sent per second, at most
REPLICATION_IN_FLIGHT = 8

Spawn = Callable[[Coroutine[Any, Any, Any]], "asyncio.Task[Any] | None"]
SendEntries = Callable[[Contact, bytes, list[DHTEntry]], Coroutine[Any, Any, int]]


class Replicator:
    """Sends newcomers the records they should hold, in batches and at a bounded rate.

    Args:
        storage: the records we hold.
        router: the routing table (who else is close to a key).
        source: this node as a contact.
        spawn: runs a task that the node cancels on close (None once closed).
        send_entries: stores entries on a contact.
    """

    def __init__(
        self,
        storage: RecordStorage,
        router: SwarmRoutingTable,
        source: Contact,
        spawn: Spawn,
        send_entries: SendEntries,
    ):
        self.storage = storage
        self.router = router
        self.source = source
        self._spawn = spawn
        self._send_entries = send_entries
        self._newcomers: dict[bytes, Contact] = {}
        self._batch: asyncio.Task[Any] | None = None  # sorts the newcomers' keys out
        self._queue: deque[tuple[Contact, bytes]] = deque(maxlen=REPLICATION_QUEUE)
        self._worker: asyncio.Task[Any] | None = None  # sends the queued stores

    @property
    def queued(self) -> int:
        """(newcomer, key) pairs waiting to be sent."""
        return len(self._queue)

    def welcome(self, node: Contact) -> None:
        """``node`` just entered the routing table: send it its records soon."""
        if len(self.storage) == 0:
            return
        self._newcomers[node.id] = node
        if self._batch is None or self._batch.done():
            self._batch = self._spawn(self._sort_out_newcomers())

    async def _sort_out_newcomers(self) -> None:
        await asyncio.sleep(REPLICATE_BATCH_S)
        newcomers, self._newcomers = self._newcomers, {}
        ksize = self.router.ksize
        own = self.source.long_id
        for key in self.storage.keys():  # noqa: SIM118 (iterating yields entries too)
            goal = int.from_bytes(key, "big")
            before = self.router.closest(key, ksize, exclude=newcomers.keys())
            if before and (own ^ goal) > (before[0].long_id ^ goal):
                continue  # a closer node than us replicates this key
            furthest = before[-1].long_id ^ goal if len(before) >= ksize else None
            for node in newcomers.values():
                if furthest is None or (node.long_id ^ goal) < furthest:
                    self._queue.append((node, key))  # bounded: the oldest fall off
            await asyncio.sleep(0)  # many keys: let answers through between them
        if self._queue and (self._worker is None or self._worker.done()):
            self._worker = self._spawn(self._send_queued())

    async def _send_queued(self) -> None:
        """Send queued replication stores, at most ``REPLICATION_RATE`` per second and
        ``REPLICATION_IN_FLIGHT`` at once, so a newcomer never costs a burst of work."""
        slots = asyncio.Semaphore(REPLICATION_IN_FLIGHT)

        async def one(node: Contact, key: bytes) -> None:
            try:
                entries = self.storage.entries(key)  # as they are now, not when queued
                if entries:
                    await self._send_entries(node, key, entries)
            finally:
                slots.release()

        while self._queue:
            node, key = self._queue.popleft()
            await slots.acquire()
            self._spawn(one(node, key))
            await asyncio.sleep(1.0 / REPLICATION_RATE)
