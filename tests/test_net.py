"""The authenticated transport on real loopback sockets (addresses and peer records:
tests/test_peer_records.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hashlib
import logging
import os
import struct
import weakref
from collections.abc import AsyncIterator, Callable

import aiohttp
import msgpack
import pytest
from tcp_proxy import TcpProxy

from swarm.address import PeerAddress
from swarm.auth import AUTH_HEADER, Membership, RequestAuth, derive_stream_key
from swarm.errors import AuthError, TransportError
from swarm.identity import Identity
from swarm.net import wire
from swarm.net.confidential import open_reply
from swarm.net.frames import DATA, END, HEADER, TO_SERVER, Sealer, make_aead
from swarm.net.record import PeerRecord
from swarm.net.streams import MAX_HEADER_BYTES, InboundStream, ReplyStream
from swarm.net.transport import Transport

KEY = Membership.with_key("the swarm key of the tests")
MiB = 1 << 20

# ---- transport fixtures


async def _started(host: str, membership: Membership = KEY, **kw: object) -> Transport:
    transport = Transport(
        Identity.generate(), membership, run_id="run", listen=PeerAddress(host, 0), **kw
    )  # type: ignore[arg-type]
    await transport.start()
    return transport


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Transport, Transport]]:
    a, b = await _started("127.0.0.2"), await _started("127.0.0.3")
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


@pytest.fixture
async def raw() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def _headers(
    identity: Identity, membership: Membership, target: bytes, method: str, path: str
) -> dict:
    auth = RequestAuth.create(
        identity, membership, target=target, method=method, path=path, cipher="aes-256-gcm"
    )
    return {AUTH_HEADER: auth.encode()}


async def _blob_chunks(blob: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(blob), size):
        yield blob[start : start + size]


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield b""


class Applied:
    """A handler that 'applies' each verified chunk as it arrives, and commits at the end."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.committed = False
        self.error: BaseException | None = None
        self.sender_host = ""

    async def __call__(self, request: InboundStream, reply: ReplyStream) -> None:
        self.sender_host = request.sender.host
        try:
            async for chunk in request:
                self.chunks.append(chunk)
        except (AuthError, TransportError) as e:
            self.error = e
            raise
        self.committed = True
        data = b"".join(self.chunks)
        await reply.prepare({"sha256": hashlib.sha256(data).hexdigest(), "n": len(data)})


# ---- transport: happy paths


async def test_ping_info_call_and_bound_port(pair: tuple[Transport, Transport]) -> None:
    a, b = pair
    assert b.bound_address is not None and b.bound_address.port != 0
    assert b.record().address == b.bound_address and b.port == b.bound_address.port
    assert await a.ping(b.bound_address) > 0
    info = await a.fetch_info(b.bound_address)
    assert info == b.record() and info.peer_id == b.identity.peer_id

    async def hello(sender, payload):  # type: ignore[no-untyped-def]
        return {"echo": payload, "from": str(sender.peer_id), "host": sender.host}

    b.add_rpc("hello", hello)
    answer = await a.call(b.record(), "hello", {"x": [1, 2.5, "three", b"4"]}, timeout=30)
    assert answer == {
        "echo": {"x": [1, 2.5, "three", b"4"]},
        "from": str(a.identity.peer_id),
        "host": "127.0.0.2",
    }
    updated = b.update_record(extra={"step": 7})
    assert (await a.fetch_info(b.bound_address)).extra == {"step": 7} == updated.extra


async def test_64mib_stream_from_listen_address(pair: tuple[Transport, Transport]) -> None:
    a, b = pair
    applied = Applied()
    b.add_stream("sink", applied)
    blob = os.urandom(64 * MiB)
    async with a.stream(
        b.record(), "sink", {"round": 1}, _blob_chunks(blob, 4 * MiB), timeout=60
    ) as s:
        assert s.header == {"sha256": hashlib.sha256(blob).hexdigest(), "n": len(blob)}
        assert [c async for c in s] == []
    assert applied.committed and applied.sender_host == "127.0.0.2"
    assert max(len(c) for c in applied.chunks) <= a.max_chunk_bytes


@pytest.mark.parametrize("cipher", ["aes-256-gcm", "chacha20-poly1305"])
async def test_reply_stream_and_cipher_choice(cipher: str) -> None:
    a, b = await _started("127.0.0.2", cipher=cipher), await _started("127.0.0.3")
    try:

        async def double(request: InboundStream, reply: ReplyStream) -> None:
            await reply.prepare({"ok": True})
            async for chunk in request:
                await reply.write(chunk * 2)

        b.add_stream("double", double)
        async with a.stream(
            b.record(), "double", {}, _blob_chunks(b"ab" * 50_000, 1000), timeout=30
        ) as s:
            assert s.header == {"ok": True}
            assert b"".join([c async for c in s]) == (b"ab" * 500) * 2 * 100
    finally:
        await a.close()
        await b.close()


async def test_reply_flows_before_the_request_ends_and_its_trailer_comes_last(
    pair: tuple[Transport, Transport],
) -> None:
    """Full duplex: each chunk is answered while the client is still sending the next one."""
    a, b = pair
    answered = asyncio.Event()

    async def echo(request: InboundStream, reply: ReplyStream) -> None:
        await reply.prepare({"ok": True})
        count = 0
        async for chunk in request:
            await reply.write(chunk.upper())
            count += 1
        reply.set_trailer({"count": count})

    async def chunks() -> AsyncIterator[bytes]:
        yield b"first"
        await asyncio.wait_for(answered.wait(), 10)  # the reply arrives before the body ends
        yield b"second"

    b.add_stream("echo", echo)
    async with a.stream(b.record(), "echo", {}, chunks(), timeout=30) as s:
        got = []
        async for chunk in s:
            got.append(chunk)
            assert s.trailer == {}  # not before the end
            answered.set()
    assert got == [b"FIRST", b"SECOND"] and s.trailer == {"count": 2}
    with pytest.raises(TransportError):
        ReplyStream(None, None).set_trailer({"big": b"x" * (MAX_HEADER_BYTES + 1)})  # type: ignore[arg-type]


async def test_a_reply_to_a_client_that_hung_up_fails_as_a_lost_connection(
    pair: tuple[Transport, Transport], caplog
) -> None:
    """Writes to a reply whose client left raise TransportError with ``lost`` (aiohttp's own
    ConnectionResetError reached the server's catch-all before, with a traceback at WARNING)."""
    a, b = pair
    failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

    async def keep_writing(reply: ReplyStream) -> None:
        try:
            while True:
                await reply.write(b"x" * 65536)
                await asyncio.sleep(0.01)
        except BaseException as e:  # what the test inspects
            failed.set_result(e)

    async def talker(request: InboundStream, reply: ReplyStream) -> None:
        await reply.prepare({})
        writer = asyncio.create_task(keep_writing(reply))
        await asyncio.shield(writer)  # the server cancels this handler when the client leaves

    b.add_stream("talker", talker)
    caplog.set_level(logging.INFO, logger="swarm.net")
    async with a.stream(b.record(), "talker", {}, _nothing(), timeout=30) as s:
        async for _ in s:
            break  # one chunk read, then the client hangs up
    error = await asyncio.wait_for(failed, 10)
    assert isinstance(error, TransportError) and error.lost, repr(error)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


@pytest.mark.parametrize("trailer", [wire.pack([1, 2]), b"\xc1", wire.pack({"x": b"y" * 70_000})])
async def test_malformed_trailer_is_an_error(pair: tuple[Transport, Transport], trailer) -> None:
    a, b = pair

    async def hostile(request: InboundStream, reply: ReplyStream) -> None:
        await reply.prepare({})
        await reply.write(b"data")
        reply._trailer = trailer  # what a hostile peer could seal into its END frame

    b.add_stream("hostile", hostile)
    with pytest.raises(TransportError):
        async with a.stream(b.record(), "hostile", {}, _nothing(), timeout=30) as s:
            assert [c async for c in s] == [b"data"]


async def test_many_concurrent_streams_both_ways_with_held_replies(
    pair: tuple[Transport, Transport],
) -> None:
    """Averaging-like: each handler holds its reply until every contribution arrived."""
    a, b = pair
    n = 6
    arrived = {id(t): 0 for t in pair}
    all_in = {id(t): asyncio.Event() for t in pair}

    def make(t: Transport) -> Callable:
        async def reduce(request: InboundStream, reply: ReplyStream) -> None:
            total = sum([len(c) async for c in request])
            arrived[id(t)] += 1
            if arrived[id(t)] == n:
                all_in[id(t)].set()
            await all_in[id(t)].wait()
            await reply.prepare({"total": total})
            await reply.write(b"r" * total)

        return reduce

    a.add_stream("reduce", make(a))
    b.add_stream("reduce", make(b))

    async def one(src: Transport, dst: Transport, size: int) -> int:
        async with src.stream(
            dst.record(), "reduce", {}, _blob_chunks(b"x" * size, 100_000), timeout=60
        ) as s:
            body = b"".join([c async for c in s])
            assert s.header == {"total": size} and len(body) == size
            return size

    jobs = [one(a, b, 300_000 + i) for i in range(n)] + [one(b, a, 200_000 + i) for i in range(n)]
    assert len(await asyncio.gather(*jobs)) == 2 * n


async def test_ipv6_loopback() -> None:
    try:
        a, b = await _started("::1"), await _started("::1")
    except TransportError as e:
        pytest.skip(f"no IPv6 loopback: {e}")
    try:
        assert str(b.bound_address).startswith("[::1]:")
        assert (await a.fetch_info(b.bound_address)).address == b.bound_address
    finally:
        await a.close()
        await b.close()


# ---- transport: refusals


async def test_wrong_swarm_key_refused_on_every_route(pair: tuple[Transport, Transport]) -> None:
    _, b = pair
    b.add_stream("sink", Applied())
    outsider = await _started("127.0.0.4", Membership.with_key("not the swarm key at all"))
    opener = await _started("127.0.0.4", Membership.open())
    try:
        for stranger in (outsider, opener):
            for coro in (stranger.ping(b.bound_address), stranger.fetch_info(b.bound_address)):
                with pytest.raises(TransportError) as e:
                    await coro
                assert e.value.status == 401
            with pytest.raises(TransportError) as e:
                async with stranger.stream(b.record(), "sink", {}, _nothing(), timeout=30):
                    pass
            assert e.value.status == 401
    finally:
        await outsider.close()
        await opener.close()


async def test_replayed_request_refused(
    pair: tuple[Transport, Transport], raw: aiohttp.ClientSession
) -> None:
    a, b = pair
    headers = _headers(a.identity, KEY, b"", "GET", "/info")
    url = b.bound_address.url + "/info"
    async with raw.get(url, headers=headers) as first:
        assert first.status == 200
        nonce = RequestAuth.decode(headers[AUTH_HEADER]).nonce
        body = open_reply(
            KEY,
            caller=a.identity.public_key,
            request_nonce=nonce,
            path="/info",
            body=await first.read(),
        )
        assert PeerRecord.parse(body) == b.record()
    async with raw.get(url, headers=headers) as again:
        assert again.status == 401
    stale = RequestAuth.create(
        a.identity,
        KEY,
        target=b"",
        method="GET",
        path="/ping",
        cipher="aes-256-gcm",
        timestamp=1_000_000.0,
    )
    async with raw.get(b.bound_address.url + "/ping", headers={AUTH_HEADER: stale.encode()}) as old:
        assert old.status == 401


async def test_request_for_another_peer_or_route_refused(
    pair: tuple[Transport, Transport], raw: aiohttp.ClientSession
) -> None:
    a, b = pair
    b.add_stream("sink", Applied())
    other = Identity.generate()
    for target, path, signed_path in [
        (other.peer_id.digest, "/ping", "/ping"),
        (b"", "/stream/sink", "/stream/sink"),  # streams must name their target
        (other.peer_id.digest, "/stream/sink", "/stream/sink"),
        (b.identity.peer_id.digest, "/info", "/ping"),  # signed for another route
    ]:
        method = "POST" if path.startswith("/stream") else "GET"
        headers = _headers(a.identity, KEY, target, method, signed_path)
        async with raw.request(method, b.bound_address.url + path, headers=headers, data=b"") as r:
            assert r.status == 401, (target, path)


async def test_unknown_routes_are_authenticated_first(
    pair: tuple[Transport, Transport], raw: aiohttp.ClientSession
) -> None:
    """Every path but /metrics answers strangers 401 before saying whether it exists."""
    a, b = pair
    url = b.bound_address.url
    for method, path, status in [
        ("GET", "/nowhere", 404),
        ("POST", "/ping", 405),
        ("GET", "/stream/sink", 405),
        ("POST", "/metrics", 405),
        ("HEAD", "/metrics", 405),
    ]:
        async with raw.request(method, url + path) as r:
            assert r.status == 401, (method, path)
        headers = _headers(a.identity, KEY, b.identity.peer_id.digest, method, path)
        async with raw.request(method, url + path, headers=headers, data=b"") as r:
            assert r.status == status, (method, path)


async def test_a_closed_transport_is_freed_after_serving_requests() -> None:
    """aiohttp caches middleware chains per (handler, app) in a module-level LRU of 1024
    entries: with the authentication as a middleware, every closed server stayed reachable from
    it, and with it the peer that owned it (a process that replaced peers grew by a peer's state
    per replacement: 22 MB per hour and peer in the 16-peer soak). A closed transport that
    served pings, record reads and streams is freed."""
    a, b = await _started("127.0.0.2"), await _started("127.0.0.3")
    try:
        b.add_stream("sink", Applied())
        assert await a.ping(b.bound_address) > 0
        assert await a.fetch_info(b.bound_address) == b.record()
        async with a.stream(b.record(), "sink", {}, _blob_chunks(b"z" * 1000, 100), timeout=30):
            pass
        served = weakref.ref(b)
    finally:
        await b.close()
        del b
    try:
        gc.collect()
        assert served() is None, [type(r).__name__ for r in gc.get_referrers(served())]
    finally:
        await a.close()


async def test_allow_list() -> None:
    member, stranger = Identity.generate(), Identity.generate()
    owner = Identity.generate()
    allow = Membership.allow_list([member.public_key, owner.public_key])
    b = Transport(owner, allow, run_id="run", listen="127.0.0.3:0")
    a = Transport(member, allow, run_id="run", listen="127.0.0.2:0")
    s = Transport(stranger, allow, run_id="run", listen="127.0.0.4:0")
    async with a, b, s:
        assert await a.ping(b.bound_address) > 0
        with pytest.raises(TransportError) as e:
            await s.ping(b.bound_address)
        assert e.value.status == 403
        b.add_stream("sink", Applied())
        with pytest.raises(TransportError) as e:
            async with s.stream(b.record(), "sink", {}, _nothing(), timeout=30):
                pass
        assert e.value.status == 403


async def test_hostile_headers_then_still_serving(
    pair: tuple[Transport, Transport], raw: aiohttp.ClientSession
) -> None:
    a, b = pair
    url = b.bound_address.url
    valid = _headers(a.identity, KEY, b"", "GET", "/ping")[AUTH_HEADER]
    hostile = [
        {},
        {AUTH_HEADER: ""},
        {AUTH_HEADER: "%%%junk%%%"},
        {AUTH_HEADER: "A" * 7000},
        {AUTH_HEADER: valid[:-7]},
        {AUTH_HEADER: valid + "AAAA"},
        {AUTH_HEADER: "kQ"},  # msgpack [None]
        {AUTH_HEADER: "3AAB"},  # msgpack map16 header, truncated
        {AUTH_HEADER: valid, "X-Extra": "x" * 9000},  # over aiohttp's header limit
    ]
    for headers in hostile:
        for path in ("/ping", "/info", "/stream/sink", "/nowhere"):
            method = "POST" if path.startswith("/stream") else "GET"
            try:
                async with raw.request(method, url + path, headers=headers) as r:
                    assert r.status in (400, 401), (headers.keys(), path, r.status)
            except aiohttp.ClientError:
                pass  # the server may just drop an absurd request; it must keep serving
    assert await a.ping(b.bound_address) > 0


def _sealed_body(
    a: Transport, b: Transport, auth: RequestAuth, frames: list[tuple[int, bytes]]
) -> bytes:
    key = derive_stream_key(
        a.identity,
        KEY,
        peer_public_key=b.identity.public_key,
        peer_agreement_key=b.identity.agreement_key,
        initiator=True,
        stream_id=auth.nonce,
        cipher=auth.cipher,
    )
    sealer = Sealer(make_aead(auth.cipher, key), auth.nonce, TO_SERVER)
    return b"".join(b"".join(sealer.seal(kind, data)) for kind, data in frames)


async def _raw_stream(
    raw: aiohttp.ClientSession,
    a: Transport,
    b: Transport,
    name: str,
    frames: list[tuple[int, bytes]],
    *,
    patch: Callable[[bytes], bytes] = lambda x: x,
) -> int:
    path = f"/stream/{name}"
    auth = RequestAuth.create(
        a.identity,
        KEY,
        target=b.identity.peer_id.digest,
        method="POST",
        path=path,
        cipher="aes-256-gcm",
    )
    body = patch(_sealed_body(a, b, auth, frames))
    async with raw.post(
        b.bound_address.url + path, headers={AUTH_HEADER: auth.encode()}, data=body
    ) as r:
        await r.read()
        return r.status


async def test_tampered_chunk_never_applied(
    pair: tuple[Transport, Transport], raw: aiohttp.ClientSession
) -> None:
    a, b = pair
    applied = Applied()
    b.add_stream("sink", applied)
    chunks = [bytes([i]) * 10_000 for i in range(5)]
    frames = [(HEADER, msgpack.packb({})), *((DATA, c) for c in chunks), (END, b"")]
    frame_len = 5 + 10_000 + 16
    first_data = 5 + len(msgpack.packb({})) + 16
    offset = first_data + 2 * frame_len + 5 + 1234  # a byte inside the third data chunk

    def flip(body: bytes) -> bytes:
        return body[:offset] + bytes([body[offset] ^ 0x40]) + body[offset + 1 :]

    assert await _raw_stream(raw, a, b, "sink", frames, patch=flip) == 401
    assert applied.chunks == chunks[:2] and not applied.committed
    assert isinstance(applied.error, AuthError)


async def test_tamper_in_flight_through_proxy(pair: tuple[Transport, Transport]) -> None:
    """A man in the middle flips one byte of the request body; the handler never applies it."""
    a, b = pair
    applied = Applied()
    b.add_stream("sink", applied)
    flip_at, seen = 600_000, [0]

    async def flip(data: bytes, writer: asyncio.StreamWriter) -> None:
        if seen[0] <= flip_at < seen[0] + len(data):
            i = flip_at - seen[0]
            data = data[:i] + bytes([data[i] ^ 1]) + data[i + 1 :]
        seen[0] += len(data)
        writer.write(data)

    async with TcpProxy(b.bound_address, up=flip) as address:
        via_proxy = dataclasses.replace(b.record(), address=address)
        blob = os.urandom(2 * MiB)
        with pytest.raises(TransportError) as e:
            async with a.stream(via_proxy, "sink", {}, _blob_chunks(blob, 100_000), timeout=30):
                pass
    assert e.value.status in (400, 401)
    assert not applied.committed
    assert b"".join(applied.chunks) == blob[: len(b"".join(applied.chunks))]
    assert sum(map(len, applied.chunks)) < flip_at


async def test_a_connection_stays_in_use_when_the_body_ends_after_the_reply(
    pair: tuple[Transport, Transport],
) -> None:
    """The HTTP body's last bytes (chunked encoding's end) reach the server after an RPC that
    answers at once has answered: the server waits for them instead of closing a connection
    its caller already holds again for its next request (which then met a reset)."""
    a, b = pair

    async def echo(sender: object, payload: dict) -> dict:
        return {"n": payload["n"]}

    b.add_rpc("echo", echo)
    last_chunk = b"0\r\n\r\n"

    async def hold_back_the_end(data: bytes, writer: asyncio.StreamWriter) -> None:
        if data.endswith(last_chunk):
            writer.write(data[: -len(last_chunk)])
            await writer.drain()
            await asyncio.sleep(0.2)
            data = last_chunk
        writer.write(data)

    proxy = TcpProxy(b.bound_address, up=hold_back_the_end)
    async with proxy as address:
        via_proxy = dataclasses.replace(b.record(), address=address)
        for n in range(4):
            assert await a.call(via_proxy, "echo", {"n": n}, timeout=10) == {"n": n}
            await asyncio.sleep(0.3)  # the held bytes went through: the server decided by now
    assert proxy.connections == 1


async def test_truncated_stream_detected(
    pair: tuple[Transport, Transport], raw: aiohttp.ClientSession
) -> None:
    a, b = pair
    applied = Applied()
    b.add_stream("sink", applied)
    frames = [(HEADER, msgpack.packb({})), (DATA, b"one"), (DATA, b"two")]  # no END frame
    assert await _raw_stream(raw, a, b, "sink", frames) == 401
    assert applied.chunks == [b"one", b"two"] and not applied.committed
    assert "truncated" in str(applied.error)


async def test_oversized_frame_and_stream_refused(raw: aiohttp.ClientSession) -> None:
    a = await _started("127.0.0.2")
    b = await _started("127.0.0.3", max_chunk_bytes=64 * 1024, max_stream_bytes=256 * 1024)
    try:
        applied = Applied()
        b.add_stream("sink", applied)
        huge_prefix = msgpack.packb({})
        frames = [(HEADER, huge_prefix), (DATA, b"x")]

        def oversize(body: bytes) -> bytes:  # a prefix announcing a 1 GiB frame, then nothing
            head = len(body) - (5 + 1 + 16)
            return body[:head] + struct.pack(">IB", 1 << 30, DATA)

        assert await _raw_stream(raw, a, b, "sink", frames, patch=oversize) == 413
        with pytest.raises(TransportError) as e:  # a client sending too much in total
            async with a.stream(
                b.record(), "sink", {}, _blob_chunks(b"y" * 300 * 1024, 50_000), timeout=30
            ):
                pass
        assert e.value.status == 413
        assert not applied.committed and sum(map(len, applied.chunks)) <= 256 * 1024
    finally:
        await a.close()
        await b.close()


async def test_handler_failure_is_an_error_not_a_short_stream(
    pair: tuple[Transport, Transport],
) -> None:
    a, b = pair

    async def fails_late(request: InboundStream, reply: ReplyStream) -> None:
        await reply.prepare({"ok": True})
        await reply.write(b"partial")
        raise RuntimeError("disk full")

    async def fails_early(request: InboundStream, reply: ReplyStream) -> None:
        raise RuntimeError("nope")

    b.add_stream("late", fails_late)
    b.add_stream("early", fails_early)
    got: list[bytes] = []
    with pytest.raises(TransportError, match="disk full"):
        async with a.stream(b.record(), "late", {}, _nothing(), timeout=30) as s:
            async for chunk in s:
                got.append(chunk)
    assert got == [b"partial"]
    with pytest.raises(TransportError) as e:
        async with a.stream(b.record(), "early", {}, _nothing(), timeout=30):
            pass
    assert e.value.status == 500
    with pytest.raises(TransportError) as e:
        async with a.stream(b.record(), "missing", {}, _nothing(), timeout=30):
            pass
    assert e.value.status == 404


async def test_caller_timeout_and_failing_body(pair: tuple[Transport, Transport]) -> None:
    a, b = pair
    held = asyncio.Event()
    cancelled = asyncio.Event()

    async def holds(request: InboundStream, reply: ReplyStream) -> None:
        held.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    b.add_stream("hold", holds)
    with pytest.raises(TransportError, match="timed out"):
        async with a.stream(b.record(), "hold", {}, _nothing(), timeout=0.5):
            pass
    assert held.is_set()
    await asyncio.wait_for(cancelled.wait(), 30)  # the server drops the handler when we hang up

    applied = Applied()
    b.add_stream("sink", applied)

    async def broken() -> AsyncIterator[bytes]:
        yield b"fine"
        raise ValueError("source failed")

    with pytest.raises(ValueError, match="source failed"):
        async with a.stream(b.record(), "sink", {}, broken(), timeout=30):
            pass
    assert not applied.committed


async def test_a_gone_peer_is_told_apart_from_a_slow_one() -> None:
    """A refused connection marks the error ``refused`` (the averager stops waiting for that
    peer at once); a timeout does not."""
    a, b = await _started("127.0.0.2"), await _started("127.0.0.3")
    try:

        async def holds(request: InboundStream, reply: ReplyStream) -> None:
            await asyncio.sleep(3600)

        b.add_stream("hold", holds)
        with pytest.raises(TransportError) as slow:
            async with a.stream(b.record(), "hold", {}, _nothing(), timeout=0.5):
                pass
        assert not slow.value.refused
        record = b.record()
        await b.close()
        with pytest.raises(TransportError) as gone:
            async with a.stream(record, "hold", {}, _nothing(), timeout=5):
                pass
        assert gone.value.refused, gone.value
    finally:
        await a.close()
