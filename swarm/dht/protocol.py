"""The DHT wire protocol: kademlia's protocol class with authenticated, validated datagrams.

:class:`SwarmProtocol` extends :class:`kademlia.protocol.KademliaProtocol`. It takes datagrams
in, keeps the routing table and the tasks it starts, and hands each other job to its own part:

- every datagram is opened by :class:`~swarm.dht.envelope.DatagramAuth` (MAC or signature,
  membership, replay window) and every request body is checked
  (:mod:`swarm.dht.request_format`); junk is dropped and logged (rate-limited per source), it
  never raises out of the protocol;
- work per datagram is bounded, cheap checks first (see :mod:`swarm.dht.budgets`): a budget per
  source host and subnet (never per port) before anything is parsed, then the MAC, then a
  budget per host and subnet for public-key work (signatures, key agreement with an unseen
  sender, the entries of a store); entries a node already holds are not checked again;
- requests are answered by :class:`~swarm.dht.answers.Responder` (the RPC handlers, cookies,
  answers no larger than the request of an unproved source);
- our requests and their answers go through :class:`~swarm.dht.calls.Caller` (waits from the
  RTT estimate of :mod:`swarm.dht.rtt`, cookies echoed, contacts that fail counted by
  :class:`~swarm.dht.suspects.Suspects` and evicted after two failures in a row, not one);
- newcomers get their records from :class:`~swarm.dht.replication.Replicator`;
- a *client* node (``client=True``: a one-shot ``swarm-peer peers`` listing, say) flags its
  requests so that nobody adds it to a routing table: it would be a dead contact a moment later;
- every task the protocol starts is tracked and cancelled on close.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Coroutine
from typing import Any

from kademlia.protocol import KademliaProtocol

from swarm.dht.answers import FULL_ROOM, Responder
from swarm.dht.budgets import (
    DATAGRAM_BURST,
    DATAGRAM_RATE,
    SUBNET_SHARE,
    VERIFY_BURST,
    VERIFY_RATE,
    HostBuckets,
)
from swarm.dht.calls import Caller
from swarm.dht.envelope import MAX_REQUEST_BYTES, REQUEST, RESPONSE, DatagramAuth
from swarm.dht.records import DHTEntry, RecordStorage
from swarm.dht.replication import Replicator
from swarm.dht.request_format import parse_request
from swarm.dht.routing import Contact, SwarmRoutingTable
from swarm.dht.rtt import RttEstimator
from swarm.dht.store_intake import StoreIntake
from swarm.dht.suspects import Suspects
from swarm.errors import AuthError, DHTError
from swarm.refusal_log import RateLimitedWarning

logger = logging.getLogger(__name__)


class SwarmProtocol(KademliaProtocol):
    """One node's end of the DHT protocol (an asyncio datagram protocol).

    Args:
        source: this node as a contact (its id, keys and announced address).
        storage: the node's record storage.
        ksize: k from the paper: bucket size and replication factor.
        auth: seals and opens datagrams.
        request_timeout: the longest wait for an answer before a call counts as failed.
        client: only ask, never join others' routing tables.
    """

    def __init__(
        self,
        source: Contact,
        storage: RecordStorage,
        ksize: int,
        auth: DatagramAuth,
        request_timeout: float,
        client: bool = False,
    ):
        super().__init__(source, storage, ksize)
        self.router = SwarmRoutingTable(self, ksize, source)
        self.auth = auth
        self.request_timeout = request_timeout
        self.datagram_budget = HostBuckets(DATAGRAM_RATE, DATAGRAM_BURST, SUBNET_SHARE)
        self.verify_budget = HostBuckets(VERIFY_RATE, VERIFY_BURST, SUBNET_SHARE)
        self.intake = StoreIntake(storage, self.verify_budget, auth)
        self._refusals = RateLimitedWarning(logger)
        self.rtt = RttEstimator.for_timeout(request_timeout)
        self.suspects = Suspects(self.router)
        self.caller = Caller(auth, self._send, self.rtt, self.suspects, self.welcome_if_new, client)
        self.responder = Responder(
            auth, self.router, storage, self.intake, self.welcome_if_new, self._send, self._refusals
        )
        self.replicator = Replicator(
            storage, self.router, source, self.spawn, self.caller.send_entries
        )
        self._tasks: set[asyncio.Task[Any]] = set()
        self.closed = False

    def __getattr__(self, name: str) -> Any:
        # rpcudp turns unknown attributes into remote calls; a typo must be an error here
        raise AttributeError(name)

    @property
    def client(self) -> bool:
        """Whether our requests ask others to leave us out of their routing tables."""
        return self.caller.client

    @client.setter
    def client(self, client: bool) -> None:
        self.caller.client = client

    # ---- datagrams in

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        if self.closed:
            return
        if not self.datagram_budget.take(addr[0]):  # per host and subnet, never per port
            self._refusals.warn(addr[0], "DHT datagrams from %s over its host's rate", addr[0])
            return
        source = f"{addr[0]}:{addr[1]}"
        try:
            msg = self.auth.open(data, lambda: self.verify_budget.take(addr[0]))
            request = None
            if msg.kind == REQUEST:
                if len(data) > MAX_REQUEST_BYTES:
                    raise DHTError(f"request of {len(data)} bytes exceeds {MAX_REQUEST_BYTES}")
                request = parse_request(msg.body)
                if not msg.targeted and request.method != "ping":
                    raise AuthError(f"an untargeted datagram may only ping, not {request.method}")
        except (DHTError, AuthError) as e:
            self._refusals.warn(source, "dropped a DHT datagram from %s: %s", source, e)
            return
        sender = Contact(msg.sender, addr[0], addr[1])
        if msg.kind == RESPONSE:
            self.caller.accept_answer(msg.msg_id, sender, msg.body)
        elif request is not None:
            if request.client:
                sender.client = True
            self.responder.answer(msg.msg_id, sender, request, msg.targeted, len(data))

    def error_received(self, exc: Exception) -> None:
        logger.debug("DHT socket error: %s", exc)

    def _send(self, address: tuple[str, int], datagram: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.sendto(datagram, address)

    # ---- the RPC handlers: kademlia's base class finds them by name (``rpc_<method>``), so
    # these shadow its own, which trust any sender, with the responder's

    def rpc_ping(self, sender: Contact, verified: bool) -> Any:
        return self.responder.rpc_ping(sender, verified)

    def rpc_store(self, sender: Contact, verified: bool, key: Any, entries: Any) -> Any:
        return self.responder.rpc_store(sender, verified, key, entries)

    def rpc_find_node(
        self, sender: Contact, verified: bool, target: Any, *, room: int = FULL_ROOM
    ) -> Any:
        return self.responder.rpc_find_node(sender, verified, target, room=room)

    def rpc_find_value(
        self,
        sender: Contact,
        verified: bool,
        key: Any,
        cursor: Any = None,
        *,
        room: int = FULL_ROOM,
    ) -> Any:
        return self.responder.rpc_find_value(sender, verified, key, cursor, room=room)

    # ---- calls out (see Caller): the answer's body, or None when it did not come in time

    async def call(self, contact: Contact, method: str, *args: Any) -> Any | None:
        """Send a request to a known contact; None on timeout, else the answer's body."""
        return await self.caller.call(contact, method, *args)

    async def ping_address(self, address: tuple[str, int]) -> Contact | None:
        """Ping a bare ``(ip, port)`` whose keys we do not know yet (first contact)."""
        return await self.caller.ping_address(address)

    async def send_entries(self, contact: Contact, key: bytes, entries: list[DHTEntry]) -> int:
        """Store ``entries`` on ``contact``; how many it took (-1 when it did not answer)."""
        return await self.caller.send_entries(contact, key, entries)

    @property
    def stall_after(self) -> float:
        """Seconds after which an unanswered request no longer holds up a lookup."""
        return self.rtt.stall_after

    def is_suspect(self, node_id: bytes) -> bool:
        """Whether the node recently failed to answer (and has not been heard from since)."""
        return self.suspects.is_suspect(node_id)

    @property
    def evicted(self) -> OrderedDict[bytes, Contact]:
        """Contacts evicted lately, oldest first: to rejoin through should the table empty."""
        return self.suspects.evicted

    def check_alive(self, contact: Contact) -> None:
        """Ping a bucket's head in the background (kademlia section 2.2)."""
        self.spawn(self.call(contact, "ping"))

    # ---- routing-table upkeep

    def welcome_if_new(self, node: Contact) -> None:
        """Add ``node`` to the routing table; when it is new, hand it the records it should hold
        (kademlia section 2.5, see :mod:`swarm.dht.replication`)."""
        if node.id == self.source_node.id or node.client:
            return
        self.suspects.welcomed(node.id)
        is_new = self.router.is_new_node(node)
        self.router.add_contact(node)  # for a known node: refreshes its position and address
        if not is_new:
            return
        logger.debug("new DHT contact %s", node)
        self.replicator.welcome(node)

    def counters(self) -> dict[str, int]:
        """What was refused or dropped so far, by cause (for logs and metrics)."""
        return {
            "datagrams_over_rate": self.datagram_budget.refused,
            "public_key_work_over_budget": self.verify_budget.refused,
            "signatures_checked": self.intake.signatures_checked,
            "forged_stores": self.intake.forgeries,
            "stores_refused_unchecked": self.intake.refused_unchecked,
            "new_slots_over_rate": self.intake.slot_budget.refused,
            "answers_cut_to_request_size": self.responder.cut_to_request_size,
            "entries_over_quota": self.storage.refused,
            "entries_evicted": self.storage.evicted,
            "replication_queue": self.replicator.queued,
        }

    # ---- task bookkeeping

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any] | None:
        """Run ``coro`` as a task that :meth:`close` cancels; None once closed."""
        if self.closed:
            coro.close()
            return None
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("DHT background task failed: %r", task.exception())

    async def close(self) -> None:
        self.closed = True
        self.caller.cancel_all()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.transport is not None:
            self.transport.close()
