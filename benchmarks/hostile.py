"""Hostile-client benchmark: real ``swarm-peer`` processes under the attacks of issue 12.

    python benchmarks/hostile.py                     # every attack, 10 s each
    python benchmarks/hostile.py --attacks udp_junk half_open_tcp --duration 5

For each attack, three fresh ``swarm-peer`` processes form a swarm on loopback (the first is the
victim, the others joined through it). A prober process then does what a user does, over and
over: a one-shot ``peers`` listing (a fresh client DHT node bootstrapping through the victim) and
an authenticated ``/ping`` of the victim, while this process attacks the victim for
``duration_s``. Floods are bounded in count and time and target loopback only.

Prints one JSON object per attack: attack, rate (per second, or a count for one-shot attacks),
achieved_rate (what this process managed to send, per second; null for one-shot attacks),
duration_s, legit_success (share of the prober's listings and pings answered during the attack),
legit_p50_ms, rss_growth_mb (the victim's resident memory, peak during the attack less before),
peers_listed (the fewest of the peers up when the attack began that a listing showed) /
peers_expected, amplification (bytes the
victim sent toward the attacker's unproved UDP sources over the bytes they sent it; 0 when it sent
nothing, null for TCP attacks, where the handshake proves the address).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swarm.auth import Membership  # noqa: E402
from swarm.dht import DHTEntry, DHTNode, key_digest  # noqa: E402
from swarm.dht.envelope import REQUEST, DatagramAuth  # noqa: E402
from swarm.dht.records import MAX_TTL_S, MAX_VALUE_BYTES  # noqa: E402
from swarm.identity import Identity  # noqa: E402
from swarm.net.limits import raise_descriptor_limit  # noqa: E402

HOST = "127.0.0.1"
ATTACKER_HOST = "127.0.0.2"
RUN = "bench"
PEERS_KEY = f"{RUN}/peers"
MiB = 1 << 20
ACTIONS: list[tuple[int, float]] = []  # (count, seconds) of each paced attack, to report its rate


# ---- the victims: real swarm-peer processes


class PeerProcess:
    def __init__(self, initial: str | None):
        argv = [
            sys.executable,
            "-c",
            "from swarm.cli import main; raise SystemExit(main())",
            "--listen",
            f"{HOST}:0",
            "--run-id",
            RUN,
            "--log-level",
            "ERROR",
        ]
        if initial:
            argv += ["--initial-peers", initial]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.address = ""
        self.peer_id = ""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 60
        for line in self.proc.stdout:
            if m := re.search(r"peer (\S+) \(", line):
                self.peer_id = m.group(1)
            if m := re.search(r"--initial-peers (\S+)", line):
                self.address = m.group(1)
                break
            if time.monotonic() > deadline:
                break
        if not self.address:
            raise RuntimeError("swarm-peer did not start")
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for _ in self.proc.stdout:
            pass

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def rss_mb(self) -> float:
        try:
            with open(f"/proc/{self.proc.pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MiB
        except (OSError, ValueError, AttributeError):
            return 0.0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---- the prober: what a user does, in its own process


def prober_main(conn: Any, address: str) -> None:
    asyncio.run(_probe(conn, address))


async def _probe(conn: Any, address: str) -> None:
    from swarm.address import PeerAddress
    from swarm.net.transport import Transport
    from swarm.peer import fetch_peer_records

    loop = asyncio.get_running_loop()
    transport = Transport(Identity.generate(), Membership.open(), run_id=RUN, listen=f"{HOST}:0")
    await transport.start()
    stop = asyncio.Event()
    results: list[tuple[str, bool, float, int]] = []  # (kind, answered, ms, peers listed)

    async def listing() -> None:
        started = time.perf_counter()
        dht = await DHTNode.create(Identity.generate(), Membership.open(), host=HOST, client=True)
        try:
            ok = await dht.bootstrap([address]) > 0
            count = len(await fetch_peer_records(dht, RUN)) if ok else 0
        finally:
            await dht.close()
        results.append(("peers", ok, (time.perf_counter() - started) * 1000, count))

    async def ping() -> None:
        started = time.perf_counter()
        try:
            await transport.ping(PeerAddress.parse(address), timeout=5)
            ok = True
        except Exception:  # a benchmark counts failures
            ok = False
        results.append(("ping", ok, (time.perf_counter() - started) * 1000, 0))

    async def run() -> None:
        while not stop.is_set():
            await asyncio.gather(listing(), ping())
            await asyncio.sleep(0.2)

    conn.send("ready")
    await loop.run_in_executor(None, conn.recv)  # "go"
    task = asyncio.create_task(run())
    await loop.run_in_executor(None, conn.recv)  # "stop"
    stop.set()
    await task
    await transport.close()
    conn.send(results)


# ---- attacks: each returns (bytes sent to the victim, bytes it sent back) over unproved UDP


class UdpCounter(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.received = 0
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.received += len(data)

    def error_received(self, exc: Exception) -> None:
        pass


async def udp_socket() -> UdpCounter:
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_datagram_endpoint(UdpCounter, local_addr=(ATTACKER_HOST, 0))
    return proto


async def paced(rate: float, duration: float, send: Any) -> int:
    """Call ``send()`` ``rate`` times a second for ``duration`` seconds; returns the count."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    sent = 0
    while (elapsed := loop.time() - start) < duration:
        due = int(elapsed * rate) + 1
        while sent < due and loop.time() - start < duration:
            send()
            sent += 1
        await asyncio.sleep(0.002)
    ACTIONS.append((sent, loop.time() - start))
    return sent


async def hostile_node(victim: PeerProcess) -> DHTNode:
    node = await DHTNode.create(Identity.generate(), Membership.open(), host=ATTACKER_HOST)
    await node.bootstrap([victim.address])
    return node


def junk_entries(identity: Identity, key: str, count: int, size: int, start: int = 0) -> list:
    expiration = time.time() + MAX_TTL_S - 60
    value = os.urandom(size)
    return [
        DHTEntry.create(identity, key_digest(key), f"j{i}", value, expiration)
        for i in range(start, start + count)
    ]


async def store_everywhere(node: DHTNode, key: str, entries: list) -> None:
    digest = key_digest(key)
    await asyncio.gather(*(node.protocol.send_entries(c, digest, entries) for c in node.contacts()))


async def attack_bloat_large_entries(victims, rate, duration):
    node = await hostile_node(victims[0])
    try:
        await store_everywhere(
            node, PEERS_KEY, junk_entries(Identity.generate(), PEERS_KEY, 32, MAX_VALUE_BYTES)
        )
        await asyncio.sleep(duration)
    finally:
        await node.close()
    return 0, 0


async def attack_subkey_flood(victims, rate, duration):
    node = await hostile_node(victims[0])
    try:
        await store_everywhere(
            node, PEERS_KEY, junk_entries(Identity.generate(), PEERS_KEY, 1024, 0)
        )
        await asyncio.sleep(duration)
    finally:
        await node.close()
    return 0, 0


async def attack_storage_fill_then_join(victims, rate, duration):
    """Entries of 4 KiB on many keys, from a new identity every 100 entries (sybils); then a
    newcomer joins the filled node and must not be flooded with the bloat."""
    node = await hostile_node(victims[0])
    victim = next(c for c in node.contacts() if c.port == victims[0].port)
    identity, made = Identity.generate(), 0
    value = os.urandom(MAX_VALUE_BYTES)
    pending: set[asyncio.Task] = set()

    def send() -> None:
        nonlocal identity, made
        if made % 100 == 0:
            identity = Identity.generate()
        key = key_digest(f"fill/{made}")
        entry = DHTEntry.create(identity, key, "", value, time.time() + MAX_TTL_S - 60)
        task = asyncio.ensure_future(node.protocol.send_entries(victim, key, [entry]))
        pending.add(task)
        task.add_done_callback(pending.discard)
        made += 1

    try:
        await paced(rate, duration * 0.7, send)
        newcomer = PeerProcess(victims[0].address)  # joins the filled node
        victims.append(newcomer)
        await asyncio.sleep(duration * 0.3)
    finally:
        for task in pending:
            task.cancel()
        await node.close()
    return 0, 0


async def attack_presigned_store_flood(victims, rate, duration):
    node = await hostile_node(victims[0])
    victim = next(c for c in node.contacts() if c.port == victims[0].port)
    identity = Identity.generate()
    digest = key_digest("flood")
    expiration = time.time() + 3600
    batches = [
        [
            DHTEntry.create(identity, digest, f"{b}.{i}", b"", expiration).to_wire()
            for i in range(64)
        ]
        for b in range(64)
    ]
    counter = [0]

    def send() -> None:
        batch = batches[counter[0] % len(batches)]
        counter[0] += 1
        node.protocol.spawn(node.protocol.call(victim, "store", digest, batch))

    try:
        await paced(rate, duration, send)
    finally:
        await node.close()
    return 0, 0


def seal_request(
    auth: DatagramAuth, target: Any, body: list, timestamp: float | None = None
) -> bytes:
    return auth.seal(REQUEST, os.urandom(16), body, target, timestamp=timestamp)


async def victim_keys(victims) -> Any:
    node = await hostile_node(victims[0])
    try:
        return next(c for c in node.contacts() if c.port == victims[0].port).keys
    finally:
        await node.close()


async def attack_spoofed_find_value(victims, rate, duration):
    """find_value from sources that never echo the cookie (as a spoofed source would)."""
    target = await victim_keys(victims)
    sock = await udp_socket()
    auth = DatagramAuth(Identity.generate(), Membership.open())
    sent_bytes = [0]
    bodies = [
        ["find_value", [key_digest(PEERS_KEY)]],
        ["find_value", [key_digest(PEERS_KEY)], False, b"", bytes(96)],
        ["find_node", [key_digest("x")], False, b"", bytes(96)],
    ]

    def send() -> None:
        datagram = seal_request(auth, target, bodies[sent_bytes[0] % 3])
        sock.transport.sendto(datagram, (HOST, victims[0].port))
        sent_bytes[0] += len(datagram)

    await paced(rate, duration, send)
    await asyncio.sleep(0.5)
    sock.transport.close()
    return sent_bytes[0], sock.received


async def attack_replayed_first_contact_ping(victims, rate, duration):
    auth = DatagramAuth(Identity.generate(), Membership.open())
    captured = auth.seal(REQUEST, os.urandom(16), ["ping", [], False, b"", bytes(96)], None)
    sock = await udp_socket()
    count = [0]

    def send() -> None:
        for victim in victims:
            sock.transport.sendto(captured, (HOST, victim.port))
            count[0] += 1

    await paced(rate, duration, send)
    await asyncio.sleep(0.5)
    sock.transport.close()
    return count[0] * len(captured), sock.received


async def attack_future_nonce_flood(victims, rate, duration):
    target = await victim_keys(victims)
    socks = [await udp_socket() for _ in range(8)]
    auths = [DatagramAuth(Identity.generate(), Membership.open()) for _ in range(32)]
    count = [0]
    sent = [0]

    def send() -> None:
        i = count[0]
        count[0] += 1
        datagram = seal_request(
            auths[i % len(auths)], target, ["ping", [], False, b"", bytes(96)], time.time() + 29
        )
        socks[i % len(socks)].transport.sendto(datagram, (HOST, victims[0].port))
        sent[0] += len(datagram)

    await paced(rate, duration, send)
    await asyncio.sleep(0.5)
    for s in socks:
        s.transport.close()
    return sent[0], sum(s.received for s in socks)


async def attack_udp_junk(victims, rate, duration):
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((ATTACKER_HOST, 0))
    sock.setblocking(False)
    junk = [os.urandom(64) for _ in range(64)]
    count = [0]
    sent = [0]

    def send() -> None:
        with contextlib.suppress(BlockingIOError):
            sock.sendto(junk[count[0] % 64], (HOST, victims[0].port))
            sent[0] += 64
        count[0] += 1

    try:
        await paced(rate, duration, send)
        sock.setblocking(True)
        sock.settimeout(0.2)
        received = 0
        with contextlib.suppress(OSError):
            while True:
                received += len(sock.recv(65536))
    finally:
        sock.close()
    return sent[0], received


async def attack_half_open_tcp(victims, rate, duration):
    raise_descriptor_limit(4096)
    socks: list[socket.socket] = []

    def connect() -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.bind((ATTACKER_HOST, 0))
        with contextlib.suppress(BlockingIOError, OSError):
            s.connect((HOST, victims[0].port))
        socks.append(s)

    try:
        await paced(rate, min(duration, 1100 / rate), connect)
        await asyncio.sleep(max(0.0, duration - 1100 / rate))
    finally:
        for s in socks:
            s.close()
    return None


ATTACKS = {
    # name: (function, rate, note)
    "bloat_large_entries": (attack_bloat_large_entries, 32),
    "subkey_flood": (attack_subkey_flood, 1024),
    "storage_fill_then_join": (attack_storage_fill_then_join, 500),
    "presigned_store_flood": (attack_presigned_store_flood, 300),
    "spoofed_find_value": (attack_spoofed_find_value, 300),
    "half_open_tcp": (attack_half_open_tcp, 500),
    "replayed_first_contact_ping": (attack_replayed_first_contact_ping, 50),
    "future_nonce_flood": (attack_future_nonce_flood, 2000),
    "udp_junk": (attack_udp_junk, 40_000),
}
from hostile_dht import DHT_ATTACKS  # noqa: E402  (sybil_eclipse, port_spread_store_flood)

ATTACKS.update(DHT_ATTACKS)
from hostile_net import NET_ATTACKS, REPORTED  # noqa: E402  (subnet_connection_fill, held_frames_memory)

ATTACKS.update(NET_ATTACKS)
from hostile_joins import JOIN_ATTACKS  # noqa: E402  (sybil_state_providers, burst_join)

ATTACKS.update(JOIN_ATTACKS)


def run_attack(name: str, duration: float) -> dict[str, Any]:
    function, rate = ATTACKS[name]
    victims = [PeerProcess(None)]
    victims += [PeerProcess(victims[0].address) for _ in range(2)]
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    prober = ctx.Process(target=prober_main, args=(child, victims[0].address), daemon=True)
    prober.start()
    try:
        conn.recv()
        time.sleep(1.0)  # the peers' first announcements land
        rss_before = victims[0].rss_mb()
        peak = [rss_before]
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], victims[0].rss_mb())
                time.sleep(0.1)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        conn.send("go")
        ACTIONS.clear()
        started = time.perf_counter()
        udp = asyncio.run(function(victims, rate, duration))
        elapsed = time.perf_counter() - started
        conn.send("stop")
        results = conn.recv()
        results += REPORTED.pop("legit_results", [])  # legit calls an attack made itself
        stop.set()
        watcher.join()
        expected = 3  # the peers up when the attack began (a newcomer may join during it)
    finally:
        prober.join(timeout=30)
        for v in victims:
            v.stop()
    answered = [r for r in results if r[1]]
    listings = [min(r[3], expected) for r in results if r[0] == "peers" and r[1]]
    if udp is None:
        amplification = None
    else:
        sent, back = udp
        amplification = round(back / sent, 3) if sent else 0.0
    achieved = None
    if ACTIONS:
        count, seconds = ACTIONS[0]
        achieved = round(count / seconds) if seconds > 0 else None
    return {
        "attack": name,
        "rate": rate,
        "achieved_rate": achieved,
        "duration_s": round(elapsed, 1),
        "legit_success": round(len(answered) / len(results), 3) if results else 0.0,
        "legit_p50_ms": round(statistics.median(r[2] for r in answered), 1) if answered else None,
        "rss_growth_mb": round(peak[0] - rss_before, 1),
        "peers_listed": min(listings) if listings else 0,
        "peers_expected": expected,
        "amplification": amplification,
        "legit_calls": len(results),
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "rss_after_release_mb": REPORTED.pop("rss_after_release_mb", None),
        "joiners_started": REPORTED.pop("joiners_started", None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=list(ATTACKS))
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per attack")
    args = parser.parse_args()
    for name in args.attacks:
        print(json.dumps(run_attack(name, args.duration)), flush=True)


if __name__ == "__main__":
    main()
