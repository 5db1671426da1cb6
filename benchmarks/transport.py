"""Throughput of plain aiohttp streams vs sealed swarm streams on loopback, and of the AEADs alone.

Prints one JSON object per line::

    {"mode": "cipher"|"plain"|"sealed", "cipher": ..., "chunk_bytes": ..., "total_bytes": ...,
     "seconds": ..., "gb_s": <GB/s, 1e9 bytes>, "gbps": <Gbit/s>}

``cipher`` rows time seal + open of one chunk in memory (no I/O). ``plain`` streams the same bytes
through aiohttp with no authentication; ``sealed`` goes through :class:`swarm.net.Transport`
(127.0.0.2 -> 127.0.0.3, per-chunk AEAD, authenticated request). Sender and receiver share one
process and one event loop, so each figure is what one core does for both ends; the best of
``--repeats`` runs is reported.

    python benchmarks/transport.py [--total-mib 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from swarm.auth import Membership
from swarm.identity import Identity
from swarm.net.frames import CIPHERS, DATA, TO_SERVER, Opener, Sealer, make_aead
from swarm.net.streams import InboundStream, ReplyStream
from swarm.net.transport import Transport

CHUNKS = (64 * 1024, 1 << 20)


def emit(mode: str, cipher: str, chunk: int, total: int, seconds: float) -> None:
    rate = total / seconds
    row = dict(
        mode=mode,
        cipher=cipher,
        chunk_bytes=chunk,
        total_bytes=total,
        seconds=round(seconds, 4),
        gb_s=round(rate / 1e9, 3),
        gbps=round(rate * 8 / 1e9, 2),
    )
    print(json.dumps(row), flush=True)


def bench_cipher(cipher: str, chunk: int, total: int, repeats: int) -> float:
    aead = make_aead(cipher, os.urandom(32))
    data = os.urandom(chunk)
    best = float("inf")
    for _ in range(repeats):
        sealer = Sealer(aead, b"s" * 16, TO_SERVER)
        opener = Opener(aead, b"s" * 16, TO_SERVER, max_frame_bytes=chunk)
        opener.index = 1  # pretend the header frame was read
        sealer.index = 1
        start = time.perf_counter()
        for _ in range(total // chunk):
            _, sealed = sealer.seal(DATA, data)
            opener.open(DATA, sealed)
        best = min(best, time.perf_counter() - start)
    return best


async def _chunks(blob: bytes, chunk: int, total: int) -> AsyncIterator[bytes]:
    view = memoryview(blob)
    for _ in range(total // len(blob)):
        for start in range(0, len(blob), chunk):
            yield view[start : start + chunk]


async def bench_plain(chunk: int, total: int, repeats: int, blob: bytes) -> float:
    received = 0

    async def sink(request: web.Request) -> web.Response:
        nonlocal received
        async for piece in request.content.iter_chunked(chunk):
            received += len(piece)
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/sink", sink)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.3", 0).start()
    port = runner.addresses[0][1]
    connector = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
    best = float("inf")
    try:
        async with aiohttp.ClientSession(connector=connector) as session:
            for _ in range(repeats):
                received = 0
                start = time.perf_counter()
                body = _chunks(blob, chunk, total)
                async with session.post(f"http://127.0.0.3:{port}/sink", data=body) as r:
                    await r.read()
                best = min(best, time.perf_counter() - start)
                if received != total:
                    raise RuntimeError(f"plain: received {received} of {total}")
    finally:
        await runner.cleanup()
    return best


async def bench_sealed(cipher: str, chunk: int, total: int, repeats: int, blob: bytes) -> float:
    membership = Membership.with_key("benchmark swarm key")
    a = Transport(
        Identity.generate(),
        membership,
        run_id="bench",
        listen="127.0.0.2:0",
        cipher=cipher,
        max_chunk_bytes=chunk,
        max_stream_bytes=total,
    )
    b = Transport(
        Identity.generate(),
        membership,
        run_id="bench",
        listen="127.0.0.3:0",
        max_chunk_bytes=chunk,
        max_stream_bytes=total,
    )

    async def sink(request: InboundStream, reply: ReplyStream) -> None:
        received = 0
        async for piece in request:
            received += len(piece)
        await reply.prepare({"received": received})

    b.add_stream("sink", sink)
    best = float("inf")
    async with a, b:
        for _ in range(repeats):
            start = time.perf_counter()
            body = _chunks(blob, chunk, total)
            async with a.stream(b.record(), "sink", {}, body, timeout=120) as s:
                if s.header.get("received") != total:
                    raise RuntimeError(f"sealed: {s.header} of {total}")
            best = min(best, time.perf_counter() - start)
    return best


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    total = args.total_mib << 20
    blob = os.urandom(16 << 20)
    for chunk in CHUNKS:
        for cipher in CIPHERS:
            seconds = await asyncio.to_thread(bench_cipher, cipher, chunk, total, args.repeats)
            emit("cipher", cipher, chunk, total, seconds)
        emit("plain", "none", chunk, total, await bench_plain(chunk, total, args.repeats, blob))
        for cipher in CIPHERS:
            seconds = await bench_sealed(cipher, chunk, total, args.repeats, blob)
            emit("sealed", cipher, chunk, total, seconds)


if __name__ == "__main__":
    asyncio.run(main())
