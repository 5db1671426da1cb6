"""A WAN emulator for tests: per-directed-link one-way delay and rate between loopback peers.

Each emulated node gets a real address ``127.0.0.x:P`` (the peer binds it: ``--listen``) and an
announce address ``127.0.1.x:P`` (the peer announces it: ``--announce``), where the emulator
runs one TCP and one UDP proxy that forwards to the real address. Peers bind their own loopback
address, so their outgoing TCP connections and DHT datagrams leave from ``127.0.0.s``: the proxy
of ``P`` tells the sender ``S`` by the source address and applies the link ``S -> P`` to bytes
towards ``P`` and the link ``P -> S`` to bytes coming back. No product code changes.

- TCP: the proxy of ``P`` accepts, dials ``P`` from the client's own IP (so ``P`` still sees
  ``127.0.0.s``) and pumps both directions. Bytes are serialized at the link's rate (the reader
  waits while the emulated wire is busy, which is the back-pressure TCP expects), then delivered
  ``delay`` later, in order. Connection set-up is instant (no emulated handshake RTT).
- UDP: a datagram from ``S``'s real address to ``P``'s proxy is sent to ``P`` *from ``S``'s
  proxy socket*, so ``P`` sees the sender as ``S``'s announce address. ``P``'s answer goes to
  that address, i.e. through ``S``'s proxy, which applies ``P -> S``: replies take the right path
  and the DHT's routing tables only ever hold announce addresses. A datagram from an address
  that is no node (a test's own socket) goes through a relay socket per (source, node) that
  sends replies back through the node's proxy. A datagram that would queue longer than
  :data:`MAX_UDP_QUEUE_S` behind the rate limit is dropped, like a full router buffer.

Links are looked up when bytes move, so :meth:`WanEmulator.set_link` and :meth:`WanEmulator.move`
take effect at once, also on open connections (a peer "moves")::

    async with WanEmulator(delays={("eu", "eu"): 0.002, ("eu", "us"): 0.040}) as wan:
        a = await wan.add_node("a", region="eu")
        b = await wan.add_node("b", region="us")
        # start peers with listen=a.listen, announce=a.announce (and b likewise)
        wan.move(b, "eu")

Several processes can emulate one WAN (``tests/many_procs.py``): each runs an emulator for its
own nodes and :meth:`WanEmulator.add_remote` for the others', with one :class:`SharedUplinks`
for all. Every process binds every node's UDP proxy address (``SO_REUSEPORT``, Linux), so
whichever of them the kernel hands a datagram can send it on from the sender's proxy address;
a TCP proxy runs in its node's process only. Loop time is ``time.monotonic()`` in every
process, so the uplinks' shared "busy until" times compare.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from wan_sockets import Addr, UdpSocket, bind_pair, first_error, reuse_port_socket
from wan_uplinks import SharedUplinks

from swarm.address import PeerAddress

logger = logging.getLogger(__name__)

LISTEN_PREFIX, ANNOUNCE_PREFIX = "127.0.0.", "127.0.1."
CHUNK_BYTES = 16 * 1024  # TCP bytes moved per step (one emulated "packet train")
MAX_TCP_INFLIGHT = 256  # chunks delayed per direction and connection (4 MiB)
MAX_UDP_QUEUE_S = 1.0  # a datagram queued longer than this behind the rate limit is dropped


class Uplink(Protocol):
    rate: float

    def reserve(self, nbytes: int, now: float) -> float: ...


@dataclass
class Link:
    """One direction between two hosts. Change ``delay`` and ``rate`` at any time."""

    delay: float = 0.0  # one-way propagation delay, seconds
    rate: float = math.inf  # bytes per second, shared by every connection and datagram
    busy_until: float = 0.0  # loop time at which the bytes queued so far have left
    bytes_sent: int = 0  # total bytes carried (for benchmarks)
    datagrams: int = 0  # UDP datagrams carried (for benchmarks)
    uplink: Uplink | None = None  # the sender's uplink, shared by all its links (set_uplink)

    def reserve(self, nbytes: int, now: float) -> float:
        """Queue ``nbytes`` behind what is on the wire; returns when their last byte leaves."""
        if self.uplink is not None:  # they leave the sender's uplink first
            now = self.uplink.reserve(nbytes, now)
        self.busy_until = max(now, self.busy_until) + nbytes / self.rate
        self.bytes_sent += nbytes
        return self.busy_until


@dataclass(frozen=True)
class WanNode:
    """An emulated host: the peer binds ``listen`` and announces ``announce``."""

    name: str
    listen: PeerAddress  # 127.0.0.x:P, the peer's real address
    announce: PeerAddress  # 127.0.1.x:P, the proxy in front of it

    @property
    def host(self) -> str:
        return self.listen.host


class WanEmulator:
    """TCP and UDP proxies with per-link delay and rate in front of loopback peers.

    Args:
        delays: one-way delay in seconds between regions, ``{(r1, r2): s}``; a pair given in one
            order serves both. Links between nodes of regions with no entry (or no region) and
            links from non-node addresses use ``default_delay``.
        default_delay: one-way delay of links that ``delays`` does not cover.
        rate: bytes per second of every new link (``math.inf``: unlimited).
        first_host: the first node gets ``127.0.0.<first_host>`` and ``127.0.1.<first_host>``.
        uplinks: shared with other processes' emulators of the same WAN (module docstring);
            UDP proxies then bind with ``SO_REUSEPORT``.
    """

    def __init__(
        self,
        *,
        delays: Mapping[tuple[str, str], float] | None = None,
        default_delay: float = 0.0,
        rate: float = math.inf,
        first_host: int = 10,
        uplinks: SharedUplinks | None = None,
    ):
        self.shared = uplinks
        self.delays = dict(delays or {})
        self.default_delay = default_delay
        self.rate = rate
        self.nodes: dict[str, WanNode] = {}
        self._next_host = first_host
        self._region: dict[str, str | None] = {}  # node host -> region
        self._by_listen: dict[Addr, WanNode] = {}
        self._links: dict[tuple[str, str], Link] = {}
        self._uplinks: dict[str, Uplink] = {}  # node host -> its uplink (set_uplink)
        self._udp: dict[str, UdpSocket] = {}  # node name -> its proxy socket
        self._relays: dict[tuple[Addr, str], UdpSocket] = {}
        self._servers: list[asyncio.Server] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._timers: set[asyncio.TimerHandle] = set()
        self._resets: dict[str, tuple[bytes, int]] = {}  # node name -> (marker, resets left)
        self.resets = 0  # connections reset so far

    async def __aenter__(self) -> WanEmulator:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def add_node(self, name: str, *, region: str | None = None) -> WanNode:
        """A new host with its proxies listening; start the peer on ``listen``/``announce``."""
        if name in self.nodes or self._next_host > 254:
            raise ValueError(f"node {name!r} exists or no loopback host is left")
        index, self._next_host = self._next_host, self._next_host + 1
        listen_host, announce_host = f"{LISTEN_PREFIX}{index}", f"{ANNOUNCE_PREFIX}{index}"
        tcp, udp, port = bind_pair(announce_host, listen_host, self.shared is not None)
        node = WanNode(name, PeerAddress(listen_host, port), PeerAddress(announce_host, port))
        self.nodes[name], self._by_listen[(listen_host, port)] = node, node
        self._region[listen_host] = region
        self._udp[name] = UdpSocket(udp, lambda data, addr: self._on_datagram(node, data, addr))
        server = await asyncio.start_server(
            lambda r, w: self._on_connection(node, r, w), sock=tcp, limit=CHUNK_BYTES
        )
        self._servers.append(server)
        logger.debug("wan node %s: %s behind %s", name, node.listen, node.announce)
        return node

    def add_remote(self, node: WanNode, *, region: str | None = None) -> None:
        """Another process's node (its emulator took ``node``'s addresses): bytes from and to
        it take its region's delays and its shared uplink, and this process can send datagrams
        as its proxy."""
        if self.shared is None:
            raise ValueError("remote nodes need SharedUplinks")
        self._by_listen[(node.listen.host, node.listen.port)] = node
        self._region[node.host] = region
        self._uplinks[node.host] = self.shared.of(node.host)
        udp = reuse_port_socket(socket.SOCK_DGRAM)
        udp.bind((node.announce.host, node.announce.port))
        self._udp[node.name] = UdpSocket(udp, lambda d, a: self._on_datagram(node, d, a))

    def link(self, src: WanNode | str, dst: WanNode | str) -> Link:
        """The directed link ``src -> dst`` (nodes or hosts), created on first use."""
        key = (_host(src), _host(dst))
        if key not in self._links:
            link = Link(self._region_delay(*key), self.rate, uplink=self._uplinks.get(key[0]))
            self._links[key] = link
        return self._links[key]

    def set_link(
        self,
        src: WanNode,
        dst: WanNode,
        *,
        delay: float | None = None,
        rate: float | None = None,
        both_ways: bool = True,
    ) -> None:
        """Override delay and/or rate of ``src -> dst`` (and ``dst -> src`` if ``both_ways``)."""
        for a, b in ((src, dst), (dst, src)) if both_ways else ((src, dst),):
            link = self.link(a, b)
            link.delay = link.delay if delay is None else delay
            link.rate = link.rate if rate is None else rate

    def datagrams(self) -> int:
        """UDP datagrams carried so far, over every link."""
        return sum(link.datagrams for link in self._links.values())

    def set_uplink(self, node: WanNode, rate: float) -> None:
        """Give ``node`` one uplink of ``rate`` bytes per second that all its outgoing links
        share (a home connection), on top of each link's own rate and delay."""
        if node.host not in self._uplinks:
            shared = self.shared.of(node.host) if self.shared is not None else None
            self._uplinks[node.host] = shared or Link()
        uplink = self._uplinks[node.host]
        uplink.rate = rate
        for (src, _), link in self._links.items():
            if src == node.host:
                link.uplink = uplink

    def move(self, node: WanNode, region: str | None) -> None:
        """Put ``node`` in ``region``: the delays of all its links follow (overrides are lost)."""
        self._region[node.host] = region
        for (src, dst), link in self._links.items():
            if node.host in (src, dst):
                link.delay = self._region_delay(src, dst)

    def reset_requests(self, node: WanNode, marker: bytes, count: int = 1) -> None:
        """Reset (TCP RST, both ways) the connection of each of the next ``count`` requests to
        ``node`` whose bytes contain ``marker`` (e.g. ``b"POST /stream/avg.part"``), before
        anything of it reaches the node: a middlebox, or a peer closing a kept-alive
        connection as its caller reuses it."""
        self._resets[node.name] = (marker, count)

    def _resets_now(self, node: WanNode, data: bytes) -> bool:
        marker, left = self._resets.get(node.name, (b"", 0))
        if left <= 0 or marker not in data:
            return False
        self._resets[node.name] = (marker, left - 1)
        self.resets += 1
        return True

    def expected_rtt(self, a: WanNode, b: WanNode) -> float:
        """The RTT that the links alone add between ``a`` and ``b`` (no queueing)."""
        return self.link(a, b).delay + self.link(b, a).delay

    async def close(self) -> None:
        """Stop the proxies and cut every connection and pending datagram."""
        for server in self._servers:
            server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for server in self._servers:
            await server.wait_closed()
        for timer in self._timers:
            timer.cancel()
        for sock in [*self._udp.values(), *self._relays.values()]:
            sock.close()
        self._servers.clear()
        self._timers.clear()
        self._udp.clear()
        self._relays.clear()

    def _region_delay(self, src: str, dst: str) -> float:
        a, b = self._region.get(src), self._region.get(dst)
        if a is None or b is None:
            return self.default_delay
        return self.delays.get((a, b), self.delays.get((b, a), self.default_delay))

    # ---- TCP

    def _on_connection(
        self, node: WanNode, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        # our own task, not the server's handler task: cancelling that one on close makes
        # asyncio (3.11) log the cancellation as an error
        task = asyncio.create_task(self._forward(node, reader, writer), name="wan-tcp")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _forward(
        self, node: WanNode, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        src = writer.get_extra_info("peername")[0]
        up_writer: asyncio.StreamWriter | None = None
        try:
            local = (src, 0) if src.startswith("127.") else None
            up_reader, up_writer = await asyncio.open_connection(
                node.host, node.listen.port, local_addr=local, limit=CHUNK_BYTES
            )
            await first_error(
                self._pump(reader, up_writer, self.link(src, node), node),
                self._pump(up_reader, writer, self.link(node, src)),
            )
        except _Reset:
            for w in (writer, up_writer):
                w.get_extra_info("socket").setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                w.transport.abort()
        except (OSError, asyncio.IncompleteReadError) as e:
            logger.debug("wan connection %s -> %s ended: %s", src, node.name, e)
        finally:
            for w in (writer, up_writer):
                if w is not None:
                    w.close()

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        link: Link,
        to: WanNode | None = None,
    ) -> None:
        """Bytes of one direction over ``link``; ``to``: the node they go to (requests, which
        :meth:`reset_requests` may reset)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(MAX_TCP_INFLIGHT)

        async def transmit() -> None:
            while True:
                data = await reader.read(CHUNK_BYTES)
                if to is not None and self._resets_now(to, data):
                    raise _Reset
                sent = link.reserve(len(data), loop.time())
                await asyncio.sleep(max(0.0, sent - loop.time()))  # the wire is busy
                await queue.put((sent + link.delay, data))
                if not data:
                    return

        async def deliver() -> None:
            last = 0.0
            while True:
                at, data = await queue.get()
                last = max(last, at)  # keep the byte order when the delay shrinks
                await asyncio.sleep(max(0.0, last - loop.time()))
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()

        await first_error(transmit(), deliver())

    # ---- UDP

    def _on_datagram(self, dst: WanNode, data: bytes, addr: Addr) -> None:
        src = self._by_listen.get(addr)
        if src is not None:  # a node: send from its proxy, so dst sees its announce address
            self._send_later(self.link(src, dst), self._udp[src.name], data, dst.listen)
            return
        relay = self._relays.get((addr, dst.name))
        if relay is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind((addr[0] if addr[0].startswith("127.") else "127.0.0.1", 0))

            def back(data: bytes, frm: Addr) -> None:
                if frm == (dst.host, dst.listen.port):  # only dst may answer through the relay
                    self._send_later(self.link(dst, addr[0]), self._udp[dst.name], data, addr)

            relay = self._relays[(addr, dst.name)] = UdpSocket(sock, back)
        self._send_later(self.link(addr[0], dst), relay, data, dst.listen)

    def _send_later(self, link: Link, out: UdpSocket, data: bytes, to: PeerAddress | Addr) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        if link.busy_until - now > MAX_UDP_QUEUE_S:
            logger.debug("udp datagram dropped: the link queue is full")
            return
        target = (to.host, to.port) if isinstance(to, PeerAddress) else to

        def send() -> None:
            self._timers.discard(timer)
            out.sendto(data, target)

        link.datagrams += 1
        timer = loop.call_at(link.reserve(len(data), now) + link.delay, send)
        self._timers.add(timer)


class _Reset(Exception):
    """A connection to reset (:meth:`WanEmulator.reset_requests`)."""


def _host(x: WanNode | str) -> str:
    return x.host if isinstance(x, WanNode) else x
