"""The HTTP server's limits against hostile clients on real loopback sockets: half-open and
slowloris connections, bodies after a refusal, stalled streams and partial frames.

Every attack is bounded in count and time; the server's timeouts are shortened for the test.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import time
from collections.abc import AsyncIterator, Callable

import msgpack
import pytest

from swarm.address import PeerAddress
from swarm.auth import AUTH_HEADER, Membership, RequestAuth, derive_stream_key
from swarm.errors import AuthError, ConfigError, TransportError
from swarm.identity import Identity
from swarm.net.buffers import FRAME_POOL, TRIM_DELAY_S, FramePool, HeapTrimmer
from swarm.net.connections import ConnectionLimits
from swarm.net.frames import DATA, END, HEADER, TO_SERVER, Sealer, make_aead
from swarm.net.limits import ByteBudget, StreamLimits, raise_descriptor_limit
from swarm.net.streams import InboundStream, ReplyStream
from swarm.net.transport import Transport

KEY = Membership.with_key("the swarm key of the tests")
MiB = 1 << 20


async def _started(host: str, **kw: object) -> Transport:
    transport = Transport(Identity.generate(), KEY, run_id="run", listen=PeerAddress(host, 0), **kw)  # type: ignore[arg-type]
    await transport.start()
    return transport


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """Whether the server closes the connection within ``seconds`` (reading what it sends)."""
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            data = await asyncio.wait_for(reader.read(65536), deadline - time.monotonic())
            if not data:
                return True
    except (asyncio.TimeoutError, TimeoutError):
        return False
    except ConnectionError:
        return True
    return False


class Holder:
    """A stream handler that reads until the stream fails, and records why."""

    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    async def __call__(self, request: InboundStream, reply: ReplyStream) -> None:
        try:
            async for _ in request:
                pass
        except (AuthError, TransportError) as e:
            self.errors.append(e)
            raise
        await reply.prepare({})


@pytest.fixture
async def server() -> AsyncIterator[Transport]:
    transport = await _started(
        "127.0.0.3",
        idle_timeout=1.0,
        max_connections_per_host=16,
        stream_limits=StreamLimits(idle_s=0.5, min_rate=4 * MiB, partial_frame_bytes=4 * MiB),
    )
    try:
        yield transport
    finally:
        await transport.close()


@pytest.fixture
async def client() -> AsyncIterator[Transport]:
    transport = await _started("127.0.0.4")
    try:
        yield transport
    finally:
        await transport.close()


async def test_half_open_connections_from_one_address_do_not_starve_others(
    server: Transport, client: Transport
) -> None:
    port = server.port
    attackers = []
    try:
        for _ in range(60):
            attackers.append(
                await asyncio.open_connection("127.0.0.3", port, local_addr=("127.0.0.2", 0))
            )
        await asyncio.sleep(0.1)
        assert server.connection_limits.total <= 16
        assert server.connection_limits.refused >= 44
        for _ in range(5):
            await client.ping(server.bound_address, timeout=5)
        # no request ever comes: every one is closed by the header (keep-alive) timeout
        closed = await asyncio.gather(*(_closed_within(r, 5.0) for r, _ in attackers))
        assert all(closed)
        await asyncio.sleep(0.1)
        assert server.connection_limits.total <= 1  # the client's own pooled connection
    finally:
        for _, writer in attackers:
            writer.close()


async def test_slowloris_headers_are_cut_off(server: Transport) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.3", server.port)
    try:
        writer.write(b"GET /ping HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        closed = False
        for i in range(40):  # one header byte every 0.1 s, for at most 4 s
            try:
                writer.write(b"X-a: %d\r\n" % i)
                await writer.drain()
            except ConnectionError:
                closed = True
                break
            if await _closed_within(reader, 0.1):
                closed = True
                break
        assert closed and time.monotonic() - started < 4.0
    finally:
        writer.close()


async def test_no_body_is_read_after_a_refusal(server: Transport) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.3", server.port)
    try:
        writer.write(
            b"POST /stream/sink HTTP/1.1\r\nHost: x\r\n"
            + AUTH_HEADER.encode()
            + b": junk\r\nContent-Length: %d\r\n\r\n" % (100 * MiB)
            + b"\0" * 65536
        )
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 5)
        assert b" 401 " in status
        assert await _closed_within(reader, 3.0)  # closed with 100 MiB still unsent
    finally:
        writer.close()


async def _stalled_stream(
    server: Transport, sender: Identity, partial_bytes: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """An authenticated stream: a header frame, then a 1 MiB data frame cut after
    ``partial_bytes``; then nothing."""
    path = "/stream/hold"
    auth = RequestAuth.create(
        sender,
        KEY,
        target=server.identity.peer_id.digest,
        method="POST",
        path=path,
        cipher="aes-256-gcm",
    )
    key = derive_stream_key(
        sender,
        KEY,
        peer_public_key=server.identity.public_key,
        peer_agreement_key=server.identity.agreement_key,
        initiator=True,
        stream_id=auth.nonce,
        cipher=auth.cipher,
    )
    sealer = Sealer(make_aead(auth.cipher, key), auth.nonce, TO_SERVER)
    header = b"".join(sealer.seal(HEADER, msgpack.packb({})))
    prefix, sealed = sealer.seal(DATA, bytes(MiB))
    body = header + prefix + sealed[:partial_bytes]
    reader, writer = await asyncio.open_connection("127.0.0.3", server.port)
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: x\r\n{AUTH_HEADER}: {auth.encode()}\r\n"
        f"Content-Length: {len(header) + len(prefix) + len(sealed)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    return reader, writer


async def test_stalled_streams_end_and_partial_frames_share_a_bounded_budget(
    server: Transport, client: Transport
) -> None:
    holder = Holder()
    server.add_stream("hold", holder)
    budget_seen = []
    streams = []
    try:
        for _ in range(12):  # 12 partial 1 MiB frames against a 4 MiB budget
            streams.append(await _stalled_stream(server, Identity.generate(), 512 * 1024))
        for _ in range(10):
            await asyncio.sleep(0.1)
            budget = server.stream_limits.budget
            budget_seen.append(budget.used if budget is not None else 0)
        await client.ping(server.bound_address, timeout=5)  # still serving
        closed = await asyncio.gather(*(_closed_within(r, 10.0) for r, _ in streams))
        assert all(closed)
    finally:
        for _, writer in streams:
            writer.close()
    assert max(budget_seen) <= 4 * MiB and max(budget_seen) > 0
    assert server.stream_limits.stalled == 12 and len(holder.errors) == 12
    assert server.stream_limits.budget is not None and server.stream_limits.budget.used == 0


async def test_byte_budget_waits_and_wakes() -> None:
    budget = ByteBudget(100, per_subnet=100, per_host=100)
    await budget.acquire(80)
    waiting = asyncio.ensure_future(budget.acquire(50))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    budget.release(80)
    await asyncio.wait_for(waiting, 1)
    assert budget.used == 50


def test_connection_limits_count_per_host_and_in_all() -> None:
    limits = ConnectionLimits(max_connections=1000, max_per_host=2)
    assert limits.admit(1, "10.0.0.1") and limits.admit(2, "10.0.0.1")
    assert not limits.admit(3, "10.0.0.1")
    assert limits.admit(4, "10.0.0.2")
    limits.table.release(1)
    assert limits.admit(5, "10.0.0.1") and limits.total == 3
    assert limits.max_connections <= raise_descriptor_limit()
    with pytest.raises(ConfigError):
        ConnectionLimits(max_per_host=0)
    with pytest.raises(ConfigError):
        StreamLimits(idle_s=0)


class Counter:
    """A stream handler that counts verified chunks and records why a stream failed."""

    def __init__(self) -> None:
        self.chunks = 0
        self.errors: list[BaseException] = []

    async def __call__(self, request: InboundStream, reply: ReplyStream) -> None:
        try:
            async for _ in request:
                self.chunks += 1
        except (AuthError, TransportError) as e:
            self.errors.append(e)
            raise
        await reply.prepare({"chunks": self.chunks})


async def _large_frames_stream(
    server: Transport, patch: Callable[[bytes], bytes], *, cut: bool = False
) -> bytes:
    """An authenticated stream of three 1 MiB data frames and its END, with ``patch`` applied
    to the body; with ``cut`` the connection closes after the patched body instead of sending
    the rest. Returns the status line (b"" when the server closed without an answer)."""
    sender, path = Identity.generate(), "/stream/count"
    auth = RequestAuth.create(
        sender,
        KEY,
        target=server.identity.peer_id.digest,
        method="POST",
        path=path,
        cipher="aes-256-gcm",
    )
    key = derive_stream_key(
        sender,
        KEY,
        peer_public_key=server.identity.public_key,
        peer_agreement_key=server.identity.agreement_key,
        initiator=True,
        stream_id=auth.nonce,
        cipher=auth.cipher,
    )
    sealer = Sealer(make_aead(auth.cipher, key), auth.nonce, TO_SERVER)
    frames = [(HEADER, msgpack.packb({}))] + [(DATA, os.urandom(MiB))] * 3 + [(END, b"")]
    full = b"".join(b"".join(sealer.seal(kind, data)) for kind, data in frames)
    body = patch(full)
    reader, writer = await asyncio.open_connection("127.0.0.3", server.port)
    try:
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: x\r\n{AUTH_HEADER}: {auth.encode()}\r\n"
            f"Content-Length: {len(full)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        if cut:
            writer.close()
        return await asyncio.wait_for(reader.readline(), 10)
    except ConnectionError:
        return b""
    finally:
        writer.close()


async def test_large_frames_tampered_or_cut_are_refused_and_their_buffers_go_back(
    server: Transport, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="swarm.net")  # a 500 names its cause
    counter = Counter()
    server.add_stream("count", counter)
    header_len = 5 + len(msgpack.packb({})) + 16
    inside_second = header_len + (5 + MiB + 16) + 5 + 1000

    def flip(body: bytes) -> bytes:
        return body[:inside_second] + bytes([body[inside_second] ^ 1]) + body[inside_second + 1 :]

    assert b" 200 " in await _large_frames_stream(server, lambda b: b)
    assert counter.chunks == 3 and not counter.errors
    status = await _large_frames_stream(server, flip)
    assert b" 401 " in status, (status, counter.errors, caplog.text)
    assert "failed authentication" in str(counter.errors[-1])
    assert counter.chunks == 3 + 1  # the first frame of the tampered stream, not the second
    await _large_frames_stream(server, lambda b: b[:inside_second], cut=True)
    for _ in range(50):  # the server notices the cut as the connection closes
        if len(counter.errors) == 2:
            break
        await asyncio.sleep(0.1)
    assert len(counter.errors) == 2  # a cut mid-frame is an error, never a short stream
    assert any(w in str(counter.errors[-1]) for w in ("truncated", "connection lost"))
    assert server.stream_limits.budget is not None and server.stream_limits.budget.used == 0
    assert FRAME_POOL.idle_bytes <= FRAME_POOL.max_idle_bytes
    assert b" 200 " in await _large_frames_stream(server, lambda b: b)  # buffers reusable


def test_frame_pool_reuses_buffers_up_to_its_cap_and_unmaps_the_rest() -> None:
    pool = FramePool(max_idle_bytes=3 * MiB)
    buffers = [pool.take(MiB + 16) for _ in range(4)]
    assert all(len(b) >= MiB + 16 and len(b) % mmap.PAGESIZE == 0 for b in buffers)
    for b in buffers:
        pool.give(b)
    assert pool.idle_bytes <= 3 * MiB and buffers[2].closed and buffers[3].closed
    again = pool.take(1000)  # the last given back that fits
    assert again is buffers[1] and not again.closed
    pool.give(again)
    pool.clear()
    assert pool.idle_bytes == 0 and all(b.closed for b in buffers)


async def test_heap_trimmer_trims_once_after_a_burst_of_failures() -> None:
    calls: list[int] = []
    trimmer = HeapTrimmer(lambda pad: calls.append(pad) or 1)
    for _ in range(100):  # a flood of cut frames within the delay
        trimmer.soon()
        await asyncio.sleep(0.005)
    for _ in range(100):
        if trimmer.trims:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(TRIM_DELAY_S * 1.5)
    assert calls == [0] and trimmer.trims == 1
    HeapTrimmer(None).soon()  # where the C library has no trim: nothing happens


async def test_byte_budget_forgets_sources_that_hold_nothing() -> None:
    budget = ByteBudget(1 << 20)
    for i in range(5000):  # sources churning through (ports, addresses): no state left behind
        source = f"10.{i // 256 % 256}.{i % 256}.1"
        await budget.acquire(1000, source)
        budget.release(1000, source)
    assert budget.used == 0 and not budget._hosts and not budget._subnets
