"""Calls out: our requests to other nodes, and the answers that belong to them.

:class:`Caller` seals a request (padded when it echoes no cookie, see
:mod:`swarm.dht.request_format`), waits for the answer as long as recent answers suggest (see
:mod:`swarm.dht.rtt`), and accepts an answer only from the node or address it asked. An answer
carrying a cookie leaves it with us, to echo in our next requests to that address; an answer
that is only a cookie (our address was not proved yet and nothing useful fitted in the request's
size) makes us ask once more, with it. A contact that did not answer counts toward its eviction
(see :mod:`swarm.dht.suspects`); one that did enters the routing table.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from swarm.dht.envelope import (
    ENVELOPE_OVERHEAD,
    MAX_REQUEST_BYTES,
    MSG_ID_BYTES,
    DatagramAuth,
    SenderKeys,
)
from swarm.dht.records import DHTEntry
from swarm.dht.request_format import Request, seal_request
from swarm.dht.routing import Contact
from swarm.dht.rtt import RttEstimator
from swarm.dht.store_intake import MAX_ENTRIES_PER_STORE
from swarm.dht.suspects import Suspects
from swarm.errors import AuthError

logger = logging.getLogger(__name__)

COOKIES_HELD = 8192  # addresses whose cookie we keep to echo

Address = tuple[str, int]


class Caller:
    """Sends requests and matches their answers.

    Args:
        auth: seals our requests.
        send: sends a datagram to an address (nothing once the node is closed).
        rtt: how long to wait for an answer; fed with every answer's round trip.
        suspects: counts the contacts that did not answer.
        welcome: takes a node that answered into the routing table.
        client: flag our requests so that nobody adds us to a routing table.
    """

    def __init__(
        self,
        auth: DatagramAuth,
        send: Callable[[Address, bytes], None],
        rtt: RttEstimator,
        suspects: Suspects,
        welcome: Callable[[Contact], None],
        client: bool = False,
    ):
        self.auth = auth
        self.rtt = rtt
        self.suspects = suspects
        self.client = client
        self._send = send
        self._welcome = welcome
        # msg id -> (future of the answer, the keys or address it must come from)
        self.pending: dict[bytes, tuple[asyncio.Future[Any], SenderKeys | Address]] = {}
        # cookies others gave us, by their address: echoed in our requests to them
        self.cookies_held: OrderedDict[Address, bytes] = OrderedDict()

    async def call(self, contact: Contact, method: str, *args: Any) -> Any | None:
        """Send a request to a known contact; None on timeout, else the answer's body."""
        answer = await self._request(contact.address, contact.keys, method, list(args))
        if answer is None:
            self.suspects.failed(contact)
            return None
        responder, body = answer
        self.suspects.answered(responder.id)
        self._welcome(responder)
        return body

    async def ping_address(self, address: Address) -> Contact | None:
        """Ping a bare ``(ip, port)`` whose keys we do not know yet (first contact)."""
        answer = await self._request(address, None, "ping", [])
        if answer is None:
            return None
        responder, _ = answer
        self._welcome(responder)
        return responder

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

    def accept_answer(self, msg_id: bytes, sender: Contact, body: Any) -> None:
        """Hand an authenticated answer to the request waiting for it, if it came from the node
        (or, on first contact, the address) that was asked."""
        pending = self.pending.get(msg_id)
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
        del self.pending[msg_id]
        if not future.done():
            future.set_result((sender, body))

    def cancel_all(self) -> None:
        """Stop waiting for every answer (the node is closing)."""
        for future, _ in self.pending.values():
            if not future.done():
                future.cancel()
        self.pending.clear()

    async def _request(
        self, address: Address, target: SenderKeys | None, method: str, args: list[Any]
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

    def holds_cookie(self, address: Address) -> bool:
        """Whether a request to ``address`` would echo its cookie (prove our address)."""
        return address in self.cookies_held

    def _hold_cookie(self, address: Address, cookie: bytes) -> None:
        self.cookies_held[address] = cookie
        self.cookies_held.move_to_end(address)
        while len(self.cookies_held) > COOKIES_HELD:
            self.cookies_held.popitem(last=False)

    async def _request_once(
        self, address: Address, target: SenderKeys | None, method: str, args: list[Any]
    ) -> tuple[Contact, Any] | None:
        msg_id = os.urandom(MSG_ID_BYTES)
        cookie = self.cookies_held.get(address) if target is not None else None
        try:
            datagram = seal_request(
                self.auth, msg_id, Request(method, args, self.client, cookie), target
            )
        except AuthError as e:
            logger.debug("cannot address %s: %s", address, e)
            return None
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.pending[msg_id] = (future, target if target is not None else address)
        sent = time.monotonic()
        try:
            self._send(address, datagram)
            answer = await asyncio.wait_for(future, self.rtt.timeout)
        except asyncio.TimeoutError:
            return None
        else:
            self.rtt.observe(time.monotonic() - sent)
            return answer
        finally:
            self.pending.pop(msg_id, None)


def _batches(entries: list[DHTEntry]) -> list[list[DHTEntry]]:
    """Split entries into groups that each fit one store request."""
    budget = MAX_REQUEST_BYTES - ENVELOPE_OVERHEAD
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
