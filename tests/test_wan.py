"""The test-side WAN emulator (tests/wan.py) on real loopback sockets.

Timing assertions are one-sided or generous: a loaded CI machine may add delay, never remove it.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator

import pytest
from wan import WanEmulator, WanNode
from wan_uplinks import SharedUplinks

from swarm.auth import Membership
from swarm.identity import Identity
from swarm.net.transport import Transport

SLACK = 0.2  # seconds a busy machine may add to an exchange
EARLY = 0.002  # timers may fire a little early relative to another clock


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


async def _tcp_to(src: WanNode, dst: WanNode) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Dial ``dst``'s proxy from ``src``'s own address, as a peer's transport does."""
    return await asyncio.open_connection(
        dst.announce.host, dst.announce.port, local_addr=(src.host, 0)
    )


async def _tcp_rtt(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> float:
    start = time.perf_counter()
    writer.write(b"ping")
    await writer.drain()
    assert await reader.readexactly(4) == b"ping"
    return time.perf_counter() - start


@pytest.fixture
async def echo_pair() -> AsyncIterator[tuple[WanEmulator, WanNode, WanNode]]:
    """Nodes eu and us; an echo server on us's real address."""
    async with WanEmulator(delays={("eu", "eu"): 0.005, ("eu", "us"): 0.030}) as wan:
        a = await wan.add_node("a", region="eu")
        b = await wan.add_node("b", region="us")
        server = await asyncio.start_server(_echo, b.listen.host, b.listen.port)
        try:
            yield wan, a, b
        finally:
            server.close()


async def test_tcp_rtt_is_twice_the_one_way_delay(echo_pair) -> None:
    wan, a, b = echo_pair
    assert wan.expected_rtt(a, b) == pytest.approx(0.060)
    reader, writer = await _tcp_to(a, b)
    try:
        rtts = [await _tcp_rtt(reader, writer) for _ in range(3)]
    finally:
        writer.close()
    assert min(rtts) >= 0.060 - EARLY and max(rtts) < 0.060 + SLACK


async def test_delay_changes_at_run_time(echo_pair) -> None:
    wan, a, b = echo_pair
    reader, writer = await _tcp_to(a, b)
    try:
        far = await _tcp_rtt(reader, writer)
        wan.move(b, "eu")  # b moves next to a: the open connection speeds up
        near = await _tcp_rtt(reader, writer)
        wan.set_link(a, b, delay=0.040, both_ways=False)  # asymmetric: 40 ms there, 5 back
        asymmetric = await _tcp_rtt(reader, writer)
    finally:
        writer.close()
    assert far >= 0.060 - EARLY
    assert 0.010 - EARLY <= near < 0.010 + SLACK and near < far
    assert 0.045 - EARLY <= asymmetric < 0.045 + SLACK


async def test_tcp_throughput_follows_the_rate() -> None:
    rate, size = 2_000_000.0, 1 << 20  # ~0.5 s
    all_received = asyncio.get_running_loop().create_future()
    total = 0

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal total
        while data := await reader.read(65536):
            total += len(data)
            if total == size:
                all_received.set_result(time.perf_counter())
        writer.close()

    async with WanEmulator(default_delay=0.010) as wan:
        a, b = await wan.add_node("a"), await wan.add_node("b")
        wan.set_link(a, b, rate=rate, both_ways=False)
        server = await asyncio.start_server(sink, b.listen.host, b.listen.port)
        writers = []
        try:
            start = time.perf_counter()
            for part in (size // 2, size - size // 2):  # two connections share the link's rate
                _, writer = await _tcp_to(a, b)
                writer.write(bytes(part))
                writers.append(writer)
            elapsed = await asyncio.wait_for(all_received, 10) - start
        finally:
            for writer in writers:
                writer.close()
            server.close()
        assert wan.link(a, b).bytes_sent == size
    ideal = size / rate + 0.010
    assert ideal - EARLY <= elapsed < 1.2 * ideal + SLACK


async def _udp(host: str, port: int = 0) -> tuple[asyncio.DatagramTransport, asyncio.Queue]:
    queue: asyncio.Queue[tuple[bytes, tuple[str, int]]] = asyncio.Queue()

    class Receiver(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
            queue.put_nowait((data, addr[:2]))

    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
        Receiver, local_addr=(host, port)
    )
    return transport, queue


async def test_udp_between_nodes_uses_announce_addresses() -> None:
    async with WanEmulator(default_delay=0.025) as wan:
        a, b = await wan.add_node("a"), await wan.add_node("b")
        sock_a, inbox_a = await _udp(a.host, a.listen.port)  # as a DHT node binds its address
        sock_b, inbox_b = await _udp(b.host, b.listen.port)
        try:
            start = time.perf_counter()
            sock_a.sendto(b"ping", (b.announce.host, b.announce.port))
            data, sender = await asyncio.wait_for(inbox_b.get(), 5)
            assert data == b"ping" and sender == (a.announce.host, a.announce.port)
            sock_b.sendto(b"pong", sender)  # the reply goes through a's proxy
            data, sender = await asyncio.wait_for(inbox_a.get(), 5)
            rtt = time.perf_counter() - start
            assert data == b"pong" and sender == (b.announce.host, b.announce.port)
        finally:
            sock_a.close()
            sock_b.close()
    assert 0.050 - EARLY <= rtt < 0.050 + SLACK


async def test_udp_from_a_stranger_socket_gets_its_replies() -> None:
    async with WanEmulator(default_delay=0.010) as wan:
        b = await wan.add_node("b")
        sock_b, inbox_b = await _udp(b.host, b.listen.port)
        client, inbox = await _udp("127.0.0.1")  # no node: relayed
        try:
            for i in range(2):
                client.sendto(b"hi %d" % i, (b.announce.host, b.announce.port))
                data, sender = await asyncio.wait_for(inbox_b.get(), 5)
                sock_b.sendto(data.upper(), sender)
                assert await asyncio.wait_for(inbox.get(), 5) == (
                    b"HI %d" % i,
                    (b.announce.host, b.announce.port),
                )
        finally:
            client.close()
            sock_b.close()


@pytest.mark.skipif(not hasattr(socket, "SO_REUSEPORT"), reason="needs SO_REUSEPORT")
async def test_emulators_of_one_wan_share_uplinks_and_proxy_addresses() -> None:
    """Two emulators (as two processes would run them): a host's bytes to nodes of both share
    its one uplink, and datagrams between their nodes carry the proxies' addresses."""
    rate, size = 2_000_000.0, 1 << 19  # two ~0.26 s transfers on one uplink: ~0.52 s
    uplinks = SharedUplinks()
    first = WanEmulator(default_delay=0.010, uplinks=uplinks, first_host=10)
    second = WanEmulator(default_delay=0.010, uplinks=uplinks, first_host=20)
    async with first, second:
        a, c = await first.add_node("a"), await first.add_node("c")
        b = await second.add_node("b")
        second.add_remote(a)
        second.add_remote(c)
        first.add_remote(b)
        first.set_uplink(a, rate)
        sock_a, inbox_a = await _udp(a.host, a.listen.port)
        sock_b, inbox_b = await _udp(b.host, b.listen.port)
        received: dict[str, asyncio.Future[float]] = {}

        def sink(name: str):
            received[name] = asyncio.get_running_loop().create_future()

            async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                total = 0
                while data := await reader.read(65536):
                    total += len(data)
                    if total == size:
                        received[name].set_result(time.perf_counter())
                writer.close()

            return serve

        servers = [
            await asyncio.start_server(sink(n.name), n.listen.host, n.listen.port) for n in (b, c)
        ]
        writers = []
        try:
            sock_a.sendto(b"ping", (b.announce.host, b.announce.port))
            data, sender = await asyncio.wait_for(inbox_b.get(), 5)
            assert data == b"ping" and sender == (a.announce.host, a.announce.port)
            sock_b.sendto(b"pong", sender)
            data, sender = await asyncio.wait_for(inbox_a.get(), 5)
            assert data == b"pong" and sender == (b.announce.host, b.announce.port)
            start = time.perf_counter()
            for node in (b, c):  # b's proxy runs in the second emulator, c's in the first
                _, writer = await _tcp_to(a, node)
                writer.write(bytes(size))
                writers.append(writer)
            done = await asyncio.wait_for(asyncio.gather(*received.values()), 10)
        finally:
            for writer in writers:
                writer.close()
            for server in servers:
                server.close()
            sock_a.close()
            sock_b.close()
    ideal = 2 * size / rate + 0.010  # (each alone: half that)
    assert ideal - EARLY <= max(done) - start < 1.2 * ideal + SLACK


async def test_swarm_transports_ping_through_the_emulator() -> None:
    """The product code as is: listen on the node's address, announce the proxy."""
    async with WanEmulator(delays={("eu", "us"): 0.020}) as wan:
        nodes = [await wan.add_node("a", region="eu"), await wan.add_node("b", region="us")]
        transports = [
            Transport(
                Identity.generate(),
                Membership.open(),
                run_id="wan",
                listen=n.listen,
                announce=n.announce,
            )
            for n in nodes
        ]
        for t in transports:
            await t.start()
        try:
            assert transports[1].record().address == nodes[1].announce
            await transports[0].ping(nodes[1].announce)  # connect, then measure on the reuse
            rtt = min([await transports[0].ping(nodes[1].announce) for _ in range(3)])
        finally:
            for t in transports:
                await t.close()
    assert 0.040 - EARLY <= rtt < 0.040 + SLACK


async def test_close_stops_the_proxies(echo_pair) -> None:
    wan, a, b = echo_pair
    reader, writer = await _tcp_to(a, b)
    await _tcp_rtt(reader, writer)
    await wan.close()
    assert await asyncio.wait_for(reader.read(), 5) == b""  # the open connection is cut
    writer.close()
    with pytest.raises(OSError):
        await _tcp_to(a, b)
