"""The connection table's rules (swarm.net.admission) and the partial-frame budget per host and
subnet (swarm.net.limits.ByteBudget): pure logic, no sockets."""

from __future__ import annotations

import asyncio

import pytest

from swarm.errors import ConfigError
from swarm.net.admission import (
    HOST_FULL,
    SUBNET_FULL,
    TABLE_FULL,
    ConnectionQuotas,
    ConnectionTable,
    HostProofs,
)
from swarm.net.limits import ByteBudget

ATTACKER = [f"192.0.2.{i}" for i in range(1, 17)]  # one /24
HONEST = "198.51.100.7"


def table(max_connections: int, per_host: int = 4, **kw: int) -> ConnectionTable:
    return ConnectionTable(ConnectionQuotas(max_connections, per_host, **kw))


def test_quotas_are_per_host_and_per_subnet_not_per_port_or_address() -> None:
    t = table(1000, per_host=4)  # a subnet holds 8 hosts' worth: 32
    verdicts = [t.admit(("a", port), ATTACKER[0], proved=False) for port in range(64)]
    assert [v.admitted for v in verdicts].count(True) == 4 and verdicts[4].reason == HOST_FULL
    for address in ATTACKER[1:]:
        for port in range(4):
            t.admit((address, port), address, proved=False)
    assert t.total == 32  # 16 addresses of one /24 hold one subnet's quota
    assert t.admit("x", "192.0.2.200", proved=True).reason == SUBNET_FULL
    assert t.admit("h", HONEST, proved=False).admitted
    # IPv6: one /64 is one host, whatever the interface id; one /48 is one subnet
    assert [
        t.admit(("v6", i), f"2001:db8:1:2::{i:x}", proved=False).admitted for i in range(6)
    ] == [True] * 4 + [False] * 2
    # an IPv4-mapped IPv6 address is its IPv4 host
    assert t.admit("mapped", f"::ffff:{HONEST}", proved=False).admitted
    assert t.total == 32 + 1 + 4 + 1


def test_unproved_sources_leave_the_reserved_room_to_proved_ones() -> None:
    t = table(8, per_host=1, per_subnet=16, reserved=2)
    for i in range(6):  # six unproved subnets of one connection each: 6 = 8 - 2 reserved
        assert t.admit((i, 0), f"10.{i}.0.1", proved=False).admitted
    # one more unproved subnet: none holds 2 more than its own, so it is refused
    assert t.admit("late", "10.9.0.1", proved=False).reason == TABLE_FULL
    assert t.unproved == 6
    # proved hosts take the reserved room without pushing anyone out
    assert t.admit("p1", "10.8.0.1", proved=True).evict is None
    assert t.admit("p2", "10.8.0.2", proved=True).evict is None
    assert t.total == 8
    t.release((0, 0))
    assert t.admit("again", "10.9.0.1", proved=False).admitted


def test_a_newcomer_evicts_the_richest_subnets_oldest_idle_unproved_connection() -> None:
    t = table(10, per_host=4, per_subnet=32, reserved=2)
    for i in range(8):  # 8 unproved connections from one /24: the unproved room is full
        t.admit(i, ATTACKER[i // 4], proved=False)
    t.request_started(0)  # busy: spared while an idle one exists
    verdict = t.admit("honest", HONEST, proved=False)
    assert verdict.admitted and verdict.evict == 1
    assert 1 not in t and 0 in t and t.evicted == 1
    # the attacker's own newcomer may not push out a subnet poorer than its own
    assert t.admit(99, ATTACKER[3], proved=False).reason == TABLE_FULL
    assert "honest" in t


def test_equal_subnets_do_not_evict_each_other() -> None:
    t = table(4, per_host=2, per_subnet=2, reserved=0)
    for i, address in enumerate(["10.0.0.1", "10.0.0.1", "10.1.0.1", "10.1.0.1"]):
        t.admit(i, address, proved=False)
    # a third subnet with 0 evicts from a subnet holding 2 (>= 0 + 2)
    assert t.admit("third", "10.2.0.1", proved=False).evict in (0, 1, 2, 3)
    # now subnets hold 1, 2, 1 (or 2, 1, 1): a newcomer of a subnet holding 1 may not take
    # from one holding 2 (2 < 1 + 2), so nobody is pushed around in turn
    assert t.admit("fourth", "10.2.0.2", proved=False).reason == TABLE_FULL


def test_proved_newcomers_fill_the_table_then_evict_fairly_idle_before_busy() -> None:
    t = table(6, per_host=6, per_subnet=6, reserved=1)
    for i in range(5):
        t.admit(i, ATTACKER[0], proved=False)
    t.prove("192.0.2.1/32")  # the attacker proved its host (free in an open swarm)
    assert t.unproved == 0
    assert t.admit("p", HONEST, proved=True).evict is None
    for i in range(5):
        t.request_started(i)
    t.request_ended(3)
    # a fresh subnet's newcomer evicts the richest subnet's oldest idle connection (3),
    # even a proved one: proof buys priority, not a monopoly
    assert t.admit("n", "203.0.113.1", proved=False).evict == 3
    # with every connection of the richest subnet busy, its oldest goes
    assert t.admit("m", "203.0.114.1", proved=False).evict == 0


def test_a_proved_newcomer_displaces_an_idle_unproved_connection_when_nothing_is_fair() -> None:
    t = table(4, per_host=4, per_subnet=4, reserved=1)
    t.admit("u1", "10.0.0.1", proved=False)
    t.admit("u2", "10.1.0.1", proved=False)
    t.admit("u3", "10.2.0.1", proved=False)
    t.admit("p1", HONEST, proved=True)
    assert t.admit("x", "10.3.0.1", proved=False).reason == TABLE_FULL
    verdict = t.admit("p2", HONEST, proved=True)
    assert verdict.admitted and verdict.evict == "u1"


def test_host_proofs_expire_and_stay_bounded() -> None:
    proofs = HostProofs(ttl_s=10, max_hosts=2)
    assert proofs.prove("10.0.0.1", now=0) == "10.0.0.1/32"
    assert proofs.proved("10.0.0.1", now=5) and not proofs.proved("10.0.0.1", now=11)
    assert proofs.proved("2001:db8::1", now=0) is False
    proofs.prove("2001:db8::1", now=0)
    assert proofs.proved("2001:db8::ffff", now=1)  # the same /64
    proofs.prove("10.0.0.2", now=2)  # the oldest is forgotten beyond max_hosts
    assert not proofs.proved("10.0.0.1", now=3)


def test_quotas_are_validated() -> None:
    assert ConnectionQuotas(100, 4).per_subnet == 32 and ConnectionQuotas(100, 4).reserved == 25
    for bad in (dict(max_connections=0), dict(per_host=0), dict(reserved=100)):
        with pytest.raises(ConfigError):
            ConnectionQuotas(**{"max_connections": 100, "per_host": 4, **bad})
    with pytest.raises(ConfigError):
        ConnectionQuotas(100, 8, per_subnet=4)


async def test_byte_budget_holds_hosts_and_subnets_to_their_shares() -> None:
    budget = ByteBudget(100, per_subnet=50, per_host=30)
    await budget.acquire(30, "192.0.2.1")
    host_waits = asyncio.ensure_future(budget.acquire(10, "192.0.2.1"))
    await budget.acquire(20, "192.0.2.2")  # the subnet is now full (50)
    subnet_waits = asyncio.ensure_future(budget.acquire(10, "192.0.2.3"))
    await budget.acquire(30, "198.51.100.1")  # another subnet is not held back
    await asyncio.sleep(0.01)
    assert not host_waits.done() and not subnet_waits.done()
    assert budget.used == 80 and budget.held_by("192.0.2.1") == 30
    budget.release(20, "192.0.2.2")
    await asyncio.wait_for(subnet_waits, 1)
    assert not host_waits.done()
    budget.release(30, "192.0.2.1")
    await asyncio.wait_for(host_waits, 1)
    assert budget.held_by("192.0.2.1") == 10
    for size, source in ((10, "192.0.2.1"), (10, "192.0.2.3"), (30, "198.51.100.1")):
        budget.release(size, source)
    assert budget.used == 0 and budget.held_by("192.0.2.1") == 0
    # a frame larger than a host's share counts as the share (it never waits forever)
    await asyncio.wait_for(budget.acquire(1000, "10.0.0.1"), 1)
    assert budget.used == 30
