"""Connection and memory floods on the HTTP side, for ``benchmarks/hostile.py`` (issue 35, 4-5).

    python benchmarks/hostile.py --attacks subnet_connection_fill held_frames_memory
    (ulimit -n 512; python benchmarks/hostile.py --attacks subnet_connection_fill)

- ``subnet_connection_fill``: 16 addresses of one /24 first prove themselves (one
  authenticated ping each: free in an open swarm), then hold ``rate`` connections to the
  victim in all, idle, and dial again whenever the victim closes one (refused or evicted),
  for ``duration`` seconds. Under ``ulimit -n 512`` every process, the victims included, has
  512 descriptors, as the victim of the issue had (a table of 384 connections, which 12
  addresses filled before); the attacker then holds as many as its own descriptors allow.
  Meanwhile newcomers ping the victim, each on a new connection from an honest address it
  never saw (127.0.0.100 up); their pings count in ``legit_success`` with the prober's.
- ``held_frames_memory``: 100 authenticated streams from 4 addresses each send a header and
  900 KiB of a 1 MiB frame, and hold them for ``duration`` seconds; then they are closed.
  Reports ``rss_after_release_mb``: the victim's RSS 10 s after the release less its RSS
  before the attack (the issue measured 70 -> 277 MB, then 407 MB after a second round).

The attacker sits on 127.0.9.0/24, away from the peers' and the prober's 127.0.0.0/24. Both
attacks are TCP (``amplification`` null) and count their dials in ``achieved_rate``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from types import ModuleType
from typing import Any

import msgpack

from swarm.address import PeerAddress
from swarm.auth import AUTH_HEADER, Membership, RequestAuth, derive_stream_key
from swarm.identity import Identity
from swarm.net.frames import DATA, HEADER, TO_SERVER, Sealer, make_aead
from swarm.net.limits import raise_descriptor_limit
from swarm.net.record import PeerRecord
from swarm.net.transport import Transport

ATTACKERS = [f"127.0.9.{i}" for i in range(1, 17)]
OPEN = Membership.open()
MiB = 1 << 20
REDIAL_S = 0.2  # after a close: the victim pays an accept and an abort per dial
HELD_FRAMES, FRAME_SOURCES, SENT_BYTES = 100, 4, 900 * 1024
STREAM = "reach.dialback"  # an RPC every swarm-peer serves: its reader takes one data frame
SETTLE_S = 10.0
FRESH_PINGS = 100  # at most, from 127.0.0.100 up: each a host the victim never saw
REPORTED: dict[str, Any] = {}  # figures an attack measures itself, read by run_attack


def _bench() -> ModuleType:
    """hostile.py's helpers (see hostile_dht.py)."""
    main = sys.modules.get("__main__")
    if main is not None and hasattr(main, "run_attack") and hasattr(main, "paced"):
        return main
    import hostile

    return hostile


async def _victim_record(victim: Any) -> PeerRecord:
    client = Transport(Identity.generate(), OPEN, run_id="bench", listen=f"{ATTACKERS[-1]}:0")
    await client.start()
    try:
        return await client.fetch_info(PeerAddress.parse(victim.address))
    finally:
        await client.close()


async def _prove(address: str, victim: PeerAddress) -> None:
    prover = Transport(Identity.generate(), OPEN, run_id="bench", listen=f"{address}:0")
    await prover.start()
    try:
        await prover.ping(victim, timeout=10)
    finally:
        await prover.close()


async def attack_subnet_connection_fill(victims: list[Any], rate: float, duration: float):
    bench = _bench()
    victim = PeerAddress.parse(victims[0].address)
    await asyncio.gather(*(_prove(a, victim) for a in ATTACKERS))
    holders = min(int(rate), raise_descriptor_limit(4096) - 64)
    dials, closed = [0], [0]
    started = time.monotonic()

    async def hold(source: str) -> None:
        while time.monotonic() - started < duration:
            dials[0] += 1
            try:
                reader, writer = await asyncio.open_connection(
                    victim.host, victim.port, local_addr=(source, 0)
                )
            except OSError:
                await asyncio.sleep(REDIAL_S)
                continue
            try:
                left = duration - (time.monotonic() - started)
                await asyncio.wait_for(reader.read(), max(0.01, left))
                closed[0] += 1
            except (TimeoutError, ConnectionError):
                pass
            finally:
                writer.close()
            await asyncio.sleep(REDIAL_S)

    tasks = [asyncio.create_task(hold(ATTACKERS[i % len(ATTACKERS)])) for i in range(holders)]
    await asyncio.sleep(min(1.0, duration / 4))  # the table fills
    legit = await _fresh_pings(victim, duration - (time.monotonic() - started))
    await asyncio.gather(*tasks)
    REPORTED.setdefault("legit_results", []).extend(legit)
    bench.ACTIONS.append((dials[0], time.monotonic() - started))
    print(
        f"subnet_connection_fill: {holders} holders, {dials[0]} dials, {closed[0]} closed by "
        "the victim",
        file=sys.stderr,
    )
    return None


async def _fresh_pings(victim: PeerAddress, duration: float) -> list[tuple]:
    """What a newcomer does: an authenticated ping on a new connection from an address the
    victim has never seen (the prober's pooled connection predates the attack)."""
    results: list[tuple] = []
    stop = time.monotonic() + duration
    for i in range(FRESH_PINGS):
        if time.monotonic() >= stop:
            break
        client = Transport(Identity.generate(), OPEN, run_id="bench", listen=f"127.0.0.{100 + i}:0")
        await client.start()
        started = time.perf_counter()
        try:
            await client.ping(victim, timeout=5)
            ok = True
        except Exception:  # a benchmark counts failures
            ok = False
        finally:
            await client.close()
        results.append(("fresh_ping", ok, (time.perf_counter() - started) * 1000, 0))
        await asyncio.sleep(0.3)
    return results


async def _held_frame(record: PeerRecord, source: str) -> asyncio.StreamWriter:
    sender, path = Identity.generate(), f"/stream/{STREAM}"
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
    _, writer = await asyncio.open_connection(
        record.address.host, record.address.port, local_addr=(source, 0)
    )
    length = len(header) + len(prefix) + len(sealed)
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: x\r\n{AUTH_HEADER}: {auth.encode()}\r\n"
        f"Content-Length: {length}\r\n\r\n".encode()
    )
    writer.write(header + prefix + sealed[:SENT_BYTES])
    await writer.drain()
    return writer


async def attack_held_frames_memory(victims: list[Any], rate: float, duration: float):
    bench = _bench()
    record = await _victim_record(victims[0])
    before = victims[0].rss_mb()
    started = time.monotonic()
    writers = await asyncio.gather(
        *(_held_frame(record, ATTACKERS[i % FRAME_SOURCES]) for i in range(int(rate)))
    )
    await asyncio.sleep(max(0.0, duration - (time.monotonic() - started)))
    held = victims[0].rss_mb()
    for writer in writers:
        writer.close()
    bench.ACTIONS.append((len(writers), time.monotonic() - started))
    await asyncio.sleep(SETTLE_S)
    after = victims[0].rss_mb()
    REPORTED["rss_after_release_mb"] = round(after - before, 1)
    print(
        f"held_frames_memory: RSS {before:.1f} MB before, {held:.1f} held, {after:.1f} "
        f"{SETTLE_S:.0f} s after the release",
        file=sys.stderr,
    )
    return None


NET_ATTACKS = {
    # name: (function, rate): connections held in all; partial frames held
    "subnet_connection_fill": (attack_subnet_connection_fill, 512),
    "held_frames_memory": (attack_held_frames_memory, HELD_FRAMES),
}
