"""The DHT under attack on real loopback sockets: bloat, floods, amplification, replayed pings.

Each test is one attack an outsider can mount against a real node, bounded in count and time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import time

import msgpack
from dht_nodes import ATTACKER_HOST, HOST, swarm_of

from swarm.auth import Membership
from swarm.dht import DHTEntry, DHTNode, key_digest
from swarm.dht.envelope import REQUEST, DatagramAuth
from swarm.dht.records import (
    MAX_OWNER_BYTES,
    MAX_SUBKEYS_PER_OWNER,
    MAX_TTL_S,
    MAX_VALUE_BYTES,
    RecordStorage,
)
from swarm.dht.request_format import FIRST_CONTACT_LOOKUP_BYTES
from swarm.dht.store_intake import MAX_ENTRIES_PER_STORE
from swarm.identity import Identity

PEERS_KEY = "run/peers"


def junk_entries(identity: Identity, key: str, count: int, start: int = 0) -> list[DHTEntry]:
    """``count`` entries of the largest value, living as long as allowed."""
    expiration = time.time() + MAX_TTL_S - 60
    value = os.urandom(MAX_VALUE_BYTES)
    return [
        DHTEntry.create(identity, key_digest(key), f"junk-{i}", value, expiration)
        for i in range(start, start + count)
    ]


async def flood_store(attacker: DHTNode, victims: list[DHTNode], key: str, entries) -> None:
    """Send ``entries`` to every victim's store, as the attacker's protocol batches them."""
    protocol = attacker.protocol
    digest = key_digest(key)
    contacts = [c for c in attacker.contacts() if c.port in {v.port for v in victims}]
    assert contacts
    await asyncio.gather(*(protocol.send_entries(c, digest, entries) for c in contacts))


async def announce_all(nodes: list[DHTNode]) -> None:
    for node in nodes:
        assert await node.store(PEERS_KEY, b"record", time.time() + 120, subkey="peer") > 0


def owners(found) -> set[bytes]:
    return {entry.public_key for entry in found.values()}


# ---- storage (sans-I/O): no one owner fills it


def test_one_owner_is_held_to_its_quota():
    storage = RecordStorage()
    attacker = Identity.generate()
    taken = sum(storage.merge(e) for e in junk_entries(attacker, "a", 200))
    taken += sum(storage.merge(e) for e in junk_entries(attacker, "b", 200))
    assert storage.stored_bytes <= MAX_OWNER_BYTES
    assert taken < 400 and storage.refused == 400 - taken
    honest = DHTEntry.create(Identity.generate(), key_digest("a"), "", b"x", time.time() + 60)
    assert storage.merge(honest)


def test_a_full_key_makes_room_for_a_new_owner_by_evicting_the_biggest():
    storage = RecordStorage(max_subkeys_per_owner=2048, max_owner_bytes=1 << 30)
    attacker = Identity.generate()
    small = [
        DHTEntry.create(attacker, key_digest("k"), f"s{i}", b"", time.time() + 600)
        for i in range(1024)
    ]
    assert sum(storage.merge(e) for e in small) == 1024
    for _ in range(20):
        honest = DHTEntry.create(Identity.generate(), key_digest("k"), "", b"me", time.time() + 60)
        assert storage.merge(honest)
    assert len(storage.entries(key_digest("k"))) == 1024
    assert storage.evicted == 20


def test_a_full_node_evicts_the_biggest_owner_first():
    storage = RecordStorage(max_bytes=64 * 1024, max_owner_bytes=1 << 30)
    big, honest = Identity.generate(), Identity.generate()
    sum(storage.merge(e) for e in junk_entries(big, "k", 100))
    assert storage.stored_bytes <= 64 * 1024
    entry = DHTEntry.create(honest, key_digest("k"), "", bytes(3000), time.time() + 60)
    assert storage.merge(entry)
    assert storage.evicted >= 1 and storage.stored_bytes <= 64 * 1024


def test_fair_order_puts_every_owner_in_the_first_round():
    storage = RecordStorage()
    flooder = Identity.generate()
    for e in junk_entries(flooder, "k", MAX_SUBKEYS_PER_OWNER):
        storage.merge(e)
    honest = [Identity.generate() for _ in range(5)]
    for identity in honest:
        storage.merge(DHTEntry.create(identity, key_digest("k"), "", b"r", time.time() + 60))
    rounds = storage.fair_order(key_digest("k"))
    assert len(rounds) == MAX_SUBKEYS_PER_OWNER
    assert {e.public_key for e in rounds[0]} == {i.public_key for i in [flooder, *honest]}
    assert all(len({e.public_key for e in r}) == len(r) for r in rounds)


# ---- against real nodes


async def test_large_long_lived_entries_of_one_owner_do_not_hide_honest_peers():
    async with swarm_of(4) as nodes:
        honest, attacker = nodes[:3], nodes[3]
        await announce_all(honest)
        hostile = Identity.generate()
        await flood_store(attacker, honest, PEERS_KEY, junk_entries(hostile, PEERS_KEY, 32))
        for node in honest:
            found = await node.get(PEERS_KEY)
            assert {n.identity.public_key for n in honest} <= owners(found)


async def test_a_thousand_subkeys_do_not_stop_new_announcements():
    async with swarm_of(4, hosts=[HOST] * 3 + [ATTACKER_HOST], hostile=True) as nodes:
        honest, attacker = nodes[:3], nodes[3]
        hostile = Identity.generate()
        expiration = time.time() + MAX_TTL_S - 60
        many = [
            DHTEntry.create(hostile, key_digest(PEERS_KEY), f"s{i}", b"", expiration)
            for i in range(1024)
        ]
        await flood_store(attacker, honest, PEERS_KEY, many)
        assert all(len(n.storage.entries(key_digest(PEERS_KEY))) <= 32 for n in honest)
        await announce_all(honest)  # each store is taken (asserted inside)
        found = await honest[0].get(PEERS_KEY)
        assert {n.identity.public_key for n in honest} <= owners(found)


async def test_a_newcomer_gets_a_bounded_replica_without_the_bloat():
    async with swarm_of(3, hosts=[HOST] * 2 + [ATTACKER_HOST], hostile=True) as nodes:
        hostile = Identity.generate()
        for i in range(20):
            await flood_store(nodes[2], nodes[:2], f"k{i}", junk_entries(hostile, f"k{i}", 64))
        assert all(n.storage.stored_bytes <= MAX_OWNER_BYTES for n in nodes[:2])
        newcomer = await DHTNode.create(Identity.generate(), Membership.open(), host=HOST)
        try:
            assert await newcomer.bootstrap([f"{HOST}:{nodes[0].port}"]) > 0
            await asyncio.sleep(1.5)
            assert newcomer.storage.stored_bytes <= MAX_OWNER_BYTES
            assert await newcomer.store(PEERS_KEY, b"r", time.time() + 60, subkey="p") > 0
            found = await nodes[0].get(PEERS_KEY)
            assert newcomer.identity.public_key in owners(found)
        finally:
            await newcomer.close()


async def test_presigned_store_floods_cost_bounded_signature_checks():
    async with swarm_of(3, hosts=[HOST] * 2 + [ATTACKER_HOST], hostile=True) as nodes:
        honest, attacker = nodes[:2], nodes[2]
        await announce_all(honest)
        hostile = Identity.generate()
        victim = honest[0]
        contact = next(c for c in attacker.contacts() if c.port == victim.port)
        digest = key_digest("flood")
        expiration = time.time() + 3600
        batches = [
            [
                DHTEntry.create(hostile, digest, f"{b}.{i}", b"", expiration).to_wire()
                for i in range(MAX_ENTRIES_PER_STORE)
            ]
            for b in range(40)
        ]
        protocol = attacker.protocol

        async def flood() -> None:  # paced a little: a burst would overflow the UDP buffer
            calls = []
            for batch in batches:
                calls.append(protocol.spawn(protocol.call(contact, "store", digest, batch)))
                await asyncio.sleep(0.01)
            await asyncio.gather(*calls)

        flooding = asyncio.ensure_future(flood())
        found = await honest[1].get(PEERS_KEY)
        await flooding
        assert {n.identity.public_key for n in honest} <= owners(found)
        assert victim.counters()["stores_refused_unchecked"] > 0  # most were never checked
        checked = len(victim.storage.entries(digest))
        assert checked < 40 * MAX_ENTRIES_PER_STORE
        assert victim.counters()["signatures_checked"] < 40 * MAX_ENTRIES_PER_STORE


def _raw_request(auth: DatagramAuth, target, body) -> bytes:
    return auth.seal(REQUEST, os.urandom(16), body, target)


async def test_answers_to_an_unproved_source_are_no_larger_than_the_request():
    async with swarm_of(3) as nodes:
        await announce_all(nodes)
        for node in nodes:  # fill the key so that a full answer is large
            await flood_store(
                node,
                [n for n in nodes if n is not node],
                PEERS_KEY,
                junk_entries(node.identity, PEERS_KEY, 10),
            )
        victim = nodes[0]
        auth = DatagramAuth(Identity.generate(), Membership.open())
        target = victim.protocol.source_node.keys
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((HOST, 0))
        sock.settimeout(1.0)
        loop = asyncio.get_running_loop()
        pad = [False, b"", bytes(96)]
        cookie = None
        try:
            sizes = []
            for body in (
                ["find_value", [key_digest(PEERS_KEY)]],  # unpadded: not even a cookie fits
                ["find_node", [key_digest("x")]],
                ["find_value", [key_digest(PEERS_KEY)], *pad],
                ["find_node", [key_digest("x")], *pad],
                ["ping", [], *pad],
                ["find_value", [key_digest(PEERS_KEY)], False, os.urandom(16)],  # forged cookie
            ):
                request = _raw_request(auth, target, body)
                sock.sendto(request, (HOST, victim.port))
                try:
                    answer, _ = await loop.run_in_executor(None, sock.recvfrom, 65536)
                except TimeoutError:
                    sizes.append((len(request), 0))
                    continue
                sizes.append((len(request), len(answer)))
                cookie = auth.open(answer).body["cookie"]
            assert all(out <= sent for sent, out in sizes), sizes
            assert sum(out > 0 for _, out in sizes) >= 3, sizes
            # a lookup's first contact pads its request: the answer, cut to that size, already
            # holds entries and contacts (no round trip for the cookie), never more bytes
            assert await nodes[1].store("small", b"value", time.time() + 60) == 3
            big = junk_entries(nodes[1].identity, "big", 3)  # no small entry to fit first
            await flood_store(nodes[1], [victim], "big", big)
            padded = [False, b"", bytes(FIRST_CONTACT_LOOKUP_BYTES - 500)]
            for key, useful in ((key_digest("small"), True), (key_digest("big"), False)):
                request = _raw_request(auth, target, ["find_value", [key], *padded])
                sock.sendto(request, (HOST, victim.port))
                answer, _ = await loop.run_in_executor(None, sock.recvfrom, 65536)
                assert len(answer) <= len(request)
                first = auth.open(answer).body
                assert isinstance(first["cookie"], bytes) and first["nodes"]
                if useful:
                    assert first["entries"] and "retry" not in first
                else:  # the 4 KiB junk entries do not fit: ask again with the cookie
                    assert not first["entries"] and first["retry"] is True
            # echoing the cookie proves the address: the full answer comes back
            body = ["find_value", [key_digest(PEERS_KEY)], False, cookie]
            request = _raw_request(auth, target, body)
            sock.sendto(request, (HOST, victim.port))
            answer, _ = await loop.run_in_executor(None, sock.recvfrom, 65536)
            assert len(answer) > len(request)
            assert len(auth.open(answer).body["entries"]) >= 3
        finally:
            sock.close()


async def test_a_replayed_first_contact_ping_files_nobody():
    async with swarm_of(2) as nodes:
        first, second = nodes
        pinger = Identity.generate()
        auth = DatagramAuth(pinger, Membership.open())
        body = ["ping", [], False, b"", bytes(96)]
        captured = auth.seal(REQUEST, os.urandom(16), body, None)
        replayer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        replayer.bind((HOST, 0))
        replayer.settimeout(2.0)
        loop = asyncio.get_running_loop()
        try:
            for node in (first, second):  # the capture, sent on by the replayer to both nodes
                replayer.sendto(captured, (HOST, node.port))
                answer, _ = await loop.run_in_executor(None, replayer.recvfrom, 65536)
                assert len(answer) <= len(captured)
            await asyncio.sleep(0.2)
            for node in (first, second):
                filed = [c for c in node.contacts() if c.keys.public_key == pinger.public_key]
                assert filed == []
        finally:
            replayer.close()


async def test_udp_junk_flood_does_not_stop_a_client_listing():
    async with swarm_of(3, hostile=True) as nodes:
        await announce_all(nodes)
        target = (HOST, nodes[0].port)
        stop = asyncio.Event()

        async def flood() -> int:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind((ATTACKER_HOST, 0))
            sock.setblocking(False)
            sent = 0
            deadline = time.monotonic() + 3.0
            try:
                while not stop.is_set() and time.monotonic() < deadline and sent < 60_000:
                    for _ in range(200):
                        try:
                            sock.sendto(os.urandom(64), target)
                            sent += 1
                        except BlockingIOError:
                            break
                    await asyncio.sleep(0.001)
            finally:
                sock.close()
            return sent

        flooding = asyncio.create_task(flood())
        await asyncio.sleep(0.2)
        client = await DHTNode.create(
            Identity.generate(), Membership.open(), host=HOST, client=True
        )
        try:
            assert await client.bootstrap([f"{HOST}:{nodes[0].port}"]) > 0
            found = await client.get(PEERS_KEY)
            assert {n.identity.public_key for n in nodes} <= owners(found)
        finally:
            stop.set()
            sent = await flooding
            await client.close()
        assert sent > 1000
        assert nodes[0].protocol.datagram_budget.refused > 0


def test_parse_rejects_a_malformed_cursor_and_padding():
    from swarm.dht.request_format import MAX_PADDING_BYTES, parse_request
    from swarm.errors import DHTError

    for body in (
        ["ping", [], False, b"", b"x" * (MAX_PADDING_BYTES + 1)],
        ["find_value", [b"k" * 20, 1, 2]],
        ["ping", [], False, b"", b"", b""],
    ):
        try:
            parse_request(body)
        except DHTError:
            continue
        raise AssertionError(f"accepted {body!r}")
    assert msgpack.packb(["ping", []])  # sanity: the module still packs


def _seal_at(auth: DatagramAuth, target, body, timestamp: float) -> bytes:
    """A targeted request stamped with ``timestamp`` (what a hostile sender controls)."""
    return auth.seal(REQUEST, os.urandom(16), body, target, timestamp=timestamp)


async def test_future_stamped_nonce_flood_does_not_lock_out_other_senders():
    async with swarm_of(3) as nodes:
        await announce_all(nodes)
        victim = nodes[0]
        guard = victim.protocol.auth._replay
        guard.max_entries, guard.max_per_sender = 300, 100  # the flood below overflows both
        target = victim.protocol.source_node.keys
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((HOST, 0))
        try:
            for _ in range(3):
                auth = DatagramAuth(Identity.generate(), Membership.open())
                for _ in range(200):
                    body = ["ping", [], False, b"", bytes(96)]
                    sock.sendto(_seal_at(auth, target, body, time.time() + 29), (HOST, victim.port))
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
            assert len(guard) <= 300
            for node in nodes[1:]:
                assert await node.protocol.call(victim.protocol.source_node, "ping") is not None
            found = await nodes[1].get(PEERS_KEY)
            assert {n.identity.public_key for n in nodes} <= owners(found)
        finally:
            sock.close()


async def test_a_checked_signature_does_not_vouch_for_another_expiration_or_value():
    """A reader that checked an entry once must not take the same signature on a changed copy:
    a lying holder stretches a record's expiration (a dead peer kept alive) or swaps its value."""
    async with swarm_of(3) as nodes:
        owner, liar, reader = nodes
        assert await owner.store("vouch", b"honest", time.time() + 30.0) >= 2
        digest = key_digest("vouch")
        (honest,) = (await reader.get("vouch")).values()  # checked, and remembered as checked
        assert honest.value == b"honest"
        stretched = dataclasses.replace(honest, expiration=honest.expiration + 600.0)
        swapped = dataclasses.replace(honest, value=b"lie", expiration=honest.expiration + 1.0)
        for lie in (stretched, swapped):
            (held,) = liar.storage.entries(digest)
            liar.storage._remove(digest, held.slot)  # (fault injection: a holder that lies)
            assert liar.storage.merge(lie)
            (seen,) = (await reader.get("vouch")).values()
            assert (seen.value, seen.expiration) == (b"honest", honest.expiration)


def test_single_misses_of_contacts_never_heard_again_stay_bounded():
    """A contact that missed one request and was never asked again (a departed peer, or one of
    a flood of fake contacts) left its count behind for good."""
    from types import SimpleNamespace

    from swarm.dht.suspects import MAX_SUSPECTS, Suspects

    suspects = Suspects(router=None)  # type: ignore[arg-type]  # first misses never evict
    for i in range(MAX_SUSPECTS + 500):
        suspects.failed(SimpleNamespace(id=i.to_bytes(20, "big")))  # type: ignore[arg-type]
    assert len(suspects._failures) == MAX_SUSPECTS
    assert (MAX_SUSPECTS + 499).to_bytes(20, "big") in suspects._failures  # the newest kept
