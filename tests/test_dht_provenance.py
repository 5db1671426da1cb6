"""The pure logic behind Sybil-proof listings: origins, witnessed ages, listing order, eviction
by scope, and the store intake's budgets and forgery penalty (no sockets)."""

from __future__ import annotations

import contextlib
import math
import time

import pytest

from swarm.auth import Membership
from swarm.dht import DHTEntry, key_digest
from swarm.dht.budgets import FORGERY_PENALTY, SUBNET_SHARE, VERIFY_BURST, HostBuckets
from swarm.dht.envelope import DatagramAuth, SenderKeys
from swarm.dht.listing import Standing, interleave, listing_order
from swarm.dht.pages import AGE_BYTES, answer_page
from swarm.dht.provenance import (
    LIVE_FOR_S,
    MAX_WITNESSED_AGE_S,
    Origin,
    SlotHistory,
    median_age,
    possible_life,
    reported_age,
)
from swarm.dht.reads import merge_reads
from swarm.dht.records import MAX_SUBKEYS_PER_KEY, RecordStorage
from swarm.dht.scopes import ScopeTally
from swarm.dht.store_intake import StoreIntake
from swarm.errors import DHTError
from swarm.identity import Identity

KEY = key_digest("run/peers")
NOW = 1_000_000.0


def entry(identity: Identity, subkey: str = "", value: bytes = b"r", ttl: float = 600.0):
    return DHTEntry.create(identity, KEY, subkey, value, time.time() + ttl)


def owner_key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def keys_of(identity: Identity) -> SenderKeys:
    """What a datagram from ``identity``'s node carries."""
    return SenderKeys(identity.public_key, identity.agreement_key, identity.agreement_signature)


def intake_for(storage: RecordStorage, budget: HostBuckets) -> StoreIntake:
    return StoreIntake(storage, budget, DatagramAuth(Identity.generate(), Membership.open()))


# ---- listing order


def test_interleave_takes_one_of_each_in_turn():
    assert interleave([[1, 2, 3], ["a"], [10, 20]]) == [1, "a", 10, 2, 20, 3]
    assert interleave([]) == [] and interleave([[], [1]]) == [1]


def test_a_crowd_of_one_host_takes_one_turn_per_cycle():
    # 200 identities that sort first by key, stored before the honest ones, from one host
    standings = {
        owner_key(i): Standing("127.0.9.0/24", "127.0.9.1/32", True, NOW + i) for i in range(200)
    }
    honest = [owner_key(10_000 + i) for i in range(3)]
    for i, owner in enumerate(honest):
        standings[owner] = Standing("127.0.0.0/24", f"127.0.0.{i + 2}/32", True, NOW + 500)
    order = listing_order(standings)
    assert sorted(order) == sorted(standings)  # everyone, once
    assert set(order[:6]) >= set(honest)  # the crowd's subnet alternates with the honest one
    # sixteen hosts of one /24 are still one subnet: one turn per cycle
    for i in range(200):
        standings[owner_key(i)] = Standing(
            "127.0.9.0/24", f"127.0.9.{i % 16 + 1}/32", True, NOW + i
        )
    assert set(listing_order(standings)[:6]) >= set(honest)


def test_an_ipv6_crowd_of_many_64s_in_one_48_is_one_subnet():
    crowd = [Origin.of(f"2001:db8:7:{i:x}::1", True) for i in range(200)]
    assert len({o.host for o in crowd}) == 200 and len({o.subnet for o in crowd}) == 1
    standings = {
        owner_key(i): Standing(o.subnet, o.host, True, NOW + i) for i, o in enumerate(crowd)
    }
    honest = Origin.of("2001:db8:1:2::9", True)
    standings[owner_key(9999)] = Standing(honest.subnet, honest.host, True, NOW + 500)
    assert owner_key(9999) in listing_order(standings)[:2]


def test_inside_a_host_live_owners_come_first_then_the_oldest():
    host = ("127.0.0.0/24", "127.0.0.1/32")
    standings = {
        owner_key(1): Standing(*host, live=False, since=NOW - 1000),  # stale, oldest
        owner_key(2): Standing(*host, live=True, since=NOW - 10),
        owner_key(3): Standing(*host, live=True, since=NOW - 100),
    }
    assert listing_order(standings) == [owner_key(3), owner_key(2), owner_key(1)]


def test_subnets_and_hosts_take_turns_in_the_order_of_their_best_owner():
    standings = {
        owner_key(1): Standing("10.0.0.0/24", "10.0.0.1/32", True, NOW),
        owner_key(2): Standing("10.0.0.0/24", "10.0.0.1/32", True, NOW + 1),
        owner_key(3): Standing("10.0.0.0/24", "10.0.0.2/32", True, NOW + 2),
        owner_key(4): Standing("10.0.1.0/24", "10.0.1.1/32", True, NOW - 5),  # oldest subnet
    }
    # subnets: 10.0.1 (oldest) then 10.0.0; inside 10.0.0: hosts .1 and .2 alternate
    assert listing_order(standings) == [owner_key(4), owner_key(1), owner_key(3), owner_key(2)]


# ---- origins and witnessed ages


def test_a_slot_keeps_its_first_store_time_across_refreshes_and_a_first_hand_store_corrects_it():
    storage = RecordStorage()
    owner = Identity.generate()
    relay = Origin.of("10.1.2.3", first_hand=False)
    first = entry(owner, ttl=60)
    assert storage.merge(first, now=time.time(), origin=relay)
    started = time.time()
    # a refresh (later expiration) by a second-hand store keeps the relayer's scope
    assert storage.merge(entry(owner, ttl=120), now=started + 5, origin=relay)
    assert storage.witnessed_age(first, started + 5) >= 5
    assert storage.fair_order(KEY, started + 5)[0][0].expiration > first.expiration
    history = storage.history(first)
    assert history is not None and history.origin == relay and not history.live(started + 5)
    # the owner speaks for itself: its scope replaces the relayer's, the age stays
    own = Origin.of("192.0.2.7", first_hand=True)
    assert storage.merge(entry(owner, ttl=180), now=started + 10, origin=own)
    assert storage.history(first) is history  # the same slot's history, kept
    assert history.origin == own and history.live(started + 10)
    assert storage.witnessed_age(first, started + 10) >= 10
    # and a later second-hand store never takes it back
    storage.touch(entry(owner, ttl=180), relay, started + 11)
    assert history.origin == own
    assert not history.live(started + 10 + LIVE_FOR_S + 1)


def test_ages_are_capped_and_the_median_resists_a_lying_minority():
    history = SlotHistory.start(Origin.of("10.0.0.1", True), NOW)
    assert history.age(NOW - 50) == 0.0  # a clock step back reads 0
    assert history.age(NOW + 1e12) == MAX_WITNESSED_AGE_S
    assert median_age([]) == 0.0
    assert median_age([30.0]) == 30.0
    assert median_age([30.0, 1e12]) == 30.0  # one liar of two cannot raise it
    assert median_age([30.0, 40.0, 1e12]) == 40.0
    assert median_age([30.0, 1e12, 1e12]) == MAX_WITNESSED_AGE_S  # a majority can, capped
    for junk in (math.nan, math.inf, "7", True, None, [1]):
        assert reported_age(junk) is None
    assert reported_age(-5) == 0.0 and reported_age(1e12) == MAX_WITNESSED_AGE_S


def test_a_read_ages_each_slot_by_the_median_of_its_holders_capped_to_the_entrys_life():
    owner = Identity.generate()
    e = entry(owner)
    merged = merge_reads(
        [e, e], {e.slot: {b"a": 100.0, b"b": 200.0, b"c": 1e9}}, lambda _: True, time.time()
    )
    assert [x.age_s for x in merged.values()] == [200.0]
    unheard = merge_reads([e], {}, lambda _: True, time.time())
    assert [x.age_s for x in unheard.values()] == [0.0]
    # an entry signed to last a week was signed moments ago, whatever every holder claims
    squat = entry(owner, "squat", ttl=MAX_WITNESSED_AGE_S - 30)
    now = time.time()
    merged = merge_reads([squat], {squat.slot: {b"a": 1e5, b"b": 1e5}}, lambda _: True, now)
    assert 29 <= next(iter(merged.values())).age_s <= 31
    assert possible_life(now + 30, now) == MAX_WITNESSED_AGE_S - 30


def test_an_answer_page_carries_one_age_per_entry_within_its_budget():
    storage = RecordStorage()
    owners = [Identity.generate() for _ in range(20)]
    now = time.time()
    for i, owner in enumerate(owners):
        storage.merge(
            entry(owner, value=bytes(1000)),
            now=now - 100 + i,
            origin=Origin.of(f"10.0.{i}.1", True),
        )
    size = storage.size_of(storage.entries(KEY)[0]) + AGE_BYTES
    page = answer_page(storage, KEY, 0, 0, 5 * size + 1)
    assert len(page.entries) == len(page.ages) == 5 and page.used <= 5 * size + 1
    assert page.next == [0, 5]
    assert all(95 <= age <= 101 for age in page.ages)
    rest = answer_page(storage, KEY, *page.next, 10**6)
    assert len(rest.entries) == 15 and rest.next is None


# ---- eviction by scope


def test_scope_tally_evicts_from_the_biggest_other_subnet_then_host_then_owner():
    tally = ScopeTally()
    crowd, honest = Origin.of("10.9.0.1", True), Origin.of("10.0.0.1", True)
    for i in range(10):
        tally.add(crowd, owner_key(i), ("crowd", i), 1)
    tally.add(honest, owner_key(100), ("honest", 0), 1)
    assert tally.victim(honest, owner_key(101), 1) == ("crowd", 9)  # the crowd's newest
    # inside the crowd's subnet, another host of it first
    assert tally.victim(crowd, owner_key(50), 1) is None  # the crowd's host is the biggest
    other_host = Origin.of("10.9.0.2", True)
    assert tally.victim(other_host, owner_key(51), 1) == ("crowd", 9)
    tally.remove(crowd, owner_key(9), ("crowd", 9))
    tally.remove(honest, owner_key(100), ("honest", 0))
    assert tally.victim(honest, owner_key(101), 1) == ("crowd", 8)
    for i in range(9):
        tally.remove(crowd, owner_key(i), ("crowd", i))
    assert tally.victim(honest, owner_key(101), 1) is None  # nothing left to take


def test_a_full_key_makes_room_for_another_subnet_whatever_the_crowds_identities():
    storage = RecordStorage(max_owner_bytes=1 << 30)
    crowd = [Identity.generate() for _ in range(MAX_SUBKEYS_PER_KEY // 32)]
    now = time.time()
    for n, identity in enumerate(crowd):
        for i in range(32):
            origin = Origin.of(f"127.0.9.{(n * 32 + i) % 16 + 1}", True)
            assert storage.merge(entry(identity, f"s{i}", b""), now, origin)
    assert len(storage.entries(KEY)) == MAX_SUBKEYS_PER_KEY
    newcomers = [Identity.generate() for _ in range(40)]
    for i, identity in enumerate(newcomers):
        origin = Origin.of(f"127.0.{i % 4}.2", True)
        assert storage.merge(entry(identity), now, origin)
    held = {e.public_key for e in storage.entries(KEY)}
    assert {i.public_key for i in newcomers} <= held
    assert len(storage.entries(KEY)) == MAX_SUBKEYS_PER_KEY


def test_a_full_node_evicts_from_the_subnet_holding_the_most_bytes():
    storage = RecordStorage(max_bytes=64 * 1024, max_owner_bytes=1 << 30)
    now = time.time()
    for _ in range(40):  # many small identities of one host fill the node
        sybil = Identity.generate()
        storage.merge(entry(sybil, value=bytes(3000)), now, Origin.of("127.0.9.1", True))
    honest = Identity.generate()
    # an honest owner of another subnet with several entries is never the one evicted
    for i in range(4):
        assert storage.merge(entry(honest, f"k{i}", bytes(2000)), now, Origin.of("10.0.0.1", True))
    for _ in range(20):
        sybil = Identity.generate()
        storage.merge(entry(sybil, value=bytes(3000)), now, Origin.of("127.0.9.1", True))
    assert sum(e.public_key == honest.public_key for e in storage.entries(KEY)) == 4
    assert storage.stored_bytes <= 64 * 1024 and storage.evicted > 0


# ---- the store intake


def forged_after(valid: list[DHTEntry]) -> DHTEntry:
    victim = Identity.generate()
    v = valid[0]
    return DHTEntry(v.key, "forged", b"evil", v.expiration, victim.public_key, v.signature)


def test_a_store_is_checked_in_order_up_to_the_first_forgery_which_costs_the_source():
    storage = RecordStorage()
    budget = HostBuckets(200.0, VERIFY_BURST, SUBNET_SHARE)
    intake = intake_for(storage, budget)
    sybil = Identity.generate()
    valid = [entry(sybil, f"s{i}") for i in range(5)]
    wire = [e.to_wire() for e in [*valid[:3], forged_after(valid), *valid[3:]]]
    with pytest.raises(DHTError, match="forged"):
        intake.admit("127.0.9.1", keys_of(sybil), KEY, wire)
    assert {e.subkey for e in storage.entries(KEY)} == {"s0", "s1", "s2"}
    assert intake.signatures_checked == 4 and intake.forgeries == 1
    # another port, another address of the same host: in debt, refused before any check
    with pytest.raises(DHTError, match="spent"):
        intake.admit("127.0.9.1", keys_of(Identity.generate()), KEY, wire[3:])
    assert intake.signatures_checked == 4 and intake.refused_unchecked == 1
    # the subnet paid too, but less than its share: another host of it still stores
    assert budget.subnets.tokens("127.0.9.0/24") <= SUBNET_SHARE * VERIFY_BURST - FORGERY_PENALTY
    assert intake.admit("127.0.9.2", keys_of(sybil), KEY, [valid[3].to_wire()]) == 1
    # re-sending what is held costs no check
    assert intake.admit("127.0.9.2", keys_of(sybil), KEY, [e.to_wire() for e in valid]) == 5
    assert intake.signatures_checked == 6  # valid[3] and valid[4]


def test_the_store_budgets_are_per_host_and_per_subnet_never_per_port():
    intake = intake_for(RecordStorage(), HostBuckets(1e-6, 100.0, subnet_share=2.0))

    def batch() -> tuple[SenderKeys, list]:
        sybil = Identity.generate()
        return keys_of(sybil), [entry(sybil, f"s{i}").to_wire() for i in range(30)]

    def flood(host: str, stores: int) -> int:
        taken = 0
        for _ in range(stores):
            sender, entries = batch()
            with contextlib.suppress(DHTError):
                taken += intake.admit(host, sender, KEY, entries)
        return taken

    assert flood("127.0.9.1", 8) == 90  # a host checks 100 at once, whatever its ports
    assert intake.signatures_checked == 90
    for i in range(8):  # its subnet 200: other hosts of it get what is left
        flood(f"127.0.9.{i + 2}", 2)
    assert intake.signatures_checked == 180 and intake.refused_unchecked > 0
    assert flood("10.0.0.1", 1) == 30  # elsewhere, nothing was spent


def test_only_a_sender_that_proves_its_key_stores_first_hand():
    storage = RecordStorage()
    intake = intake_for(storage, HostBuckets(200.0, VERIFY_BURST, SUBNET_SHARE))
    owner, impostor = Identity.generate(), Identity.generate()
    record = entry(owner)
    # a relayer claiming the owner's public key, with its own agreement key: the datagram's
    # MAC holds, the binding does not; the copy is valid but counts as the relayer's
    spoofed = SenderKeys(owner.public_key, impostor.agreement_key, impostor.agreement_signature)
    assert intake.admit("127.0.9.1", spoofed, KEY, [record.to_wire()]) == 1
    history = storage.history(record)
    assert history is not None and history.origin == Origin.of("127.0.9.1", first_hand=False)
    assert not history.live(time.time())
    # the owner itself, from its own address, corrects it (no signature to check again) ...
    assert intake.admit("10.0.0.7", keys_of(owner), KEY, [record.to_wire()]) == 1
    assert history.origin == Origin.of("10.0.0.7", first_hand=True)
    assert intake.signatures_checked == 1
    # ... and the impostor cannot take it back
    intake.admit("127.0.9.1", spoofed, KEY, [entry(owner, ttl=900).to_wire()])
    assert history.origin == Origin.of("10.0.0.7", first_hand=True)
