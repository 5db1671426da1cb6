"""Floods from many ports, addresses and streams against a real transport on loopback.

The attacker holds what it can from the loopback /24 ``127.0.9.0/24`` (its own host and
subnet, distinct from the honest ``127.0.0.x``): connections from 64 ports of one host, from
16 addresses of one /24, with and without proving its addresses first (free in an open
swarm), and 100 partial 1 MiB frames from 4 addresses. A legitimate authenticated ping must be
answered throughout, and memory must go back once the frames are released (measured in the
victim's own process). Every flood is bounded in count and time; nothing here asserts a
wall-clock duration (``benchmarks/hostile_net.py`` measures those).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgpack
import pytest
from processes import OutputProcess

from swarm.address import PeerAddress
from swarm.auth import AUTH_HEADER, Membership, RequestAuth, derive_stream_key
from swarm.identity import Identity
from swarm.net.frames import DATA, HEADER, TO_SERVER, Sealer, make_aead
from swarm.net.record import PeerRecord
from swarm.net.server import AUTH_BURST, AUTH_RATE, FAILED_AUTH_COST
from swarm.net.transport import Transport

OPEN = Membership.open()
VICTIM = "127.0.0.3"
HONEST = "127.0.0.5"  # the memory test's client
ATTACKERS = [f"127.0.9.{i}" for i in range(1, 17)]  # one /24, not the honest one
MiB = 1 << 20
REDIAL_S = 0.05  # how soon a flood task dials again after its connection was closed


async def _transport(host: str, **kw: object) -> Transport:
    transport = Transport(Identity.generate(), OPEN, run_id="t", listen=f"{host}:0", **kw)  # type: ignore[arg-type]
    await transport.start()
    return transport


class ConnectionFlood:
    """``tasks`` holders, each keeping one idle connection from its source open and dialing
    again whenever the victim closes it (refused or evicted), at most ``max_dials`` in all."""

    def __init__(self, port: int, sources: list[str], max_dials: int = 20_000):
        self.port = port
        self.sources = sources
        self.max_dials = max_dials
        self.dials = 0
        self.closed_by_victim = 0
        self._tasks: list[asyncio.Task[None]] = []

    async def _hold(self, source: str) -> None:
        while self.dials < self.max_dials:
            self.dials += 1
            try:
                reader, writer = await asyncio.open_connection(
                    VICTIM, self.port, local_addr=(source, 0)
                )
            except OSError:
                await asyncio.sleep(REDIAL_S)
                continue
            try:
                await reader.read()  # b"" or a reset: the victim closed it
            except ConnectionError:
                pass
            finally:
                writer.close()
            self.closed_by_victim += 1
            await asyncio.sleep(REDIAL_S)

    async def __aenter__(self) -> ConnectionFlood:
        self._tasks = [asyncio.create_task(self._hold(s)) for s in self.sources]
        await asyncio.sleep(1.0)  # every holder dialed, the refused ones dial again
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _until(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` (the flood refilling the room) for at most 10 s."""
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never saw: {what}")


async def _fresh_ping(victim: Transport, host: str) -> None:
    """An authenticated ping from ``host``, which the victim must never have seen: unproved,
    in the honest /24."""
    assert not victim.connection_limits.proofs.proved(host)
    client = await _transport(host)
    try:
        await client.ping(victim.bound_address, timeout=10)
    finally:
        await client.close()


@pytest.fixture
async def victim() -> AsyncIterator[Transport]:
    # a small table: 48 slots (12 kept for proved hosts), 8 per host, 64 per subnet
    transport = await _transport(VICTIM, max_connections=48, max_connections_per_host=8)
    try:
        yield transport
    finally:
        await transport.close()


async def test_connections_from_64_ports_of_one_host_leave_room(victim: Transport) -> None:
    limits = victim.connection_limits
    proved_peer = await _transport("127.0.0.6")
    try:
        await proved_peer.ping(victim.bound_address, timeout=10)  # proves 127.0.0.6
        async with ConnectionFlood(victim.port, [ATTACKERS[0]] * 64) as flood:
            held = limits.table.held_by
            await _until(lambda: held(ATTACKERS[0])[0] >= 8, "the host's quota held")
            assert held(ATTACKERS[0]) == (8, 8) and limits.refused >= 56  # its quota, no more
            for i in range(3):
                await _fresh_ping(victim, f"127.0.0.{10 + i}")
                await proved_peer.ping(victim.bound_address, timeout=10)
            assert flood.dials > 64
    finally:
        await proved_peer.close()


async def test_connections_from_16_addresses_of_one_subnet_cannot_shut_others_out(
    victim: Transport,
) -> None:
    limits = victim.connection_limits
    async with ConnectionFlood(victim.port, [a for a in ATTACKERS for _ in range(4)]) as flood:
        # 64 holders against 36 unproved slots: the attacker holds all the unproved room
        evicted = limits.evicted
        for i in range(5):
            await _until(lambda: limits.table.unproved == 36, "the unproved room full")
            await _fresh_ping(victim, f"127.0.0.{10 + i}")
        assert limits.evicted >= evicted + 5  # each ping took an attacker's idle slot
        assert limits.refused > 0
        assert flood.closed_by_victim > 0


async def test_an_attacker_that_proved_its_addresses_cannot_fill_the_table(
    victim: Transport,
) -> None:
    limits = victim.connection_limits
    for address in ATTACKERS:  # an open swarm: an authenticated ping is free to anyone
        prover = await _transport(address)
        await prover.ping(victim.bound_address, timeout=10)
        await prover.close()
    async with ConnectionFlood(victim.port, [a for a in ATTACKERS for _ in range(4)]):
        evicted = limits.evicted
        for i in range(5):
            await _until(lambda: limits.total == 48, "the whole table full")
            assert limits.table.unproved == 0  # every attacker connection counts as proved
            await _fresh_ping(victim, f"127.0.0.{10 + i}")
        assert limits.evicted >= evicted + 5


async def test_honest_peers_of_one_subnet_are_never_refused() -> None:
    """Twelve peers on 127.0.0.x (one /24, as loopback swarms run) talk to one peer at once:
    pings, RPCs and 4 MiB streams, with the default limits. Nothing is refused or evicted."""
    victim = await _transport("127.0.0.20")

    async def sink(request, reply) -> None:  # type: ignore[no-untyped-def]
        received = sum([len(c) async for c in request])
        await reply.prepare({"received": received})

    victim.add_stream("sink", sink)
    victim.add_rpc("echo", lambda sender, payload: _echo(payload))
    peers = [await _transport(f"127.0.0.{21 + i}") for i in range(12)]
    blob = os.urandom(4 * MiB)

    async def one_round(peer: Transport) -> None:
        await peer.ping(victim.bound_address, timeout=30)
        assert await peer.call(victim.record(), "echo", {"x": 1}, timeout=30) == {"x": 1}
        async with peer.stream(victim.record(), "sink", {}, _chunks(blob), timeout=30) as s:
            assert s.header == {"received": len(blob)}

    try:
        for _ in range(3):
            await asyncio.gather(*(one_round(p) for p in peers))
        assert victim.connection_limits.refused == 0 and victim.connection_limits.evicted == 0
        assert not victim.refused
    finally:
        await asyncio.gather(*(p.close() for p in [*peers, victim]))


async def _echo(payload: dict) -> dict:
    return payload


async def _chunks(blob: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(blob), MiB):
        yield blob[start : start + MiB]


# ---- memory: held partial frames, measured in the victim's own process


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MiB


async def _held_partial_frame(
    record: PeerRecord, source: str, sent: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """An authenticated stream to ``sink``: its header, then the first ``sent`` bytes of a
    1 MiB data frame; nothing more."""
    sender, path = Identity.generate(), "/stream/sink"
    auth = RequestAuth.create(
        sender, OPEN, target=record.peer_id.digest, method="POST", path=path, cipher="aes-256-gcm"
    )
    key = derive_stream_key(
        sender,
        OPEN,
        peer_public_key=record.public_key,
        peer_agreement_key=record.agreement_key,
        initiator=True,
        stream_id=auth.nonce,
        cipher=auth.cipher,
    )
    sealer = Sealer(make_aead(auth.cipher, key), auth.nonce, TO_SERVER)
    header = b"".join(sealer.seal(HEADER, msgpack.packb({})))
    prefix, sealed = sealer.seal(DATA, os.urandom(MiB))
    reader, writer = await asyncio.open_connection(
        record.address.host, record.address.port, local_addr=(source, 0)
    )
    length = len(header) + len(prefix) + len(sealed)
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: x\r\n{AUTH_HEADER}: {auth.encode()}\r\n"
        f"Content-Length: {length}\r\n\r\n".encode()
        + header
        + prefix
        + sealed[:sent]
    )
    await writer.drain()
    return reader, writer


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads RSS from /proc")
async def test_memory_goes_back_after_held_partial_frames_are_released() -> None:
    victim = OutputProcess([sys.executable, str(Path(__file__).with_name("net_victim.py")), VICTIM])
    client = await _transport(HONEST)
    try:
        address = PeerAddress.parse(victim.wait_for(r"LISTENING (\S+)").group(1))
        record = await client.fetch_info(address)
        await client.ping(address, timeout=10)
        await asyncio.sleep(1.0)
        start = _rss_mb(victim.proc.pid)
        held = await asyncio.gather(
            *(_held_partial_frame(record, ATTACKERS[i % 4], 900 * 1024) for i in range(100))
        )
        await asyncio.sleep(2.0)
        holding = _rss_mb(victim.proc.pid)
        await client.ping(address, timeout=10)  # still serving
        for _, writer in held:
            writer.close()
        released = time.monotonic()
        await asyncio.sleep(10.0)
        after = _rss_mb(victim.proc.pid)
        await client.ping(address, timeout=10)
        # the attack did pin memory while held (the frames got in), and all of it came back
        assert holding - start > 20, (start, holding)
        assert after - start <= 30, (start, holding, after, time.monotonic() - released)
    finally:
        await client.close()
        victim.kill()


# ---- forged signatures: authentication work per host and subnet


async def _forged_ping(port: int, source: str) -> int:
    """A ``/ping`` whose signature is forged, on a new connection from ``source``; the status."""
    auth = RequestAuth.create(
        Identity.generate(), OPEN, target=b"", method="GET", path="/ping", cipher="aes-256-gcm"
    )
    forged = dataclasses.replace(auth, signature=bytes(64))
    try:
        reader, writer = await asyncio.open_connection(VICTIM, port, local_addr=(source, 0))
    except OSError:
        return 0
    try:
        writer.write(
            f"GET /ping HTTP/1.1\r\nHost: x\r\n{AUTH_HEADER}: {forged.encode()}\r\n\r\n".encode()
        )
        line = await asyncio.wait_for(reader.readline(), 10)
        return int(line.split()[1]) if line.startswith(b"HTTP/1.1 ") else 0
    except (ConnectionError, TimeoutError):
        return 0
    finally:
        writer.close()


@pytest.mark.parametrize(
    "sources", [[ATTACKERS[0]] * 16, ATTACKERS], ids=["ports_of_one_host", "addresses_of_a_24"]
)
async def test_forged_signatures_cost_their_host_and_subnet_not_the_victim(
    sources: list[str],
) -> None:
    victim = await _transport(VICTIM)
    statuses: list[int] = []
    try:
        started = time.monotonic()
        for i in range(150):  # 2400 forged requests, 16 at a time, each on a fresh port
            statuses += await asyncio.gather(*(_forged_ping(victim.port, s) for s in sources))
            if i % 30 == 0:
                await _fresh_ping(victim, f"127.0.0.{10 + i // 30}")
        elapsed = time.monotonic() - started
    finally:
        await victim.close()
    checked, unchecked = statuses.count(401), statuses.count(429)
    assert checked + unchecked == len(statuses)  # every one refused, none served
    # a refused forgery costs 1 + FAILED_AUTH_COST tokens: the budget, not the attacker's
    # ports or addresses, bounds how many signatures the victim checks
    per_forgery = 1 + FAILED_AUTH_COST
    hosts = len(set(sources))
    budget = min(hosts * (AUTH_BURST + AUTH_RATE * elapsed), 8 * (AUTH_BURST + AUTH_RATE * elapsed))
    assert unchecked > 0 and checked <= budget / per_forgery + 16
