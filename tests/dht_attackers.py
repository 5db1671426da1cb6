"""What a DHT attacker needs in the tests: raw UDP sockets on its own loopback addresses, sealed
requests (our own code, sent with faults: forged entries, ground identities), and key grinding."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any

from swarm.dht import DHTEntry
from swarm.dht.envelope import REQUEST, DatagramAuth, SenderKeys
from swarm.identity import Identity


def attacker_hosts(count: int, subnet: str = "127.0.9") -> list[str]:
    """``count`` addresses of the attacker's /24 (inside 127.0.0.0/8, away from the peers)."""
    return [f"{subnet}.{i + 1}" for i in range(count)]


def ground_identities(count: int, honest: int) -> tuple[list[Identity], list[Identity]]:
    """``count`` identities whose public keys all sort below those of ``honest`` others (what an
    attacker grinds for to come first in a key-ordered listing): (ground, honest).

    Drawn as one batch and split by key, so the cost does not depend on how low the honest keys
    happen to fall (grinding below random honest keys took minutes at times)."""
    batch = sorted((Identity.generate() for _ in range(count + honest)), key=lambda i: i.public_key)
    return batch[:count], batch[count:]


def forged_copy(entry: DHTEntry) -> DHTEntry:
    """``entry``'s signature under another owner's key: it never verifies."""
    other = Identity.generate().public_key
    return DHTEntry(entry.key, "forged", entry.value, entry.expiration, other, entry.signature)


def store_request(auth: DatagramAuth, target: SenderKeys, key: bytes, entries: list) -> bytes:
    body = ["store", [key, [e.to_wire() for e in entries]]]
    return auth.seal(REQUEST, os.urandom(16), body, target)


class _Counter(asyncio.DatagramProtocol):
    def __init__(self, arrived: asyncio.Event) -> None:
        self.answers: list[bytes] = []
        self.arrived = arrived
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.answers.append(data)
        self.arrived.set()

    def error_received(self, exc: Exception) -> None:
        pass


class RawSockets:
    """UDP sockets, ``per_host`` on each of ``hosts``, that send datagrams and collect answers."""

    def __init__(self, sockets: list[_Counter], arrived: asyncio.Event):
        self.sockets = sockets
        self._arrived = arrived
        self.sent = 0

    @classmethod
    async def open(cls, hosts: Sequence[str], per_host: int) -> RawSockets:
        loop = asyncio.get_running_loop()
        arrived = asyncio.Event()
        sockets = []
        for host in hosts:
            for _ in range(per_host):
                _, counter = await loop.create_datagram_endpoint(
                    lambda: _Counter(arrived), local_addr=(host, 0)
                )
                sockets.append(counter)
        return cls(sockets, arrived)

    def __len__(self) -> int:
        return len(self.sockets)

    def send(self, index: int, datagram: bytes, address: tuple[str, int]) -> None:
        self.sockets[index % len(self.sockets)].transport.sendto(datagram, address)
        self.sent += 1

    @property
    def answered(self) -> int:
        return sum(len(s.answers) for s in self.sockets)

    async def wait_answers(self, count: int, timeout: float) -> int:
        """Wait until ``count`` answers arrived or ``timeout`` passed; how many arrived."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.answered < count and loop.time() < deadline:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                break
        return self.answered

    def close(self) -> None:
        for s in self.sockets:
            s.transport.close()
