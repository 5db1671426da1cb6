"""A transport alone in its own process, for tests that measure what floods cost it (RSS).

    python tests/net_victim.py HOST

Serves the stream ``sink`` (reads every chunk, answers with the byte count) in an open swarm,
prints ``LISTENING HOST:PORT`` and runs until it is killed.
"""

from __future__ import annotations

import asyncio
import sys

from swarm.auth import Membership
from swarm.identity import Identity
from swarm.net.streams import InboundStream, ReplyStream
from swarm.net.transport import Transport


async def sink(request: InboundStream, reply: ReplyStream) -> None:
    received = 0
    async for chunk in request:
        received += len(chunk)
    await reply.prepare({"received": received})


async def main(host: str) -> None:
    transport = Transport(Identity.generate(), Membership.open(), run_id="t", listen=f"{host}:0")
    transport.add_stream("sink", sink)
    async with transport:
        print(f"LISTENING {transport.bound_address}", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
