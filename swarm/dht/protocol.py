"""The DHT wire protocol: kademlia's protocol class with authenticated, validated datagrams.

:class:`SwarmProtocol` extends :class:`kademlia.protocol.KademliaProtocol`. It keeps the paper's
RPCs and routing-table upkeep and changes what kademlia 2.2.3 gets wrong for us:

- every datagram is opened by :class:`~swarm.dht.envelope.DatagramAuth` (MAC or signature,
  membership, replay window) and every argument is type- and size-checked; junk is dropped and
  logged (rate-limited per source), it never raises out of the protocol;
- ``store`` merges owner-signed dictionary entries (see :mod:`swarm.dht.intake`: budgets per
  host and subnet, signatures checked in order up to the first forged one, which the source pays
  for); ``find_value`` answers with the entries it holds *and* the closest contacts, so a reader
  can merge what several nodes hold instead of stopping at the first answer;
- replication to a newly seen node looked up the key's neighbours with the key hashed a second
  time (kademlia's ``digest(key)`` of an already-digested key), sending records to the wrong
  nodes; here the stored digest is used as is;
- a contact is evicted after two consecutive failures, not one (a burst that overflows a UDP
  buffer must not empty the routing table), and every task the protocol starts is tracked and
  cancelled on close;
- a request waits for an answer as long as recent answers suggest (smoothed RTT plus four
  deviations, as TCP does, between ``MIN_TIMEOUT_S`` and ``request_timeout``), so a dead node
  stalls a lookup for about a second on a fast network instead of the full timeout;
- a *client* node (``client=True``: a one-shot ``swarm-peer peers`` listing, say) flags its
  requests so that nobody adds it to a routing table: it would be a dead contact a moment later;
- work per datagram is bounded, cheap checks first (see :mod:`swarm.dht.limits`): a budget per
  source host and subnet (never per port) before anything is parsed, then the MAC, then a
  budget per host and subnet for public-key work (signatures, key agreement with an unseen
  sender, the entries of a store, at most ``MAX_ENTRIES_PER_STORE`` of them); entries a node
  already holds are not checked again;
- answers carry a return-routability cookie; a request without a valid one gets an answer no
  larger than itself (BEP 42, DNS cookies), and only a sender that echoed one enters the routing
  table, so a spoofed source or a replayed first-contact ping cannot use us. A first-contact
  lookup request is padded to ``FIRST_CONTACT_LOOKUP_BYTES`` and its answer is cut to fit (the
  entries first, then the closest contacts), so a lookup meeting new nodes does not pay a
  round trip per node for the cookie;
- ``find_value`` answers one fair page (at most one entry per owner, owners round-robin over
  the subnets and hosts that stored them, see :mod:`swarm.dht.listing`) with a ``next`` cursor
  and each entry's witnessed age, so neither one owner's many entries nor many identities of
  one host crowd the others out of an answer;
- replication to newcomers is one bounded queue sent at ``REPLICATION_RATE``, not a task per key.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Coroutine, Iterable
from typing import Any

import msgpack
from kademlia.protocol import KademliaProtocol

from swarm.auth import RateLimitedWarning
from swarm.dht.envelope import (
    MAX_REQUEST_BYTES,
    MSG_ID_BYTES,
    REQUEST,
    RESPONSE,
    DatagramAuth,
    SenderKeys,
)
from swarm.dht.intake import MAX_ENTRIES_PER_STORE, StoreIntake
from swarm.dht.limits import (
    DATAGRAM_BURST,
    DATAGRAM_RATE,
    SUBNET_SHARE,
    VERIFY_BURST,
    VERIFY_RATE,
    Cookies,
    HostBuckets,
)
from swarm.dht.pages import answer_page, parse_cursor
from swarm.dht.records import KEY_DIGEST_BYTES, DHTEntry, RecordStorage
from swarm.dht.routing import Contact, SwarmRoutingTable
from swarm.errors import AuthError, DHTError

logger = logging.getLogger(__name__)

MAX_RESPONSE_BYTES = 60_000  # UDP carries up to 65,507; keep room for the envelope
EVICT_AFTER_FAILURES = 2
MIN_TIMEOUT_S = 1.0
MIN_STALL_S = 0.01  # srtt + 4 rttvar, at least this: on a LAN a dead node costs a lookup ~10 ms
RTT_MEMORY_S = 10.0  # an RTT estimate this old restarts from the next sample
SUSPECT_FOR_S = 30.0  # a node that failed twice in a row is skipped by lookups this long
_MAX_SUSPECTS = 4096
MAX_EVICTED = 64  # contacts evicted lately, kept to rejoin through should the table empty
REPLICATE_BATCH_S = 0.5  # newcomers met within this long get their records in one pass
REPLICATION_QUEUE = 4096  # (newcomer, key) pairs waiting; past this, the oldest are dropped
REPLICATION_RATE = 200.0  # replication stores sent per second, at most
REPLICATION_IN_FLIGHT = 8
MAX_PAGES_PER_GET = 8  # answer pages a reader follows per holder
_ENVELOPE_OVERHEAD = 400
_COOKIE_CACHE = 8192
COOKIE_PAD_BYTES = 96  # padding of a request without a cookie (see _request_once)
# a lookup request without a cookie is padded to this size, so that the answer to it may hold
# k = 20 contacts (3.3 KB) and is not cut to a few; the answer brings the cookie for the rest
FIRST_CONTACT_LOOKUP_BYTES = 3584
MAX_PADDING_BYTES = FIRST_CONTACT_LOOKUP_BYTES
_METHODS = ("ping", "store", "find_node", "find_value")
_LOOKUPS = ("find_node", "find_value")
_FULL_ROOM = MAX_RESPONSE_BYTES - _ENVELOPE_OVERHEAD  # room in an answer to a proved source
_ROOM_SLACK = 16  # msgpack headers that grow with a list's length
_LIST_HEADER = 3  # a msgpack array header, at most (up to 65,535 items)


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
        self.client = client
        self._rtt = RttEstimator(min(MIN_TIMEOUT_S, request_timeout), request_timeout)
        self._pending: dict[bytes, tuple[asyncio.Future[Any], Any]] = {}
        self._failures: dict[bytes, int] = {}
        self._suspects: dict[bytes, float] = {}  # node id -> monotonic time of last failure
        # the paper keeps stale contacts when nothing replaces them; we drop them from the table
        # (lookups must not wait on them) but remember the last few to rejoin through
        self.evicted: OrderedDict[bytes, Contact] = OrderedDict()
        self._newcomers: dict[bytes, Contact] = {}
        self._replicator: asyncio.Task[Any] | None = None  # sends newcomers their records
        self._replication: deque[tuple[Contact, bytes]] = deque(maxlen=REPLICATION_QUEUE)
        self._replication_worker: asyncio.Task[Any] | None = None
        self.datagram_budget = HostBuckets(DATAGRAM_RATE, DATAGRAM_BURST, SUBNET_SHARE)
        self.verify_budget = HostBuckets(VERIFY_RATE, VERIFY_BURST, SUBNET_SHARE)
        self.intake = StoreIntake(storage, self.verify_budget, auth)
        self.cookies = Cookies()
        # cookies others gave us, by their address: echoed in our requests to them
        self._cookies_held: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self.refused_amplification = 0  # answers cut down to the request's size
        self._tasks: set[asyncio.Task[Any]] = set()
        self._refusals = RateLimitedWarning(logger)
        self.closed = False

    def __getattr__(self, name: str) -> Any:
        # rpcudp turns unknown attributes into remote calls; a typo must be an error here
        raise AttributeError(name)

    # ---- datagrams in

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        if self.closed:
            return
        address = (addr[0], addr[1])
        if not self.datagram_budget.take(addr[0]):  # per host and subnet, never per port
            self._refusals.warn(addr[0], "DHT datagrams from %s over its host's rate", addr[0])
            return
        source = f"{addr[0]}:{addr[1]}"
        try:
            msg = self.auth.open(data, lambda: self.verify_budget.take(addr[0]))
            if msg.kind == REQUEST:
                if len(data) > MAX_REQUEST_BYTES:
                    raise DHTError(f"request of {len(data)} bytes exceeds {MAX_REQUEST_BYTES}")
                method, args, from_client, cookie = _parse_request(msg.body)
                if not msg.targeted and method != "ping":
                    raise AuthError(f"an untargeted datagram may only ping, not {method}")
            else:
                method, args, from_client, cookie = "", [], False, None
        except (DHTError, AuthError) as e:
            self._refusals.warn(source, "dropped a DHT datagram from %s: %s", source, e)
            return
        sender = Contact(msg.sender, addr[0], addr[1])
        if msg.kind == RESPONSE:
            self._accept_answer(msg.msg_id, sender, msg.body)
        else:
            if from_client:
                sender.client = True
            # a first-contact ping (untargeted) never proves the address: a captured one
            # replayed to another node gets a cookie back and files nobody
            verified = msg.targeted and self.cookies.check(cookie, address, msg.sender.public_key)
            self._answer(msg.msg_id, sender, method, args, verified, len(data))

    def error_received(self, exc: Exception) -> None:
        logger.debug("DHT socket error: %s", exc)

    def _answer(
        self,
        msg_id: bytes,
        sender: Contact,
        method: str,
        args: list[Any],
        verified: bool,
        request_bytes: int,
    ) -> None:
        source = f"{sender.ip}:{sender.port}"
        cookie = b"" if verified else self.cookies.issue(sender.address, sender.keys.public_key)
        kwargs: dict[str, int] = {}
        if not verified and method in _LOOKUPS:
            # BEP 42 / DNS cookies: an unproved source gets no more bytes than it sent; lookups
            # cut their answer to what is left of that after the envelope and the cookie
            bare = self.auth.seal(RESPONSE, msg_id, _skeleton(method, cookie), sender.keys)
            kwargs["room"] = request_bytes - len(bare) - _ROOM_SLACK
        try:
            result = getattr(self, f"rpc_{method}")(sender, verified, *args, **kwargs)
        except (DHTError, AuthError, TypeError) as e:
            self._refusals.warn(source, "refused a DHT %s from %s: %s", method, source, e)
            result = {"error": str(e)[:200]}
        if not verified:
            result["cookie"] = cookie
        datagram = self.auth.seal(RESPONSE, msg_id, result, sender.keys)
        if not verified and len(datagram) > request_bytes:
            self.refused_amplification += 1
            small = {"cookie": cookie, "retry": True}
            datagram = self.auth.seal(RESPONSE, msg_id, small, sender.keys)
            if len(datagram) > request_bytes:
                return
        self._send(sender.address, datagram)

    def _accept_answer(self, msg_id: bytes, sender: Contact, body: Any) -> None:
        pending = self._pending.get(msg_id)
        if pending is None:
            logger.debug("unexpected DHT answer from %s (late or unknown)", sender)
            return
        future, expected = pending
        if isinstance(expected, SenderKeys):
            if expected.public_key != sender.keys.public_key:
                logger.debug("DHT answer from another node than asked; ignored")
                return
        elif tuple(expected) != sender.address:
            logger.debug("DHT answer from another address than asked; ignored")
            return
        del self._pending[msg_id]
        if not future.done():
            future.set_result((sender, body))

    # ---- RPC handlers (sender is authenticated; arguments are not yet checked)

    def rpc_ping(self, sender: Contact, verified: bool) -> Any:
        if verified:
            self.welcome_if_new(sender)
        return {"pong": True}

    def rpc_store(self, sender: Contact, verified: bool, key: Any, entries: Any) -> Any:
        _check_key(key)
        refused = self.storage.refused
        stored = self.intake.admit(sender.ip, sender.keys, key, entries)
        if self.storage.refused > refused:
            source = f"{sender.ip}:{sender.port}"
            self._refusals.warn(
                source,
                "DHT storage quota: refused %d entries from %s",
                self.storage.refused - refused,
                source,
            )
        if verified:
            self.welcome_if_new(sender)
        return {"stored": stored}

    def rpc_find_node(
        self, sender: Contact, verified: bool, target: Any, *, room: int = _FULL_ROOM
    ) -> Any:
        """The closest contacts to ``target`` that fit in ``room`` bytes, closest first."""
        _check_key(target)
        if verified:
            self.welcome_if_new(sender)
        neighbours = self._neighbours(target, sender)
        nodes = neighbours[: _fitting(neighbours.sizes, room)]
        return {"nodes": nodes, "cut": True} if len(nodes) < len(neighbours) else {"nodes": nodes}

    def rpc_find_value(
        self,
        sender: Contact,
        verified: bool,
        key: Any,
        cursor: Any = None,
        *,
        room: int = _FULL_ROOM,
    ) -> Any:
        """Entries of ``key`` one fair page at a time (see :meth:`RecordStorage.fair_order`).

        ``cursor`` is ``[round, index]`` from a previous answer's ``next`` (None: the first
        page, which also carries the closest contacts). In ``room`` bytes, the contacts get up to
        half, the entries what is left, and the contacts again whatever the entries did not use.
        """
        _check_key(key)
        start_round, start = parse_cursor(cursor)
        if verified:
            self.welcome_if_new(sender)
        neighbours = self._neighbours(key, sender) if cursor is None else _Packed()
        held_back = sum(neighbours.sizes[: _fitting(neighbours.sizes, room // 2)])
        page = answer_page(
            self.storage, key, start_round, start, room - held_back - 3 * _LIST_HEADER
        )
        nodes = neighbours[: _fitting(neighbours.sizes, room - 2 * _LIST_HEADER - page.used)]
        answer: dict[str, Any] = {
            "nodes": nodes,
            "entries": page.entries,
            "ages": page.ages,  # each entry's witnessed age here, whole seconds
            "next": page.next,
            "truncated": page.next is not None,
        }
        if len(nodes) < len(neighbours):
            answer["cut"] = True  # more contacts than fitted: a lookup may ask again
        if not verified and not page.entries and page.next is not None:
            answer["retry"] = True  # not even one entry fitted: ask again with the cookie
        return answer

    def _neighbours(self, target: bytes, sender: Contact) -> _Packed:
        found = self.router.closest(target, self.router.ksize, exclude=(sender.id,))
        return _Packed(c.to_wire() for c in found)

    # ---- calls out: (contact, answer) or None when it did not answer in time

    async def call(self, contact: Contact, method: str, *args: Any) -> Any | None:
        """Send a request to a known contact; None on timeout, else the answer's body."""
        answer = await self._request(contact.address, contact.keys, method, list(args))
        if answer is None:
            self._failed(contact)
            return None
        responder, body = answer
        self._failures.pop(responder.id, None)
        self.welcome_if_new(responder)
        return body

    async def ping_address(self, address: tuple[str, int]) -> Contact | None:
        """Ping a bare ``(ip, port)`` whose keys we do not know yet (first contact)."""
        answer = await self._request(address, None, "ping", [])
        if answer is None:
            return None
        responder, _ = answer
        self.welcome_if_new(responder)
        return responder

    async def _request(
        self, address: tuple[str, int], target: SenderKeys | None, method: str, args: list[Any]
    ) -> tuple[Contact, Any] | None:
        """One request; when the answer is only a cookie (our address was not proved yet and
        nothing useful fitted in the request's size), the request is sent once more with it."""
        for _ in range(2):
            answer = await self._request_once(address, target, method, args)
            if answer is None:
                return None
            responder, body = answer
            if isinstance(body, dict) and "cookie" in body:
                cookie = body.pop("cookie")
                if isinstance(cookie, bytes):
                    self._hold_cookie(address, cookie)
                if body.pop("retry", None) is True:
                    target = responder.keys
                    continue
            return answer
        return None

    def _hold_cookie(self, address: tuple[str, int], cookie: bytes) -> None:
        self._cookies_held[address] = cookie
        self._cookies_held.move_to_end(address)
        while len(self._cookies_held) > _COOKIE_CACHE:
            self._cookies_held.popitem(last=False)

    async def _request_once(
        self, address: tuple[str, int], target: SenderKeys | None, method: str, args: list[Any]
    ) -> tuple[Contact, Any] | None:
        msg_id = os.urandom(MSG_ID_BYTES)
        cookie = self._cookies_held.get(address) if target is not None else None
        try:
            if cookie is not None:
                datagram = self.auth.seal(
                    REQUEST, msg_id, [method, args, self.client, cookie], target
                )
            else:  # room for a cookie in the answer: it may be no larger than this request
                body: list[Any] = [method, args, self.client, b"", bytes(COOKIE_PAD_BYTES)]
                datagram = self.auth.seal(REQUEST, msg_id, body, target)
                if method in _LOOKUPS:  # and for a useful answer
                    pad = COOKIE_PAD_BYTES + FIRST_CONTACT_LOOKUP_BYTES - len(datagram)
                    body[4] = bytes(min(MAX_PADDING_BYTES, max(COOKIE_PAD_BYTES, pad)))
                    datagram = self.auth.seal(REQUEST, msg_id, body, target)
        except AuthError as e:
            logger.debug("cannot address %s: %s", address, e)
            return None
        if len(datagram) > MAX_REQUEST_BYTES:
            raise DHTError(f"a {method} request of {len(datagram)} bytes does not fit a datagram")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = (future, target if target is not None else address)
        sent = time.monotonic()
        try:
            self._send(address, datagram)
            answer = await asyncio.wait_for(future, self._rtt.timeout)
        except asyncio.TimeoutError:
            return None
        else:
            self._rtt.observe(time.monotonic() - sent)
            return answer
        finally:
            self._pending.pop(msg_id, None)

    def _send(self, address: tuple[str, int], datagram: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.sendto(datagram, address)

    @property
    def stall_after(self) -> float:
        """Seconds after which an unanswered request no longer holds up a lookup."""
        srtt = self._rtt.srtt
        if srtt is None:
            return self.request_timeout
        return min(self.request_timeout, max(MIN_STALL_S, srtt + 4 * self._rtt.rttvar))

    def is_suspect(self, node_id: bytes) -> bool:
        """Whether the node recently failed to answer (and has not been heard from since)."""
        failed_at = self._suspects.get(node_id)
        if failed_at is None:
            return False
        if time.monotonic() - failed_at > SUSPECT_FOR_S:
            del self._suspects[node_id]
            return False
        return True

    def _failed(self, contact: Contact) -> None:
        count = self._failures.get(contact.id, 0) + 1
        if count >= EVICT_AFTER_FAILURES:
            # one timeout on a busy host is no proof of death: skipping the node in every
            # lookup for a minute after a single miss made stores and gets take different
            # routes, and a get could miss every holder of a key
            if len(self._suspects) >= _MAX_SUSPECTS:
                self._suspects.pop(next(iter(self._suspects)))
            self._suspects[contact.id] = time.monotonic()
            self._failures.pop(contact.id, None)
            logger.debug("%s did not answer twice; removed from the routing table", contact)
            self.router.remove_contact(contact)
            self.evicted[contact.id] = contact
            self.evicted.move_to_end(contact.id)
            while len(self.evicted) > MAX_EVICTED:
                self.evicted.popitem(last=False)
        else:
            self._failures[contact.id] = count

    def check_alive(self, contact: Contact) -> None:
        """Ping a bucket's head in the background (kademlia section 2.2)."""
        self.spawn(self.call(contact, "ping"))

    # ---- routing-table upkeep and replication

    def welcome_if_new(self, node: Contact) -> None:
        """Add ``node`` to the routing table; when it is new, hand it the records it should hold.

        Per section 2.5 of the paper: for each stored key, if the new node is among the k closest
        to the key and we are closer than any other contact we know, we send it our entries for
        that key. Newcomers are handled in batches, off the path of the answer that met them.
        """
        if node.id == self.source_node.id or node.client:
            return
        self._suspects.pop(node.id, None)
        self.evicted.pop(node.id, None)
        is_new = self.router.is_new_node(node)
        self.router.add_contact(node)  # for a known node: refreshes its position and address
        if not is_new:
            return
        logger.debug("new DHT contact %s", node)
        if len(self.storage) == 0:
            return
        self._newcomers[node.id] = node
        if self._replicator is None or self._replicator.done():
            self._replicator = self.spawn(self._replicate_to_newcomers())

    async def _replicate_to_newcomers(self) -> None:
        await asyncio.sleep(REPLICATE_BATCH_S)
        newcomers, self._newcomers = self._newcomers, {}
        ksize = self.router.ksize
        own = self.source_node.long_id
        for key in self.storage.keys():  # noqa: SIM118 (iterating yields entries too)
            goal = int.from_bytes(key, "big")
            before = self.router.closest(key, ksize, exclude=newcomers.keys())
            if before and (own ^ goal) > (before[0].long_id ^ goal):
                continue  # a closer node than us replicates this key
            furthest = before[-1].long_id ^ goal if len(before) >= ksize else None
            for node in newcomers.values():
                if furthest is None or (node.long_id ^ goal) < furthest:
                    self._replication.append((node, key))  # bounded: the oldest fall off
            await asyncio.sleep(0)  # many keys: let answers through between them
        if self._replication and (
            self._replication_worker is None or self._replication_worker.done()
        ):
            self._replication_worker = self.spawn(self._replicate())

    async def _replicate(self) -> None:
        """Send queued replication stores, at most ``REPLICATION_RATE`` per second and
        ``REPLICATION_IN_FLIGHT`` at once, so a newcomer never costs a burst of work."""
        slots = asyncio.Semaphore(REPLICATION_IN_FLIGHT)

        async def one(node: Contact, key: bytes) -> None:
            try:
                entries = self.storage.entries(key)  # as they are now, not when queued
                if entries:
                    await self.send_entries(node, key, entries)
            finally:
                slots.release()

        while self._replication:
            node, key = self._replication.popleft()
            await slots.acquire()
            self.spawn(one(node, key))
            await asyncio.sleep(1.0 / REPLICATION_RATE)

    async def send_entries(self, contact: Contact, key: bytes, entries: list[DHTEntry]) -> int:
        """Store ``entries`` on ``contact`` in as many requests as needed; returns how many it
        took (-1 when it did not answer)."""
        stored = 0
        for batch in _batches(entries):
            answer = await self.call(contact, "store", key, [e.to_wire() for e in batch])
            if not isinstance(answer, dict):
                return -1
            count = answer.get("stored")
            if isinstance(count, int) and not isinstance(count, bool):
                stored += count
        return stored

    def counters(self) -> dict[str, int]:
        """What was refused or dropped so far, by cause (for logs and metrics)."""
        return {
            "datagrams_over_rate": self.datagram_budget.refused,
            "public_key_work_over_budget": self.verify_budget.refused,
            "signatures_checked": self.intake.signatures_checked,
            "forged_stores": self.intake.forgeries,
            "stores_refused_unchecked": self.intake.refused_unchecked,
            "new_slots_over_rate": self.intake.slot_budget.refused,
            "answers_cut_to_request_size": self.refused_amplification,
            "entries_over_quota": self.storage.refused,
            "entries_evicted": self.storage.evicted,
            "replication_queue": len(self._replication),
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
        for future, _ in self._pending.values():
            if not future.done():
                future.cancel()
        self._pending.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.transport is not None:
            self.transport.close()


class RttEstimator:
    """How long to wait for an answer: smoothed RTT plus four deviations (RFC 6298), clamped.

    An estimate that got no sample for ``RTT_MEMORY_S`` restarts from the next one instead of
    blending it in: a node that last asked while joining a busy swarm had learnt RTTs of hundreds
    of milliseconds, and with RFC 6298's gains took twenty answers to forget them, waiting that
    long for each dead node meanwhile.
    """

    def __init__(self, floor: float, ceiling: float):
        self.floor, self.ceiling = floor, ceiling
        self.srtt: float | None = None
        self.rttvar = 0.0
        self._observed_at = 0.0

    def observe(self, rtt: float, now: float | None = None) -> None:
        """Add one RTT sample (``now``: its time on the monotonic clock, default now)."""
        now = time.monotonic() if now is None else now
        stale = now - self._observed_at > RTT_MEMORY_S
        self._observed_at = now
        if self.srtt is None or stale:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt

    @property
    def timeout(self) -> float:
        if self.srtt is None:
            return self.ceiling
        return min(self.ceiling, max(self.floor, self.srtt + 4 * self.rttvar))


def _parse_request(body: Any) -> tuple[str, list[Any], bool, Any]:
    """``[method, args]``, then optionally ``client``, ``cookie`` and ``padding``.

    A request without a cookie is padded so that the answer carrying one is no larger.
    """
    if not isinstance(body, list) or not 2 <= len(body) <= 5:
        raise DHTError("a request is [method, args, client?, cookie?, padding?]")
    method, args = body[:2]
    from_client = body[2] if len(body) >= 3 else False
    cookie = body[3] if len(body) >= 4 else None
    if len(body) == 5 and (not isinstance(body[4], bytes) or len(body[4]) > MAX_PADDING_BYTES):
        raise DHTError(f"request padding is at most {MAX_PADDING_BYTES} bytes")
    if not isinstance(from_client, bool):
        raise DHTError("the client flag of a request is a bool")
    if method not in _METHODS:
        raise DHTError(f"unknown DHT method {str(method)[:32]!r}")
    if not isinstance(args, list) or len(args) > 2:
        raise DHTError("request arguments must be a short list")
    arity = {"ping": (0,), "store": (2,), "find_node": (1,), "find_value": (1, 2)}[method]
    if len(args) not in arity:
        raise DHTError(f"{method} takes {arity[0]} argument(s), got {len(args)}")
    return method, args, from_client, cookie


def _skeleton(method: str, cookie: bytes) -> dict[str, Any]:
    """The answer to ``method`` with nothing in it: its envelope is what a cut answer costs."""
    if method == "find_value":
        return {
            "nodes": [],
            "entries": [],
            "ages": [],
            "next": [0, 0],
            "truncated": True,
            "cookie": cookie,
            "retry": True,
            "cut": True,
        }
    if method == "find_node":
        return {"nodes": [], "cut": True, "cookie": cookie}
    return {"cookie": cookie}


class _Packed(list):
    """Wire items with the msgpack size of each, measured once (``sizes``)."""

    def __init__(self, items: Iterable[Any] = ()):
        super().__init__(items)
        self.sizes = [len(msgpack.packb(item, use_bin_type=True)) for item in self]


def _fitting(sizes: list[int], room: int) -> int:
    """How many items, from the first, fit in ``room`` bytes as one msgpack list."""
    used = _LIST_HEADER
    for count, size in enumerate(sizes):
        used += size
        if used > room:
            return count
    return len(sizes)


def _check_key(key: Any) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_DIGEST_BYTES:
        raise DHTError(f"a DHT key is {KEY_DIGEST_BYTES} bytes")


def _batches(entries: list[DHTEntry]) -> list[list[DHTEntry]]:
    """Split entries into groups that each fit one store request."""
    budget = MAX_REQUEST_BYTES - _ENVELOPE_OVERHEAD
    batches: list[list[DHTEntry]] = [[]]
    used = 0
    for entry in entries:
        size = entry.wire_size() + 8
        if batches[-1] and (used + size > budget or len(batches[-1]) >= MAX_ENTRIES_PER_STORE):
            batches.append([])
            used = 0
        batches[-1].append(entry)
        used += size
    return [b for b in batches if b]
