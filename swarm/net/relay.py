"""Relays: a reachable peer forwards TCP connections to a peer that nobody can dial.

The unreachable peer opens a sealed stream ``relay.control`` to the relay and keeps it open. The
relay opens a TCP listener for it (``relay host : port``, the *relayed address*, which the peer
announces) and answers that port in the stream's header. For every connection arriving there the
relay writes a random 16-byte token on the control stream (sealed, so only the peer learns it);
the peer dials the same listener, sends ``MAGIC + token``, and connects the other end to its own
HTTP server; the relay then pumps bytes between the two connections. The relay never sees a key:
every request is still signed end to end and every stream body sealed with the pairwise key of
its two ends, so the relay carries ciphertext it can only drop or delay (a cut or tampered stream
fails authentication at the receiver, as on any path).

Limits the relay sets (:class:`RelayBudget`): how many peers it relays for, how many relayed
connections it carries, and a byte rate shared by all of them. A connection that sends nothing
within :data:`HANDSHAKE_S`, a token nobody asked for, or a peer that does not dial back in time
is dropped. The control stream carries a keepalive every :data:`KEEPALIVE_S` each way, so
either end learns within :data:`SILENCE_S` that the other is gone (at once when its process
dies: the connection closes), and a vanished peer's reservation is freed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from swarm.address import PeerAddress
from swarm.errors import ConfigError, SwarmError, TransportError
from swarm.identity import PeerID
from swarm.net.record import PeerRecord
from swarm.net.streams import InboundStream, ReplyStream
from swarm.net.transport import Transport

logger = logging.getLogger(__name__)

CONTROL_STREAM = "relay.control"
MAGIC = b"SWRELAY1"
TOKEN_BYTES = 16
KEEPALIVE = b"\x00"
KEEPALIVE_S = 3.0
SILENCE_S = 4 * KEEPALIVE_S  # a relay silent this long is taken for dead
HANDSHAKE_S = 10.0  # first bytes of a connection, and the relayed peer's dial back
MAX_PENDING = 32  # connections waiting for their dial back, per relayed peer
PUMP_BYTES = 64 * 1024
RELAY_KEY = "relay"  # record extra key: this peer relays for others


@dataclass(frozen=True)
class RelayBudget:
    """What a relay gives away: ``peers`` relayed at once, ``connections`` carried, ``rate``."""

    peers: int = 4  # relayed peers at once; 0 turns relaying off
    connections: int = 64  # relayed TCP connections at once, over all peers
    rate: float = 12.5e6  # bytes/s over all relayed connections, per direction

    def __post_init__(self) -> None:
        if self.peers < 0 or self.connections < 0 or not self.rate > 0:
            raise ConfigError("relay budget: peers and connections >= 0, rate > 0")

    @classmethod
    def parse(cls, text: str) -> RelayBudget:
        """``PEERS`` or ``PEERS,MBIT`` (e.g. ``4,100``); ``0`` turns relaying off."""
        parts = text.split(",")
        try:
            peers = int(parts[0])
            mbit = float(parts[1]) if len(parts) > 1 else 100.0
        except (ValueError, IndexError) as e:
            raise ConfigError(f"relay budget {text!r}: expected PEERS or PEERS,MBIT") from e
        if len(parts) > 2:
            raise ConfigError(f"relay budget {text!r}: expected PEERS or PEERS,MBIT")
        return cls(peers=peers, rate=mbit * 1e6 / 8)

    @property
    def enabled(self) -> bool:
        return self.peers > 0 and self.connections > 0


class _Pacer:
    """A byte rate shared by many pumps (a token bucket with a 50 ms burst)."""

    def __init__(self, rate: float):
        self.rate = rate
        self._until = 0.0

    async def take(self, nbytes: int) -> None:
        now = time.monotonic()
        self._until = max(now, self._until) + nbytes / self.rate
        if (wait := self._until - now - 0.05) > 0:
            await asyncio.sleep(wait)


async def splice(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    b: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    *,
    pacers: tuple[_Pacer, _Pacer] | None = None,
    count: Callable[[int], None] | None = None,
) -> None:
    """Pump bytes both ways until both directions end; then close both connections.

    ``pacers``: the rate of ``a -> b`` and of ``b -> a`` (a link has a rate each way).
    """

    async def pump(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pacer: _Pacer | None
    ) -> None:
        try:
            while data := await reader.read(PUMP_BYTES):
                if pacer is not None:
                    await pacer.take(len(data))
                if count is not None:
                    count(len(data))
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError):
            writer.close()

    try:
        forward, backward = pacers if pacers is not None else (None, None)
        await asyncio.gather(pump(a[0], b[1], forward), pump(b[0], a[1], backward))
    finally:
        for writer in (a[1], b[1]):
            writer.close()


class _Reservation:
    """One relayed peer at this relay: its listener and the connections awaiting a dial back."""

    def __init__(self, peer: PeerID):
        self.peer = peer
        self.tokens: asyncio.Queue[bytes] = asyncio.Queue(maxsize=MAX_PENDING)
        self.pending: dict[bytes, asyncio.Future[Any]] = {}
        self.server: asyncio.Server | None = None
        self.watch: asyncio.Task[None] | None = None  # ends when the peer's keepalives stop


async def _watch_keepalives(request: InboundStream) -> None:
    """Return once the relayed peer's body ends or stays silent for :data:`SILENCE_S`."""
    chunks = request.__aiter__()
    try:
        while True:
            chunk = await asyncio.wait_for(chunks.__anext__(), SILENCE_S)
            if chunk != KEEPALIVE:
                return  # a relayed peer only ever sends keepalives
    except (StopAsyncIteration, TimeoutError, SwarmError):
        return


class RelayService:
    """The relay's side. ``can_relay()`` says whether we are reachable ourselves right now."""

    def __init__(self, transport: Transport, budget: RelayBudget, can_relay: Callable[[], bool]):
        self.transport = transport
        self.budget = budget
        self.can_relay = can_relay
        self.pacers = (_Pacer(budget.rate), _Pacer(budget.rate))  # to relayed peers, from them
        self.bytes_relayed = 0
        self.connections = 0
        self._reservations: dict[PeerID, _Reservation] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        transport.add_stream(CONTROL_STREAM, self._handle_control)

    @property
    def relayed_peers(self) -> list[PeerID]:
        return list(self._reservations)

    def _count(self, nbytes: int) -> None:
        self.bytes_relayed += nbytes

    async def _handle_control(self, request: InboundStream, reply: ReplyStream) -> None:
        peer = request.sender.peer_id
        if not self.budget.enabled or not self.can_relay():
            raise TransportError("this peer does not relay", status=503)
        if peer not in self._reservations and len(self._reservations) >= self.budget.peers:
            raise TransportError("relay full", status=503)
        old = self._reservations.pop(peer, None)
        if old is not None and old.server is not None:
            old.server.close()
        reservation = _Reservation(peer)
        self._reservations[peer] = reservation
        try:
            reservation.server = await asyncio.start_server(
                lambda r, w: self._spawn(self._on_connect(reservation, r, w)),
                host=self.transport.listen.host,
                port=0,
            )
            port = reservation.server.sockets[0].getsockname()[1]
            await reply.prepare({"port": port})
            logger.info("relaying for %s on port %d", peer.short, port)
            watch = asyncio.create_task(_watch_keepalives(request))
            reservation.watch = watch
            while not watch.done():  # the relayed peer's keepalives stopped: it is gone
                try:
                    token = await asyncio.wait_for(reservation.tokens.get(), KEEPALIVE_S)
                except TimeoutError:
                    token = KEEPALIVE
                await reply.write(token)
        finally:
            if reservation.watch is not None:
                reservation.watch.cancel()
            if self._reservations.get(peer) is reservation:
                del self._reservations[peer]
            if reservation.server is not None:
                reservation.server.close()
            for future in reservation.pending.values():
                future.cancel()
            logger.info("stopped relaying for %s", peer.short)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_connect(
        self, reservation: _Reservation, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            first = await asyncio.wait_for(reader.read(PUMP_BYTES), HANDSHAKE_S)
            if first.startswith(MAGIC):  # the relayed peer dialing back for a token
                while len(first) < len(MAGIC) + TOKEN_BYTES:
                    more = await asyncio.wait_for(reader.read(PUMP_BYTES), HANDSHAKE_S)
                    if not more:
                        raise ConnectionError("closed during the handshake")
                    first += more
                token = first[len(MAGIC) : len(MAGIC) + TOKEN_BYTES]
                future = reservation.pending.pop(token, None)
                if future is None or future.done():
                    raise ConnectionError("a token nobody asked for")
                future.set_result((reader, writer, first[len(MAGIC) + TOKEN_BYTES :]))
                return  # the connection that asked for it pumps the bytes
            if not first or self.connections >= self.budget.connections:
                raise ConnectionError("empty, or over the relay's connection budget")
            if len(reservation.pending) >= MAX_PENDING or reservation.tokens.full():
                raise ConnectionError("too many connections waiting for the relayed peer")
            token = os.urandom(TOKEN_BYTES)
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            reservation.pending[token] = future
            reservation.tokens.put_nowait(token)
            try:
                back_reader, back_writer, rest = await asyncio.wait_for(future, HANDSHAKE_S)
            finally:
                reservation.pending.pop(token, None)
        except (ConnectionError, OSError, TimeoutError, asyncio.CancelledError) as e:
            logger.debug("relay connection for %s dropped: %r", reservation.peer.short, e)
            writer.close()
            return
        self.connections += 1
        try:
            back_writer.write(first)
            if rest:
                writer.write(rest)
            self._count(len(first) + len(rest))
            await splice(
                (reader, writer), (back_reader, back_writer), pacers=self.pacers, count=self._count
            )
        finally:
            self.connections -= 1

    async def close(self) -> None:
        for reservation in list(self._reservations.values()):
            if reservation.server is not None:
                reservation.server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _keepalives() -> AsyncIterator[bytes]:
    while True:
        yield KEEPALIVE
        await asyncio.sleep(KEEPALIVE_S)


class RelayLink:
    """The relayed peer's side: one control stream to one relay, and its dial backs.

    ``await link.ready`` gives the relayed address; ``link.done`` is set when the relay is lost.
    """

    def __init__(self, transport: Transport, relay: PeerRecord, local: PeerAddress):
        self.transport = transport
        self.relay = relay
        self.local = local  # our own HTTP server, where relayed connections end
        self.address: PeerAddress | None = None
        self.error: str | None = None
        self.ready = asyncio.Event()
        self.done = asyncio.Event()
        self._backs: set[asyncio.Task[None]] = set()
        self._task = asyncio.create_task(self._run(), name=f"swarm-relay-{relay.peer_id.short}")

    @property
    def relay_id(self) -> PeerID:
        return self.relay.peer_id

    async def wait_ready(self, timeout: float) -> PeerAddress:
        """The relayed address once the relay accepted us.

        Raises:
            TransportError: the relay refused, is unreachable, or did not answer in time.
        """
        ready = asyncio.ensure_future(self.ready.wait())
        done = asyncio.ensure_future(self.done.wait())
        try:
            await asyncio.wait({ready, done}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            done.cancel()
        if self.address is None:
            raise TransportError(
                f"relay refused or unreachable: {self.error or 'no answer'}",
                peer=f"{self.relay_id.short}@{self.relay.address}",
            )
        return self.address

    async def _run(self) -> None:
        try:
            async with self.transport.stream(
                self.relay, CONTROL_STREAM, {}, _keepalives(), timeout=SILENCE_S
            ) as stream:
                port = stream.header.get("port")
                if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
                    raise TransportError("relay answered no port", peer=str(self.relay.address))
                self.address = PeerAddress(self.relay.address.host, port)
                self.ready.set()
                async for chunk in stream:
                    if len(chunk) == TOKEN_BYTES:
                        task = asyncio.create_task(self._dial_back(bytes(chunk)))
                        self._backs.add(task)
                        task.add_done_callback(self._backs.discard)
                    elif chunk != KEEPALIVE:
                        raise TransportError("relay sent junk", peer=str(self.relay.address))
            self.error = "the relay closed the control stream"
        except (SwarmError, OSError) as e:
            self.error = str(e)
        finally:
            self.done.set()

    async def _dial_back(self, token: bytes) -> None:
        assert self.address is not None
        try:
            relay = await asyncio.wait_for(
                asyncio.open_connection(self.address.host, self.address.port), HANDSHAKE_S
            )
            relay[1].write(MAGIC + token)
            local = await asyncio.wait_for(
                asyncio.open_connection(self.local.host, self.local.port), HANDSHAKE_S
            )
        except (OSError, TimeoutError) as e:
            logger.debug("relay dial back through %s failed: %r", self.relay_id.short, e)
            return
        await splice(relay, local)

    async def close(self) -> None:
        self._task.cancel()
        for task in list(self._backs):
            task.cancel()
        await asyncio.gather(self._task, *self._backs, return_exceptions=True)
