"""DHT nodes on loopback for the DHT tests (tests/test_dht.py, tests/test_dht_hostile.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from swarm.auth import Membership
from swarm.dht import DHTNode
from swarm.identity import Identity

HOST = "127.0.0.1"


@asynccontextmanager
async def swarm_of(
    count: int, membership: Membership | None = None, **kwargs
) -> AsyncIterator[list[DHTNode]]:
    """``count`` nodes, each bootstrapped through the first."""
    membership = membership or Membership.open()
    nodes = [
        await DHTNode.create(Identity.generate(), membership, host=HOST, port=0, **kwargs)
        for _ in range(count)
    ]
    try:
        for node in nodes[1:]:
            assert await node.bootstrap([f"{HOST}:{nodes[0].port}"]) > 0
        yield nodes
    finally:
        await asyncio.gather(*(n.close() for n in nodes))
