"""A peer's authenticated HTTP server and client: ``/ping``, ``/info``, RPCs and sealed streams.

The server side (routes, authentication, refusals and their status codes, the budgets around
them) is :class:`~swarm.net.server.Server`; streams go to handlers registered with
:meth:`Transport.add_stream`, and RPCs (:meth:`Transport.add_rpc`) are streams with a header only.
``/ping`` and ``/info`` accept an empty target because the caller may only know an address;
streams must name this peer as their target.

Errors towards the caller: :class:`~swarm.errors.TransportError` (with ``status`` and ``peer``) for
refusals, timeouts and lost connections; :class:`~swarm.errors.AuthError` when what a peer sent
fails authentication here (tampered or truncated reply, forged record).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import time
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import Any

import aiohttp

from swarm.address import PeerAddress
from swarm.auth import Membership
from swarm.errors import ConfigError, TransportError
from swarm.identity import Identity
from swarm.net.admission import DEFAULT_PER_HOST
from swarm.net.client import Client, empty_body
from swarm.net.connections import DEFAULT_MAX_CONNECTIONS, ConnectionLimits
from swarm.net.frames import DEFAULT_CIPHER, make_aead
from swarm.net.limits import StreamLimits
from swarm.net.record import MAX_RECORD_BYTES, PeerRecord
from swarm.net.server import Server, StreamHandler
from swarm.net.streams import InboundStream, OutboundStream, RemotePeer, ReplyStream
from swarm.version import __version__

logger = logging.getLogger(__name__)

RpcHandler = Callable[[RemotePeer, dict[str, Any]], Awaitable[dict[str, Any]]]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_RECORD_FIELDS = ("address", "run_id", "device", "bandwidth", "version", "extra")
DEFAULT_IDLE_TIMEOUT_S = 30.0


class Transport:
    """One peer's HTTP endpoint and client, on the peer's own event loop.

    Args:
        identity: this peer's keys.
        membership: who may talk to us (and whose swarm key we present).
        run_id: written into our record.
        listen: address to bind (port 0 picks one; see :attr:`bound_address`). When the host is a
            specific address, outgoing connections leave from it too.
        announce: what others dial; defaults to the bound address.
        device, bandwidth, extra: initial record fields (see :class:`PeerRecord`).
        cipher: stream AEAD we send with (``aes-256-gcm`` or ``chacha20-poly1305``; see
            :mod:`swarm.net.frames`). We accept both.
        max_chunk_bytes: largest plaintext per frame; bigger writes are split. Frames above it
            (+ the 16-byte tag) are refused before they are read.
        max_stream_bytes: largest body of one stream, per direction. Raise it for big state
            transfers.
        request_timeout: default for :meth:`ping` and :meth:`fetch_info`, and the connect timeout.
        replay_window_s: accepted clock difference; requests outside it are refused as replays.
        idle_timeout: seconds a connection may stay without a complete request (headers read
            or the last reply sent) before the server closes it; our client drops pooled
            connections sooner, so it never reuses one the server is closing.
        max_connections: inbound connections in all (kept below the descriptor limit).
        max_connections_per_host: inbound connections from one host (IPv4 address, IPv6 /64);
            a subnet (/24, /48) may hold eight times as many, and a quarter of the table is
            kept for hosts that proved themselves (see :mod:`swarm.net.admission`).
        stream_limits: idle time, minimum rate and partial-frame memory of inbound streams.
    """

    def __init__(
        self,
        identity: Identity,
        membership: Membership,
        *,
        run_id: str,
        listen: PeerAddress | str,
        announce: PeerAddress | str | None = None,
        device: str = "cpu",
        bandwidth: float = 0.0,
        extra: dict[str, Any] | None = None,
        cipher: str = DEFAULT_CIPHER,
        max_chunk_bytes: int = 1 << 20,
        max_stream_bytes: int = 1 << 31,
        request_timeout: float = 10.0,
        replay_window_s: float = 60.0,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_connections_per_host: int = DEFAULT_PER_HOST,
        stream_limits: StreamLimits | None = None,
    ):
        make_aead(cipher, bytes(32))  # ConfigError on an unknown cipher, now rather than later
        if not 1 <= max_chunk_bytes <= 1 << 26:
            raise ConfigError("max_chunk_bytes must be within 1 B .. 64 MiB")
        if max_stream_bytes < 0 or request_timeout <= 0:
            raise ConfigError("max_stream_bytes must be >= 0 and request_timeout > 0")
        if not idle_timeout > 0:
            raise ConfigError("idle_timeout must be positive")
        self.identity = identity
        self.membership = membership
        self.listen = _address(listen)
        self._announce = _address(announce) if announce is not None else None
        self.cipher = cipher
        self.max_chunk_bytes = max_chunk_bytes
        self.max_stream_bytes = max_stream_bytes
        self.request_timeout = request_timeout
        self._record_fields: dict[str, Any] = dict(
            run_id=run_id,
            device=device,
            bandwidth=bandwidth,
            version=__version__,
            extra=dict(extra or {}),
        )
        self._record: PeerRecord | None = None
        self.idle_timeout = idle_timeout
        self.connection_limits = ConnectionLimits(max_connections, max_connections_per_host)
        self.stream_limits = stream_limits or StreamLimits()
        self.server = Server(
            identity,
            membership,
            record=self.record,
            max_chunk_bytes=max_chunk_bytes,
            max_stream_bytes=max_stream_bytes,
            replay_window_s=replay_window_s,
            idle_timeout=idle_timeout,
            connections=self.connection_limits,
            stream_limits=self.stream_limits,
        )
        self._started = False
        self._outgoing: Client | None = None
        self.bound_address: PeerAddress | None = None

    # ---- lifetime

    async def start(self) -> None:
        """Bind the server and open the client session.

        Raises:
            TransportError: the address cannot be bound.
        """
        if self._started:
            raise TransportError("transport already started")
        port = await self.server.start(self.listen)
        self._started = True
        self.bound_address = PeerAddress(self.listen.host, port)
        local_addr = (self.listen.host, 0) if _is_specific_ip(self.listen.host) else None
        connector = aiohttp.TCPConnector(
            limit=0, local_addr=local_addr, keepalive_timeout=self.idle_timeout / 2
        )
        session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.request_timeout),
        )
        self._outgoing = Client(
            session,
            self.identity,
            self.membership,
            cipher=self.cipher,
            max_chunk_bytes=self.max_chunk_bytes,
            max_stream_bytes=self.max_stream_bytes,
        )
        self.update_record(address=self._announce or self.bound_address)
        logger.info(
            "transport of %s listening on %s", self.identity.peer_id.short, self.bound_address
        )

    async def close(self) -> None:
        """Close the client session, then the server (handlers get a short grace period)."""
        if self._outgoing is not None:
            await self._outgoing.close()
            self._outgoing = None
        await self.server.close()
        self._started = False

    async def __aenter__(self) -> Transport:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def port(self) -> int:
        """The bound port number (the DHT binds the same number over UDP)."""
        if self.bound_address is None:
            raise TransportError("transport not started")
        return self.bound_address.port

    @property
    def metrics(self) -> Callable[[], bytes] | None:
        """Serves ``GET /metrics`` (without swarm authentication) when set."""
        return self.server.metrics

    @metrics.setter
    def metrics(self, render: Callable[[], bytes] | None) -> None:
        self.server.metrics = render

    @property
    def refused(self) -> dict[str, int]:
        """HTTP status -> requests the server refused with it."""
        return self.server.refused

    def counters(self) -> dict[str, int]:
        """What the server's limits refused so far, by cause (for logs and metrics)."""
        budget = self.stream_limits.budget
        return {
            "connections_over_limit": self.connection_limits.refused,
            "connections_open": self.connection_limits.total,
            "connections_evicted": self.connection_limits.evicted,
            "streams_stalled": self.stream_limits.stalled,
            "partial_frame_bytes": budget.used if budget is not None else 0,
        }

    # ---- record

    def record(self) -> PeerRecord:
        """This peer's current signed record (available after :meth:`start`)."""
        if self._record is None:
            raise TransportError("transport not started")
        return self._record

    def update_record(self, **fields: Any) -> PeerRecord:
        """Change record fields (address, run_id, device, bandwidth, version, extra), re-sign.

        With no fields, just refreshes the timestamp and signature.

        Raises:
            ConfigError: unknown field or invalid value.
        """
        unknown = set(fields) - set(_RECORD_FIELDS)
        if unknown:
            raise ConfigError(f"unknown record fields {sorted(unknown)}")
        merged = {**self._record_fields, **fields}
        if "address" not in merged:
            raise TransportError("start the transport (or pass address=) before signing a record")
        record = PeerRecord.create(self.identity, **merged)
        self._record_fields = merged
        self._record = record
        return record

    # ---- handlers

    def add_stream(self, name: str, handler: StreamHandler) -> None:
        """Serve ``POST /stream/{name}`` with ``handler(request, reply)``.

        The handler iterates ``request`` for verified chunks and answers with
        ``await reply.prepare(header)`` and ``await reply.write(chunk)``; the reply ends when it
        returns. If it raises before preparing, the caller gets an HTTP error; after, an ERROR
        frame. It may hold the reply as long as it likes: only the caller times out.
        """
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(f"stream name {name!r}: 1-64 letters, digits, '.', '_', '-'")
        if name in self.server.streams:
            raise ConfigError(f"stream {name!r} already has a handler")
        self.server.streams[name] = handler

    def add_rpc(self, name: str, handler: RpcHandler) -> None:
        """Serve :meth:`call` requests: ``handler(sender, payload) -> reply dict``."""

        async def as_stream(request: InboundStream, reply: ReplyStream) -> None:
            async for _ in request:
                raise TransportError("an RPC carries no body", status=400)
            await reply.prepare(await handler(request.sender, request.header))

        self.add_stream(name, as_stream)

    # ---- client

    def _client(self) -> Client:
        if self._outgoing is None:
            raise TransportError("transport not started")
        return self._outgoing

    async def ping(self, address: PeerAddress, *, timeout: float | None = None) -> float:
        """Round-trip time in seconds of one authenticated ``/ping`` (connection reuse included).

        Raises:
            TransportError: refused, unreachable or timed out.
        """
        start = time.perf_counter()
        await self._client().get(address, "/ping", 64, timeout or self.request_timeout)
        self.connection_limits.prove(address.host)  # it answered us: room kept for its host
        return time.perf_counter() - start

    async def fetch_info(self, address: PeerAddress, *, timeout: float | None = None) -> PeerRecord:
        """The signed record of the peer at ``address``, verified.

        Raises:
            TransportError: refused, unreachable, timed out, or a malformed record.
            AuthError: the record's signature does not verify.
        """
        data = await self._client().get(
            address, "/info", MAX_RECORD_BYTES, timeout or self.request_timeout
        )
        record = PeerRecord.parse(data)
        self.connection_limits.prove(address.host)
        return record

    def stream(
        self,
        peer: PeerRecord,
        name: str,
        header: dict[str, Any],
        chunks: AsyncIterable[bytes],
        *,
        timeout: float,
    ) -> OutboundStream:
        """Open a sealed stream to ``peer``'s handler ``name``; use as ``async with``.

        Args:
            peer: the receiver's record (its address and keys).
            header: small msgpack-able dict, authenticated and encrypted.
            chunks: the request body; sent concurrently with reading the reply.
            timeout: longest wait for any one step: connecting, the reply header, or the next
                reply bytes. Wrap the block in ``asyncio.timeout`` for a total deadline.

        Raises (on entering, or while iterating):
            TransportError: refused (``status``), unreachable, timed out, aborted by the peer.
            AuthError: the reply fails authentication or is truncated.
        """
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(f"stream name {name!r}: 1-64 letters, digits, '.', '_', '-'")
        return self._client().stream(peer, name, header, chunks, timeout=timeout)

    async def call(
        self, peer: PeerRecord, name: str, payload: dict[str, Any], *, timeout: float
    ) -> dict[str, Any]:
        """Call ``peer``'s RPC ``name`` (see :meth:`add_rpc`) within ``timeout`` seconds in total.

        Raises:
            TransportError: refused, unreachable, timed out, or the handler failed.
            AuthError: the reply fails authentication.
        """

        async def go() -> dict[str, Any]:
            async with self.stream(peer, name, payload, empty_body(), timeout=timeout) as s:
                async for _ in s:
                    raise TransportError(f"RPC {name} replied with a body", peer=str(peer.address))
                return s.header

        try:
            reply = await asyncio.wait_for(go(), timeout)
        except TimeoutError as e:
            raise TransportError(
                f"RPC {name} timed out after {timeout} s", peer=str(peer.address)
            ) from e
        self.connection_limits.prove(peer.address.host)  # an authenticated answer: proof
        return reply


def _address(value: PeerAddress | str) -> PeerAddress:
    return value if isinstance(value, PeerAddress) else PeerAddress.parse(value)


def _is_specific_ip(host: str) -> bool:
    try:
        return not ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False
