"""DHT nodes on loopback for the DHT tests (tests/test_dht*.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from swarm.auth import Membership
from swarm.dht import DHTNode
from swarm.identity import Identity

HOST = "127.0.0.1"
ATTACKER_HOST = "127.0.9.1"  # another /24 of loopback: the attacker's own host and subnet
BUDGET_REFUSALS = (
    "datagrams_over_rate",
    "public_key_work_over_budget",
    "stores_refused_unchecked",
    "new_slots_over_rate",
)


@asynccontextmanager
async def swarm_of(
    count: int,
    membership: Membership | None = None,
    *,
    hosts: Sequence[str] = (HOST,),
    hostile: bool = False,
    identities: Sequence[Identity] | None = None,
    **kwargs,
) -> AsyncIterator[list[DHTNode]]:
    """``count`` nodes, node ``i`` on ``hosts[i % len(hosts)]`` (with ``identities[i]`` when
    given), each bootstrapped through the first. Unless ``hostile`` (a test that floods on
    purpose), no node may have refused anything for a budget when the block ends: honest peers,
    however many share a loopback address, never meet the per-host and per-subnet budgets."""
    membership = membership or Membership.open()
    nodes = [
        await DHTNode.create(
            identities[i] if identities else Identity.generate(),
            membership,
            host=hosts[i % len(hosts)],
            port=0,
            **kwargs,
        )
        for i in range(count)
    ]
    try:
        for node in nodes[1:]:
            assert await node.bootstrap([f"{nodes[0].protocol.source_node.ip}:{nodes[0].port}"]) > 0
        yield nodes
        if not hostile:
            assert_unthrottled(nodes)
    finally:
        await asyncio.gather(*(n.close() for n in nodes))


def assert_unthrottled(nodes: Sequence[DHTNode]) -> None:
    """No node refused anything for a budget (see :data:`BUDGET_REFUSALS`)."""
    for node in nodes:
        if node.protocol is None:
            continue
        counters = node.counters()
        refused = {name: counters[name] for name in BUDGET_REFUSALS if counters[name]}
        assert not refused, f"an honest node was throttled: {refused}"
