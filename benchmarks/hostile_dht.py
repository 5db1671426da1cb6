"""Sybil attacks on the DHT, for ``benchmarks/hostile.py`` (issue 35, items 2 and 3).

    python benchmarks/hostile.py --attacks sybil_eclipse port_spread_store_flood --duration 10

- ``sybil_eclipse``: ``rate`` identities ground to sort below every honest owner's public key
  each store one 4 KiB entry, first-hand (each identity is its own datagram sender), under the
  run's peers key on every peer, from one attacker host. Before, listings went by key order and
  a reader saw none of the honest peers.
- ``port_spread_store_flood``: 64 sockets of one host send ``rate`` stores per second in all,
  each of 63 valid entries and a forged one last. Before, the budget was per port: the victim
  checked 64 budgets' worth of signatures and a legitimate listing took 10 s.

The attacker sits on 127.0.9.0/24, away from the peers' 127.0.0.0/24. Each attack returns the
bytes it sent to the victims and the bytes they sent back (``amplification``).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from types import ModuleType
from typing import Any

from swarm.auth import Membership
from swarm.dht import DHTEntry, DHTNode, key_digest
from swarm.dht.envelope import REQUEST, DatagramAuth, SenderKeys
from swarm.dht.lookup import more_pages
from swarm.dht.records import MAX_TTL_S, MAX_VALUE_BYTES
from swarm.identity import Identity

ATTACKER_SUBNET = "127.0.9"
PORTS = 64


def _bench() -> ModuleType:
    """hostile.py's helpers: the running script's own module when it is hostile.py (its
    ``ACTIONS`` feed the report), else an import of it."""
    main = sys.modules.get("__main__")
    if main is not None and hasattr(main, "run_attack") and hasattr(main, "paced"):
        return main
    import hostile

    return hostile


async def _attacker_view(victims: list[Any]) -> tuple[DHTNode, dict[int, Any]]:
    """A node on the attacker's host, joined through the first victim, and each victim's
    contact (its keys) by port."""
    node = await DHTNode.create(Identity.generate(), Membership.open(), host=f"{ATTACKER_SUBNET}.1")
    await node.bootstrap([victims[0].address])
    ports = {v.port for v in victims}
    for _ in range(20):
        found = {c.port: c for c in node.contacts() if c.port in ports}
        if len(found) == len(ports):
            break
        await asyncio.sleep(0.25)
        await node.refresh_buckets()
    return node, found


def _store(auth: DatagramAuth, target: SenderKeys, key: bytes, entries: list[DHTEntry]) -> bytes:
    body = ["store", [key, [e.to_wire() for e in entries]]]
    return auth.seal(REQUEST, os.urandom(16), body, target)


async def _sockets(count: int, hosts: list[str]) -> list[Any]:
    bench = _bench()
    loop = asyncio.get_running_loop()
    sockets = []
    for i in range(count):
        _, proto = await loop.create_datagram_endpoint(
            bench.UdpCounter, local_addr=(hosts[i % len(hosts)], 0)
        )
        sockets.append(proto)
    return sockets


async def attack_sybil_eclipse(victims: list[Any], rate: float, duration: float):
    bench = _bench()
    node, contacts = await _attacker_view(victims)
    digest = key_digest(bench.PEERS_KEY)
    try:
        honest = await node.get(bench.PEERS_KEY)
    finally:
        await node.close()
    lowest = min((e.public_key for e in honest.values()), default=bytes([255] * 32))
    ground: list[Identity] = []
    while len(ground) < int(rate):  # grinding: keys that sort before every honest owner
        identity = Identity.generate()
        if identity.public_key < lowest:
            ground.append(identity)
    value = os.urandom(MAX_VALUE_BYTES)
    expiration = time.time() + MAX_TTL_S - 60
    entries = [DHTEntry.create(g, digest, "", value, expiration) for g in ground]
    auths = [DatagramAuth(g, Membership.open()) for g in ground]
    sockets = await _sockets(1, [f"{ATTACKER_SUBNET}.1"])
    sent = 0
    started = time.monotonic()
    try:
        for contact in contacts.values():
            for i, (auth, entry) in enumerate(zip(auths, entries, strict=True)):
                datagram = _store(auth, contact.keys, digest, [entry])
                sockets[0].transport.sendto(datagram, contact.address)
                sent += len(datagram)
                if i % 20 == 19:
                    await asyncio.sleep(0.01)
        await asyncio.sleep(1.0)
        held = await _ground_held(victims, {g.public_key for g in ground}, digest)
        print(f"sybil_eclipse: ground identities held per victim: {held}", file=sys.stderr)
        await asyncio.sleep(max(0.0, duration - (time.monotonic() - started)))
    finally:
        for s in sockets:
            s.transport.close()
    return sent, sum(s.received for s in sockets)


async def _ground_held(victims: list[Any], ground: set[bytes], digest: bytes) -> list[int]:
    """How many of the ground identities each victim holds (all its answer pages read), so
    that a listing that stayed complete is not for want of an attack that landed."""
    node, contacts = await _attacker_view(victims)
    try:
        pages = await asyncio.gather(
            *(more_pages(node.protocol, digest, c, [0, 0], 1000) for c in contacts.values())
        )
    finally:
        await node.close()
    return [len({e.public_key for e in p.entries} & ground) for p in pages]


async def attack_port_spread_store_flood(victims: list[Any], rate: float, duration: float):
    bench = _bench()
    node, contacts = await _attacker_view(victims[:1])
    await node.close()
    victim = contacts[victims[0].port]
    digest = key_digest("flood")
    expiration = time.time() + 3600
    sockets = await _sockets(PORTS, [f"{ATTACKER_SUBNET}.1"])
    auths = [DatagramAuth(Identity.generate(), Membership.open()) for _ in sockets]
    stores = []
    for _ in sockets:  # 63 valid entries of two fresh owners, and a forged one last
        sybils = [Identity.generate(), Identity.generate()]
        valid = [DHTEntry.create(sybils[i % 2], digest, f"{i}", b"", expiration) for i in range(63)]
        forged = DHTEntry(
            digest, "x", b"", expiration, Identity.generate().public_key, valid[0].signature
        )
        stores.append([*valid, forged])
    count = [0]
    sent = [0]

    def send() -> None:
        i = count[0] % len(sockets)
        count[0] += 1
        datagram = _store(auths[i], victim.keys, digest, stores[i])
        sockets[i].transport.sendto(datagram, victim.address)
        sent[0] += len(datagram)

    cpu_before, started = _cpu_seconds(victims[0].proc.pid), time.monotonic()
    try:
        await bench.paced(rate, duration, send)
        cpu_after, elapsed = _cpu_seconds(victims[0].proc.pid), time.monotonic() - started
        await asyncio.sleep(0.5)
    finally:
        for s in sockets:
            s.transport.close()
    if cpu_before is not None and cpu_after is not None:
        share = (cpu_after - cpu_before) / elapsed
        print(f"port_spread_store_flood: victim CPU {share:.0%} of a core", file=sys.stderr)
    return sent[0], sum(s.received for s in sockets)


def _cpu_seconds(pid: int) -> float | None:
    """CPU time a process used so far (Linux /proc; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


DHT_ATTACKS = {
    # name: (function, rate): identities for the eclipse, stores per second for the flood
    "sybil_eclipse": (attack_sybil_eclipse, 200),
    "port_spread_store_flood": (attack_port_spread_store_flood, 640),
}
