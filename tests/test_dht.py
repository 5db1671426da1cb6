"""The signed DHT on real UDP sockets on loopback: lookups, merge, expiry, membership, hostility."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import time
from contextlib import asynccontextmanager

import msgpack
import pytest
from dht_nodes import HOST, swarm_of

from swarm.auth import Membership
from swarm.dht import DHTNode, key_digest
from swarm.dht.envelope import REQUEST, DatagramAuth
from swarm.dht.lookup import lookup
from swarm.dht.routing import node_id_of
from swarm.dht.rtt import RTT_MEMORY_S, RttEstimator
from swarm.errors import AuthError, ConfigError, DHTError
from swarm.identity import Identity


def later(seconds: float = 60.0) -> float:
    return time.time() + seconds


async def eventually(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def by_distance(ids, target: bytes) -> list[bytes]:
    """Node ids, closest to ``target`` first (the true ranking a lookup must end at)."""
    goal = int.from_bytes(target, "big")
    return sorted(ids, key=lambda x: int.from_bytes(x, "big") ^ goal)


@asynccontextmanager
async def meshed_with_newcomer(count: int, ksize: int):
    """``count`` nodes that all know each other, and a newcomer that pinged only the first."""
    async with swarm_of(count, ksize=ksize) as nodes:
        for node in nodes:
            for other in nodes:
                if other is not node:
                    node.protocol.router.add_contact(other.protocol.source_node)
        newcomer = await DHTNode.create(
            Identity.generate(), Membership.open(), host=HOST, port=0, ksize=ksize
        )
        try:
            assert await newcomer.ping_address(HOST, nodes[0].port) is not None
            yield nodes, newcomer
        finally:
            await newcomer.close()


async def test_a_newcomer_finds_the_true_k_closest_though_first_answers_are_cut():
    # k = 40 contacts do not fit in an answer to a first-contact request (no more bytes than
    # the request): every answer is cut to the answerer's 22 closest. Where every node knows
    # every other, those lists all hold the same 23 nodes, which would hide ranks 24-40 from
    # a newcomer; the lookup asks the cut answerers again (now with their cookie)
    async with meshed_with_newcomer(46, ksize=40) as (nodes, newcomer):
        for i in range(3):
            newcomer.protocol.caller.cookies_held.clear()  # every answer is a first contact's
            target = key_digest(f"target-{i}")
            found = await lookup(newcomer.protocol, target, ksize=40, alpha=3)
            truth = by_distance((n.node_id for n in nodes), target)
            assert [c.id for c in found.closest] == truth[:40]


async def test_a_lookup_through_nodes_slower_than_its_rtt_estimate_ends_at_the_true_k_closest():
    # the newcomer's RTT estimate comes from one quick ping, then every node answers 50 ms late
    # (a busy host): each request stalls before its answer comes. The lookup must neither end
    # with nothing (no node had answered yet) nor drop the nodes whose cut answers it asked
    # again (they answered moments ago)
    async with meshed_with_newcomer(30, ksize=24) as (nodes, newcomer):
        loop = asyncio.get_running_loop()
        for node in nodes:
            handle = node.protocol.datagram_received
            node.protocol.datagram_received = lambda data, addr, handle=handle: loop.call_later(
                0.05, handle, data, addr
            )
        newcomer.protocol.rtt.observe(0.0005)
        newcomer.protocol.caller.cookies_held.clear()
        target = key_digest("slow")
        found = await lookup(newcomer.protocol, target, ksize=24, alpha=3)
        truth = by_distance((n.node_id for n in nodes), target)
        assert [c.id for c in found.closest] == truth[:24]


async def test_64_nodes_store_and_get_from_anywhere():
    rng = random.Random(1)
    async with swarm_of(64) as nodes:
        ok = 0
        for i in range(100):
            writer, reader = rng.sample(nodes, 2)
            ok += await writer.store(f"key-{i}", b"value-%d" % i, later(), subkey="s") > 0
            got = await reader.get(f"key-{i}")
            ok += [e.value for e in got.values()] == [b"value-%d" % i]
        assert ok >= 198, f"{ok} of 200 operations succeeded"


async def test_repeated_stores_reuse_the_closest_nodes_and_survive_a_dead_one():
    """A peer stores its record every heartbeat: within the targets' TTL the k closest found
    by the first store's lookup take the next stores without a lookup; once a target that died
    failed to take one, the next store looks again (the entry reaches a quorum and reads back)."""
    async with swarm_of(24, ksize=8) as nodes:
        writer, reader = nodes[0], nodes[1]
        lookups: list[str] = []
        call = writer.protocol.call

        async def counting(contact, method, *args):
            lookups.append(method)
            return await call(contact, method, *args)

        writer.protocol.call = counting
        assert await writer.store("k", b"v1", later(), subkey="s") >= 8
        first = lookups.count("find_node")
        assert first > 0
        assert await writer.store("k", b"v2", later(61), subkey="s") >= 8
        assert lookups.count("find_node") == first  # no second lookup
        assert [e.value for e in (await reader.get("k")).values()] == [b"v2"]

        targets = writer.targets.get(key_digest("k"), 1, lambda _: False)
        ids = {c.id for c in targets}
        victim = next(n for n in nodes if n.node_id in ids and n not in (reader, writer))
        nodes.remove(victim)  # (closed here, not by swarm_of)
        await victim.close()
        # the store ends once a quorum took it; the dead target times out in the background,
        # and then the next store looks the key up again
        assert await writer.store("k", b"v3", later(62), subkey="s") >= writer.get_quorum
        digest = key_digest("k")
        await eventually(lambda: writer.targets.get(digest, 1, lambda _: False) is None)
        before = lookups.count("find_node")
        assert await writer.store("k", b"v4", later(63), subkey="s") >= writer.get_quorum
        assert lookups.count("find_node") > before
        assert [e.value for e in (await reader.get("k")).values()] == [b"v4"]


async def test_lookup_returns_the_true_k_closest_nodes():
    async with swarm_of(48, ksize=8) as nodes:
        ids = {n.node_id for n in nodes}
        for i in range(20):
            target = key_digest(f"target-{i}")
            truth = by_distance(ids, target)
            searcher = nodes[i % len(nodes)]
            found = await lookup(searcher.protocol, target, ksize=8, alpha=3)
            found_ids = [c.id for c in found.closest]
            expected = [x for x in truth if x != searcher.node_id][:8]
            assert found_ids == expected


async def test_subkeys_merge_and_the_later_expiration_wins():
    async with swarm_of(6) as nodes:
        a, b, reader = nodes[0], nodes[1], nodes[5]
        await a.store("run/peers", b"a-1", later(60), subkey="x")
        await a.store("run/peers", b"a-y", later(60), subkey="y")
        await b.store("run/peers", b"b-1", later(60), subkey="x")
        await a.store("run/peers", b"a-older", later(30), subkey="x")  # earlier: ignored
        got = await reader.get("run/peers")
        values = {(owner, sub): e.value for (owner, sub), e in got.items()}
        assert values == {
            (a.identity.peer_id, "x"): b"a-1",
            (a.identity.peer_id, "y"): b"a-y",
            (b.identity.peer_id, "x"): b"b-1",
        }
        await a.store("run/peers", b"a-2", later(90), subkey="x")  # later: replaces
        got = await reader.get("run/peers")
        assert got[(a.identity.peer_id, "x")].value == b"a-2"
        assert len(got) == 3


async def test_entries_vanish_at_expiration():
    async with swarm_of(4) as nodes:
        await nodes[0].store("short", b"v", later(1.0))
        assert len(await nodes[3].get("short")) == 1
        await asyncio.sleep(1.2)
        assert await nodes[3].get("short") == {}
        assert all(n.storage.entries(key_digest("short")) == [] for n in nodes)


async def test_local_checks_refuse_bad_records():
    async with swarm_of(2) as nodes:
        with pytest.raises(DHTError, match="value"):
            await nodes[0].store("big", b"x" * 5000, later())
        with pytest.raises(DHTError, match="expired"):
            await nodes[0].store("past", b"x", time.time() - 1)
        with pytest.raises(DHTError, match="at most"):
            await nodes[0].store("far", b"x", later(30 * 24 * 3600))


async def test_wrong_swarm_key_cannot_join():
    good = await DHTNode.create(
        Identity.generate(), Membership.with_key("first swarm key, long enough"), host=HOST
    )
    bad = await DHTNode.create(
        Identity.generate(),
        Membership.with_key("other swarm key, long enough"),
        host=HOST,
        request_timeout=0.5,  # every retry goes unanswered: no need to wait 3 s for each
    )
    try:
        assert await bad.bootstrap([f"{HOST}:{good.port}"]) == 0
        assert good.contacts() == []
    finally:
        await good.close()
        await bad.close()


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


async def test_a_node_that_could_not_join_joins_at_its_next_read():
    port = free_udp_port()  # the initial peer is not up yet
    lonely = await DHTNode.create(
        Identity.generate(), Membership.open(), host=HOST, request_timeout=0.3
    )
    nodes: list[DHTNode] = []
    try:
        with pytest.raises(ConfigError):
            await lonely.bootstrap([f"{HOST}:{port}"], attempts=0)
        assert await lonely.bootstrap([f"{HOST}:{port}"], attempts=1) == 0
        nodes.append(
            await DHTNode.create(Identity.generate(), Membership.open(), host=HOST, port=port)
        )
        for _ in range(3):
            nodes.append(await DHTNode.create(Identity.generate(), Membership.open(), host=HOST))
            assert await nodes[-1].bootstrap([f"{HOST}:{port}"]) > 0
        assert await nodes[-1].store("run/peers", b"up", later()) >= 2
        got = await lonely.get("run/peers")
        assert [e.value for e in got.values()] == [b"up"]
        assert len(lonely.contacts()) == 4
    finally:
        await asyncio.gather(*(n.close() for n in [lonely, *nodes]))


async def test_a_node_whose_contacts_all_failed_rejoins_through_a_former_one():
    seed, other, node = [
        await DHTNode.create(Identity.generate(), Membership.open(), host=HOST, request_timeout=0.3)
        for _ in range(3)
    ]
    other_identity, other_port = other.identity, other.port
    back = None
    try:
        for joiner in (other, node):
            assert await joiner.bootstrap([f"{HOST}:{seed.port}"]) > 0
        await eventually(lambda: len(node.contacts()) == 2)
        await seed.close()  # gone for good
        await other.close()  # gone for a while (a network outage looks the same)
        assert await node.get("missing") == {}
        await eventually(lambda: node.contacts() == [])  # both failed twice: evicted

        back = await DHTNode.create(other_identity, Membership.open(), host=HOST, port=other_port)
        assert await back.store("run/peers", b"back", later()) == 1  # it knows nobody yet
        got = await node.get("run/peers")  # the seed is dead; the former contact answers
        assert [e.value for e in got.values()] == [b"back"]
        assert [c.id for c in node.contacts()] == [back.node_id]
    finally:
        await asyncio.gather(*(n.close() for n in [seed, other, node, back] if n is not None))


async def test_allow_list_admits_only_listed_keys():
    ids = [Identity.generate() for _ in range(3)]
    allowed = Membership.allow_list({i.public_key for i in ids[:2]})
    nodes = [await DHTNode.create(i, allowed, host=HOST) for i in ids[:2]]
    # refused: its bootstrap waits out its timeouts, kept short
    outsider = await DHTNode.create(ids[2], Membership.open(), host=HOST, request_timeout=0.5)
    try:
        assert await nodes[1].bootstrap([f"{HOST}:{nodes[0].port}"]) == 1
        assert await outsider.bootstrap([f"{HOST}:{nodes[0].port}"]) == 0
    finally:
        for n in [*nodes, outsider]:
            await n.close()


def _borrowing(owner: Identity) -> Identity:
    """An identity that claims ``owner``'s public key with an agreement key of its own."""
    thief = Identity.generate()
    thief.public_key = owner.public_key
    return thief


def test_a_borrowed_public_key_is_refused_where_it_is_a_credential():
    member, receiver = Identity.generate(), Identity.generate()
    allowed = Membership.allow_list({member.public_key, receiver.public_key})
    thief = _borrowing(member)
    ours = DatagramAuth(receiver, allowed)
    ping = ["ping", []]
    forged = DatagramAuth(thief, allowed).seal(REQUEST, os.urandom(16), ping, ours.keys)
    with pytest.raises(AuthError, match="not signed by its owner"):
        ours.open(forged)
    with pytest.raises(AuthError, match="not signed by its owner"):  # nor is it ever asked
        ours.seal(REQUEST, os.urandom(16), ping, DatagramAuth(thief, allowed).keys)
    real = DatagramAuth(member, allowed).seal(REQUEST, os.urandom(16), ping, ours.keys)
    assert ours.open(real).sender.public_key == member.public_key
    # in an open swarm anyone can make a key pair: the borrowed key opens, but buys nothing,
    # not even the owner's place in the DHT (a node id hashes both keys)
    ours = DatagramAuth(receiver, Membership.open())
    forged = DatagramAuth(thief, Membership.open()).seal(REQUEST, os.urandom(16), ping, ours.keys)
    sender = ours.open(forged).sender
    assert sender.public_key == member.public_key
    assert node_id_of(sender) != node_id_of(DatagramAuth(member, Membership.open()).keys)


def hostile_datagrams(sender: Identity, target: DHTNode) -> list[bytes]:
    auth = DatagramAuth(sender, Membership.open())
    keys = target.protocol.source_node.keys
    valid = auth.seal(REQUEST, os.urandom(16), ["ping", []], keys)
    signed, tag = msgpack.unpackb(valid)
    key = key_digest("k")

    def sealed(body) -> bytes:
        return auth.seal(REQUEST, os.urandom(16), body, keys)

    bad_sig = msgpack.packb([signed, bytes(len(tag))])
    return [
        b"",
        b"\x00",
        os.urandom(300),
        valid[: len(valid) // 2],  # truncated
        valid + b"junk",
        b"\xc1" * 50,  # msgpack reserved byte
        msgpack.packb({"a": 1}),
        msgpack.packb([1, 2, 3]),
        msgpack.packb([signed, "text"]),
        msgpack.packb([b"\x92\x01\x02", tag]),
        bad_sig,
        msgpack.packb(msgpack.ExtType(1, b"x")),
        b"\x91" * 5000 + b"\x90",  # deep nesting
        os.urandom(70_000)[:65_000],  # oversized
        sealed(["nope", []]),
        sealed(["store", [key]]),
        sealed(["store", [b"short", []]]),
        sealed(["store", [key, "not a list"]]),
        sealed(["store", [key, [[1, 2, 3]]]]),
        sealed(["store", [key, [None] * 1000]]),
        sealed(["find_value", [12]]),
        sealed(["find_node", [b"x" * 21]]),
        sealed(["ping", [], "client?"]),
        sealed("not a list"),
        sealed(["store", [key, [["s", b"v", float("inf"), b"p" * 32, b"s" * 64]]]]),
    ]


async def test_hostile_datagrams_are_dropped_and_the_node_keeps_answering():
    async with swarm_of(2) as nodes:
        target, friend = nodes
        before = len(target.storage)
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((HOST, 0))
        try:
            for datagram in hostile_datagrams(Identity.generate(), target):
                try:
                    sock.sendto(datagram, (HOST, target.port))
                except OSError:  # too large for this system's UDP: nothing to send
                    continue
            await asyncio.sleep(0.3)
        finally:
            sock.close()
        assert len(target.storage) == before
        assert await friend.protocol.ping_address((HOST, target.port)) is not None
        assert await friend.store("after", b"v", later()) == 2


def test_replayed_and_stale_datagrams_are_refused():
    alice, bob = Identity.generate(), Identity.generate()
    sender = DatagramAuth(alice, Membership.open())
    receiver = DatagramAuth(bob, Membership.open(), replay_window_s=0.5)
    datagram = sender.seal(REQUEST, os.urandom(16), ["ping", []], receiver.keys)
    assert receiver.open(datagram).sender.public_key == alice.public_key
    with pytest.raises(AuthError):
        receiver.open(datagram)  # same nonce again
    stale = sender.seal(REQUEST, os.urandom(16), ["ping", []], receiver.keys)
    time.sleep(0.7)
    with pytest.raises(AuthError):
        receiver.open(stale)


def test_datagrams_for_another_node_or_tampered_are_refused():
    alice, bob, carol = (DatagramAuth(Identity.generate(), Membership.open()) for _ in range(3))
    to_bob = alice.seal(REQUEST, os.urandom(16), ["ping", []], bob.keys)
    with pytest.raises(AuthError, match="another node"):
        carol.open(to_bob)
    signed, tag = msgpack.unpackb(to_bob)
    flipped = bytearray(signed)
    flipped[-1] ^= 1
    with pytest.raises((AuthError, DHTError)):
        bob.open(msgpack.packb([bytes(flipped), tag]))


async def test_a_new_node_receives_the_records_it_should_hold():
    async with swarm_of(6) as nodes:
        for i in range(5):
            await nodes[i].store(f"key-{i}", b"v", later())
        newcomer = await DHTNode.create(Identity.generate(), Membership.open(), host=HOST)
        try:
            await newcomer.bootstrap([f"{HOST}:{nodes[0].port}"])
            # with fewer than k nodes every node is among the k closest of every key
            await eventually(lambda: len(newcomer.storage.keys()) == 5)
        finally:
            await newcomer.close()


async def test_gets_survive_a_quarter_of_the_nodes_dying():
    async with swarm_of(32, request_timeout=1.0) as nodes:
        for i in range(20):
            assert await nodes[i].store(f"key-{i}", b"v%d" % i, later()) > 0
        dead = nodes[8:16]
        for node in dead:
            await node.close()
        alive = nodes[:8] + nodes[16:]
        ok = 0
        for i in range(0, 20, 2):
            got = await alive[(i * 5) % len(alive)].get(f"key-{i}")
            ok += [e.value for e in got.values()] == [b"v%d" % i]
        assert ok == 10


async def test_a_store_does_not_wait_out_the_dead_among_the_k_closest():
    async with swarm_of(24, request_timeout=30.0) as nodes:
        dead = nodes[16:]
        dead_keys = {n.protocol.source_node.keys for n in dead}
        for node in dead:
            await node.close()
        writer = nodes[0]
        assert await writer.store("after-the-deaths", b"v", later()) >= writer.get_quorum
        # it returned while its requests to the dead nodes still wait for their answer
        waiting = {expected for _, expected in writer.protocol.caller.pending.values()}
        assert waiting & dead_keys
        got = await nodes[5].get("after-the-deaths")
        assert [e.value for e in got.values()] == [b"v"]


def test_an_rtt_estimate_from_long_ago_restarts_from_the_next_answer():
    rtt = RttEstimator(floor=0.01, ceiling=3.0)
    for second in range(5):  # answers while joining a busy swarm
        rtt.observe(0.5, now=100.0 + second)
    rtt.observe(0.002, now=105.0)  # one fast answer is blended in, as RFC 6298 does
    assert rtt.srtt > 0.4 and rtt.timeout > 0.5
    rtt.observe(0.002, now=105.0 + RTT_MEMORY_S + 1)  # the next, much later, starts over
    assert rtt.srtt == 0.002 and rtt.timeout == 0.01


async def test_a_client_node_is_not_added_to_routing_tables():
    async with swarm_of(3) as nodes:
        client = await DHTNode.create(
            Identity.generate(), Membership.open(), host=HOST, client=True
        )
        try:
            assert await client.bootstrap([f"{HOST}:{nodes[0].port}"]) == 3
            await nodes[0].store("k", b"v", later())
            assert len(await client.get("k")) == 1
            assert await client.store("c", b"v", later()) == 3  # on the servers, not itself
            assert len(client.storage) == 0
            assert all(client.node_id not in {c.id for c in n.contacts()} for n in nodes)
        finally:
            await client.close()


async def test_every_node_knows_the_far_half_of_the_key_space_after_joining():
    """A join refreshes every bucket (kademlia section 2.3): without it a node may know nobody
    in the other half of the key space, and its stores land where no reader looks."""
    from swarm.dht.lookup import shared_bits

    async with swarm_of(64) as nodes:
        ids = [int.from_bytes(n.node_id, "big") for n in nodes]
        for node in nodes:
            own = int.from_bytes(node.node_id, "big")
            known = {shared_bits(c.long_id, own) for c in node.contacts()}
            exist = {shared_bits(other, own) for other in ids if other != own}
            shallow = {d for d in exist if d < 4}  # bands of 4+ nodes on average
            assert shallow <= known, (sorted(shallow), sorted(known))


async def test_the_nodes_a_newcomer_knows_know_it_after_its_join():
    """A node takes in only senders that echoed its cookie, and a join asks most nodes once:
    the newcomer pings its contacts again, with their cookies, so that they learn of it."""
    async with swarm_of(12) as nodes:
        newcomer = await DHTNode.create(Identity.generate(), Membership.open(), host=HOST, port=0)
        try:
            assert await newcomer.bootstrap([f"{HOST}:{nodes[0].port}"]) > 0
            mine = {c.id for c in newcomer.contacts()}
            knowing = [n for n in nodes if newcomer.node_id in {c.id for c in n.contacts()}]
            assert {n.node_id for n in knowing} == mine
        finally:
            await newcomer.close()
