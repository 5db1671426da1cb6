"""Dial-back checks (AutoNAT-like): a peer asks others to dial it and learns if it is reachable.

The requester calls the RPC ``reach.dialback`` with the port it hopes is open; the helper dials
that port at the requester's *observed* IP address (where the request came from, not an
address the requester names, so a helper cannot be aimed at a third party) over TCP (a fresh
connection, ``GET /info``, whose record must carry the requester's key) and over UDP (a DHT ping,
through a probe the peer provides), and answers what worked. Each helper runs at most
:data:`MAX_CONCURRENT_DIALS` dial-backs at once and one per requester at a time.

One exception: a request that reached a relayed helper through its relay comes from the
helper's own address (the relay's splice ends there), so the observed address says nothing; the
helper then dials the host the requester names. That costs one connection and one datagram per
request, serialized per requester and bounded overall, so it amplifies nothing.

What a peer learned is one :class:`Reach` value, written to its record (``extra["reach"]``) and
shown in ``swarm-peer peers``.
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from swarm.address import PeerAddress
from swarm.errors import SwarmError, TransportError
from swarm.identity import PeerID
from swarm.net.client import Client
from swarm.net.record import MAX_RECORD_BYTES, PeerRecord
from swarm.net.streams import RemotePeer
from swarm.net.transport import Transport

logger = logging.getLogger(__name__)

DIALBACK_RPC = "reach.dialback"
MAX_CONCURRENT_DIALS = 4
REACH_KEY = "reach"  # record extra key

UdpProbe = Callable[[PeerAddress, PeerID], Awaitable[bool]]


class Reach(enum.Enum):
    """How others reach a peer."""

    UNKNOWN = "unknown"  # not checked yet (no other peer to ask)
    DIRECT = "direct"  # its own address is dialable
    MAPPED = "mapped"  # dialable through a port mapping on its router
    RELAYED = "relayed"  # behind NAT; dialable through a relay
    CLIENT = "client"  # behind NAT, no relay: it only dials out

    @property
    def dialable(self) -> bool:
        """Whether a dial to its announced address reaches it without a relay."""
        return self in (Reach.DIRECT, Reach.MAPPED)


def reach_of(record: PeerRecord) -> Reach:
    """What a record says (UNKNOWN for a missing or unknown value)."""
    try:
        return Reach(record.extra.get(REACH_KEY, "unknown"))
    except ValueError:
        return Reach.UNKNOWN


@dataclass(frozen=True)
class DialbackResult:
    """What a helper saw when it dialed us back."""

    helper: PeerID
    observed_host: str  # our IP as the helper sees it
    port: int
    tcp: bool  # a fresh TCP connection reached our HTTP server
    udp: bool  # a DHT ping reached our UDP socket

    @property
    def address(self) -> PeerAddress:
        return PeerAddress(self.observed_host, self.port)


class DialbackService:
    """The helper's side: answers ``reach.dialback``."""

    def __init__(self, transport: Transport, udp_probe: UdpProbe | None, *, timeout: float = 3.0):
        self.transport = transport
        self.udp_probe = udp_probe
        self.timeout = timeout
        self._slots = asyncio.Semaphore(MAX_CONCURRENT_DIALS)
        self._busy: set[PeerID] = set()
        transport.add_rpc(DIALBACK_RPC, self._rpc_dialback)

    async def _rpc_dialback(self, sender: RemotePeer, payload: dict[str, Any]) -> dict[str, Any]:
        port = payload.get("port")
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise TransportError("dialback: port must be an integer in 1..65535", status=400)
        host = sender.host
        if _is_own(host, self.transport) and isinstance(payload.get("host"), str):
            host = payload["host"]  # came through our relay: the observed address is our own
        try:
            address = PeerAddress(host, port)
        except SwarmError as e:
            raise TransportError(f"dialback: no usable source address: {e}", status=400) from e
        if sender.peer_id in self._busy or self._slots.locked():
            raise TransportError("dialback: busy, ask later", status=503)
        self._busy.add(sender.peer_id)
        try:
            async with self._slots:
                tcp, udp = await asyncio.gather(
                    self._dial_tcp(address, sender.peer_id), self._dial_udp(address, sender.peer_id)
                )
        finally:
            self._busy.discard(sender.peer_id)
        logger.debug("dialed back %s at %s: tcp=%s udp=%s", sender.peer_id.short, address, tcp, udp)
        return {"host": host, "port": port, "tcp": tcp, "udp": udp}

    async def _dial_tcp(self, address: PeerAddress, expected: PeerID) -> bool:
        # a fresh session: a pooled connection the requester opened to us must not count
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True, limit=1), auto_decompress=False
        )
        client = Client(
            session,
            self.transport.identity,
            self.transport.membership,
            cipher=self.transport.cipher,
            max_chunk_bytes=1024,
            max_stream_bytes=0,
        )
        try:
            data = await client.get(address, "/info", MAX_RECORD_BYTES, self.timeout)
            return PeerRecord.parse(data).peer_id == expected
        except SwarmError as e:
            logger.debug("TCP dial-back to %s failed: %s", address, e)
            return False
        finally:
            await client.close()

    async def _dial_udp(self, address: PeerAddress, expected: PeerID) -> bool:
        if self.udp_probe is None:
            return False
        try:
            return await asyncio.wait_for(self.udp_probe(address, expected), self.timeout)
        except (TimeoutError, SwarmError, OSError):
            return False


def _is_own(host: str, transport: Transport) -> bool:
    """Whether a connection from ``host`` is our relay's splice: it ends at our bound address
    (or at loopback when we listen on every interface)."""
    bound = transport.bound_address
    if bound is None:
        return False
    if bound.is_wildcard:
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False
    return host == bound.host


async def request_dialback(
    transport: Transport, helper: PeerRecord, port: int, *, host: str, timeout: float = 8.0
) -> DialbackResult:
    """Ask ``helper`` to dial us back at ``port`` (at ``host`` only if it is relayed).

    Raises:
        TransportError: the helper is unreachable, refused, or answered nonsense.
    """
    payload = {"port": port, "host": host}
    answer = await transport.call(helper, DIALBACK_RPC, payload, timeout=timeout)
    host, tcp, udp = answer.get("host"), answer.get("tcp"), answer.get("udp")
    if not isinstance(host, str) or not isinstance(tcp, bool) or not isinstance(udp, bool):
        raise TransportError("dialback: malformed answer", peer=str(helper.address))
    try:
        PeerAddress(host, port)
    except SwarmError as e:
        raise TransportError(f"dialback: malformed host: {e}", peer=str(helper.address)) from e
    return DialbackResult(helper.peer_id, host, port, tcp, udp)
