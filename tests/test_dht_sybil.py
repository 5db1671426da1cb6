"""Free identities, ports and addresses against real DHT nodes on loopback: a Sybil eclipse of
a run's listing, signature floods spread over 64 ports and over 16 addresses of one /24, and
the witnessed age that readers get. Honest peers sit on 127.0.0.x, the attacker on 127.0.9.x."""

from __future__ import annotations

import asyncio
import os
import time
from contextlib import asynccontextmanager

import pytest
from dht_attackers import (
    RawSockets,
    attacker_hosts,
    forged_copy,
    ground_identities,
    store_request,
)
from dht_nodes import ATTACKER_HOST, HOST, swarm_of

from swarm.auth import Membership
from swarm.dht import DHTEntry, DHTNode, key_digest
from swarm.dht.answers import MAX_RESPONSE_BYTES
from swarm.dht.budgets import SUBNET_SHARE, VERIFY_BURST, VERIFY_RATE
from swarm.dht.envelope import DatagramAuth
from swarm.dht.node import MAX_PAGES_PER_GET
from swarm.dht.records import MAX_TTL_S, MAX_VALUE_BYTES
from swarm.identity import Identity

PEERS_KEY = "run/peers"
HONEST_HOSTS = [f"127.0.0.{i}" for i in range(2, 6)]
READER_HOST = "127.0.0.9"
SECRET = "a swarm key the attacker also holds"
GROUND = 200


def owners(found) -> set[bytes]:
    return {entry.public_key for entry in found.values()}


async def announce(nodes: list[DHTNode]) -> None:
    for node in nodes:
        assert await node.store(PEERS_KEY, b"record", time.time() + 120, subkey="peer") > 0


async def listing(seed: DHTNode, host: str = READER_HOST) -> dict:
    """What ``swarm-peer peers`` does: a client node bootstraps through ``seed`` and reads."""
    client = await DHTNode.create(Identity.generate(), seed.membership, host=host, client=True)
    try:
        assert await client.bootstrap([f"{seed.protocol.source_node.ip}:{seed.port}"]) > 0
        return await client.get(PEERS_KEY)
    finally:
        await client.close()


@pytest.mark.parametrize("keyed", [False, True], ids=["open", "keyed"])
@pytest.mark.parametrize("spread", [1, 16], ids=["one-host", "16-addresses-of-a-24"])
async def test_a_listing_stays_complete_with_200_ground_identities(keyed: bool, spread: int):
    membership = Membership.with_key(SECRET) if keyed else Membership.open()
    ground, keys = ground_identities(GROUND, honest=len(HONEST_HOSTS))
    async with swarm_of(len(keys), membership, hosts=HONEST_HOSTS, identities=keys) as honest:
        lowest = min(n.identity.public_key for n in honest)
        digest = key_digest(PEERS_KEY)
        expiration = time.time() + MAX_TTL_S - 60
        value = os.urandom(MAX_VALUE_BYTES)
        entries = [DHTEntry.create(g, digest, "", value, expiration) for g in ground]
        auths = [DatagramAuth(g, membership) for g in ground]  # first-hand: each its own sender
        sockets = await RawSockets.open(attacker_hosts(spread), per_host=1)
        try:  # the attack comes first: the honest records are the younger ones
            for node in honest:
                target = node.protocol.source_node.keys
                address = (node.protocol.source_node.ip, node.port)
                for i, (auth, entry) in enumerate(zip(auths, entries, strict=True)):
                    sockets.send(i, store_request(auth, target, digest, [entry]), address)
                    if i % 20 == 19:
                        await asyncio.sleep(0.01)  # within the victims' receive buffers
            await sockets.wait_answers(sockets.sent, timeout=10.0)
        finally:
            sockets.close()
        for node in honest:  # every node took every ground identity, in 4 KiB entries
            assert {g.public_key for g in ground} <= owners_of(node, digest)
        await announce(honest)
        # in key order, the 200 would fill more pages than a reader follows, before any honest
        assert max(g.public_key for g in ground) < lowest
        assert GROUND * entries[0].wire_size() > (1 + MAX_PAGES_PER_GET) * MAX_RESPONSE_BYTES
        found = await listing(honest[-1])
        assert {n.identity.public_key for n in honest} <= owners(found)
        assert len(owners(found)) > len(honest)  # the reader saw part of the crowd as well


def owners_of(node: DHTNode, digest: bytes) -> set[bytes]:
    return {e.public_key for e in node.storage.entries(digest)}


@pytest.mark.parametrize("spread", [1, 16], ids=["64-ports-of-one-host", "16-addresses-of-a-24"])
async def test_a_signature_flood_costs_the_victim_no_more_than_the_attackers_budget(spread: int):
    async with swarm_of(3, hosts=HONEST_HOSTS, hostile=True) as honest:
        await announce(honest)
        victim = honest[0]
        target = victim.protocol.source_node.keys
        address = (victim.protocol.source_node.ip, victim.port)
        sockets = await RawSockets.open(attacker_hosts(spread), per_host=64 // spread)
        auths = [DatagramAuth(Identity.generate(), Membership.open()) for _ in range(len(sockets))]
        digest = key_digest("flood")
        expiration = time.time() + 3600
        stores = []  # per socket: 63 valid entries of fresh owners, and a forged one last
        for _ in range(len(sockets)):
            sybils = [Identity.generate() for _ in range(2)]
            valid = [
                DHTEntry.create(sybils[i % 2], digest, f"{i}", b"", expiration) for i in range(63)
            ]
            stores.append([*valid, forged_copy(valid[0])])
        before = victim.counters()
        loop = asyncio.get_running_loop()
        started = loop.time()

        async def flood(seconds: float = 2.0, per_socket_per_s: float = 10.0) -> None:
            rounds = int(seconds * per_socket_per_s)
            for _ in range(rounds):  # 640 stores per second, each sealed afresh (new nonce)
                for i, auth in enumerate(auths):
                    sockets.send(i, store_request(auth, target, digest, stores[i]), address)
                await asyncio.sleep(1.0 / per_socket_per_s)

        try:
            flooding = asyncio.create_task(flood())
            await asyncio.sleep(0.3)
            found = await listing(honest[1])
            pong = await honest[1].protocol.call(victim.protocol.source_node, "ping")
            newcomer = await DHTNode.create(
                Identity.generate(), Membership.open(), host="127.0.0.10"
            )
            try:
                first_contact = await newcomer.ping_address(*address)
            finally:
                await newcomer.close()
            await flooding
            elapsed = loop.time() - started
        finally:
            sockets.close()
        after = victim.counters()
        checked = after["signatures_checked"] - before["signatures_checked"]
        budget = (VERIFY_BURST + VERIFY_RATE * elapsed) * (1 if spread == 1 else SUBNET_SHARE)
        offered = sockets.sent * len(stores[0])
        assert 0 < checked <= budget, (checked, budget)
        assert offered >= 20 * checked  # the flood asked for far more than it got
        assert after["forged_stores"] > before["forged_stores"]
        refused = ("stores_refused_unchecked", "public_key_work_over_budget")
        assert sum(after[c] - before[c] for c in refused) > 0
        assert {n.identity.public_key for n in honest} <= owners(found)
        assert pong is not None and first_contact is not None


async def test_a_read_tells_how_long_the_holders_have_held_each_slot():
    async with swarm_of(3, hosts=HONEST_HOSTS) as nodes:
        owner = nodes[0]
        assert await owner.store(PEERS_KEY, b"v1", time.time() + 60, subkey="p") == 3
        await asyncio.sleep(2.2)
        # a heartbeat: a later expiration replaces the entry, the slot's history stays
        assert await owner.store(PEERS_KEY, b"v2", time.time() + 120, subkey="p") == 3
        assert await nodes[1].store(PEERS_KEY, b"new", time.time() + 60, subkey="p") == 3
        found = await listing(nodes[2])
        old = found[(owner.identity.peer_id, "p")]
        young = found[(nodes[1].identity.peer_id, "p")]
        assert old.value == b"v2" and 2.0 <= old.age_s < 60.0
        assert young.age_s < old.age_s and young.age_s < 2.0
        # a holder's own storage counts as one of the holders
        own = await nodes[2].get(PEERS_KEY)
        assert 2.0 <= own[(owner.identity.peer_id, "p")].age_s < 60.0


async def test_a_forged_entry_stops_the_store_and_costs_its_source_the_next_ones():
    async with swarm_of(3, hostile=True) as nodes, attacker_node(nodes[0]) as attacker:
        victim_node = nodes[1]
        victim = Identity.generate()
        key = key_digest("run/peers")
        good = DHTEntry.create(attacker.identity, key, "s", b"mine", time.time() + 60)
        forged = DHTEntry(
            key, "s", b"evil", time.time() + 60, victim.public_key, good.signature
        )  # signed by the attacker, claims the victim's key
        after = DHTEntry.create(attacker.identity, key, "t", b"after", time.time() + 60)
        contact = next(c for c in attacker.contacts() if c.id == victim_node.node_id)
        answer = await attacker.protocol.call(
            contact, "store", key, [good.to_wire(), forged.to_wire(), after.to_wire()]
        )
        assert "error" in answer
        # checked in order: the good entry before the forgery is kept (it is signed on its
        # own), the forgery and everything after it are not
        assert victim_node.storage.entries(key) == [good]
        counters = victim_node.counters()
        assert counters["forged_stores"] == 1 and counters["signatures_checked"] == 2
        # the forger's host is in debt: its next store is refused before any check
        answer = await attacker.protocol.call(contact, "store", key, [after.to_wire()])
        assert "error" in answer and victim_node.storage.entries(key) == [good]
        assert victim_node.counters()["stores_refused_unchecked"] == 1
        assert victim_node.counters()["signatures_checked"] == 2
        # honest nodes on other hosts are not: the node still works for them
        assert await nodes[2].store("run/peers", b"ok", time.time() + 60) >= 2


@asynccontextmanager
async def attacker_node(seed: DHTNode, host: str = ATTACKER_HOST):
    """A node on the attacker's own address, joined through ``seed``."""
    node = await DHTNode.create(Identity.generate(), seed.membership, host=host)
    try:
        assert await node.bootstrap([f"{HOST}:{seed.port}"]) > 0
        yield node
    finally:
        await node.close()
