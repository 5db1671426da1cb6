"""Is a peer that keeps us waiting still there? One ping tells a killed process from a slow one.

A peer that dies mid-run leaves its record in the DHT until the record's TTL runs out, so the
group plans of every peer keep counting it: leaders wait for it to join, owners for its part.
When a planned member has not joined, or a member has not started sending, the averager asks
:class:`Liveness` to check it: one ``/ping`` to its address. A refused connection means nothing
listens there any more: the peer is **gone**, and nobody waits for it (nor plans with it, until
it signs a newer record). An answer, a timeout or any other failure proves nothing (a slow or
far peer is the stall policy's business), so they change nothing.

A forged refusal cannot make us drop a live peer on purpose from afar: it takes a TCP reset on
our own path to that peer, and then that peer is unreachable to us anyway.
"""

from __future__ import annotations

import asyncio
import logging

from swarm.errors import SwarmError, TransportError
from swarm.identity import PeerID
from swarm.net.record import PeerRecord
from swarm.protocols import Peer

logger = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 2.0  # a check that takes longer is given up (it proves nothing either way)
MAX_CHECKS = 64  # checks in flight at once: peers to check are a group's members, a handful


class Liveness:
    """Confirms suspected departures with one ping each (at most one check per peer at once).

    Args:
        peer: the started peer whose transport pings.
        timeout: seconds a check waits for the ping.

    Attributes:
        gone: peers whose address refused a connection since the owner last drained it.
    """

    def __init__(self, peer: Peer, *, timeout: float = CHECK_TIMEOUT_S):
        self.peer = peer
        self.timeout = timeout
        self.gone: set[PeerID] = set()
        self._checks: dict[PeerID, asyncio.Task[bool]] = {}

    def check(self, record: PeerRecord) -> asyncio.Future[bool]:
        """Start checking ``record``'s peer (or join the check in flight); the future's result
        is True when its address refused the connection."""
        peer_id = record.peer_id
        if peer_id in self.gone:
            return _done(True)
        task = self._checks.get(peer_id)
        if task is not None:
            return task
        if len(self._checks) >= MAX_CHECKS:
            return _done(False)
        task = asyncio.get_running_loop().create_task(self._ping(record), name="swarm-liveness")
        self._checks[peer_id] = task
        task.add_done_callback(lambda _: self._checks.pop(peer_id, None))
        return task

    def refused(self, peer_id: PeerID) -> None:
        """Record that ``peer_id``'s address refused a connection made elsewhere."""
        self.gone.add(peer_id)

    async def close(self) -> None:
        tasks = list(self._checks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _ping(self, record: PeerRecord) -> bool:
        try:
            await self.peer.transport.ping(record.address, timeout=self.timeout)
        except (SwarmError, OSError, asyncio.TimeoutError) as e:
            if isinstance(e, TransportError) and e.refused:
                logger.info("%s is gone: its address refuses connections", record.peer_id.short)
                self.gone.add(record.peer_id)
                return True
            logger.debug("liveness check of %s inconclusive: %s", record.peer_id.short, e)
        return False


def _done(value: bool) -> asyncio.Future[bool]:
    future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future
