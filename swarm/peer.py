"""A peer: identity + HTTP transport + DHT node on one port number, and its heartbeat.

The HTTP server (TCP) binds first; the DHT (UDP) then binds the same port number, so a user behind
a router forwards one port and others join with one ``HOST:PORT``. The peer announces its signed
:class:`~swarm.net.record.PeerRecord` under ``{run_id}/peers`` every ``heartbeat_s``; the entry
expires after ``record_ttl_s``, so a peer that dies vanishes from every listing at expiry.

Each announcement carries the peer's progress (:mod:`swarm.net.progress`); a peer that closes
publishes a leave marker in the same slot, so the others drop it at their next read instead of at
expiry. Every heartbeat also reads the run's records, which logs who joined and who left.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
from typing import Any

from swarm.address import PeerAddress
from swarm.dht import DHTNode
from swarm.errors import ConfigError, DHTError, SwarmError
from swarm.identity import Identity, PeerID
from swarm.monitor.metrics import PeerMetrics
from swarm.monitor.tracker import ProgressTracker, RoundFigures
from swarm.monitor.watch import PeerWatcher
from swarm.net.nat import NatTraversal
from swarm.net.progress import LEFT_FIELD, PROGRESS_FIELD, Progress
from swarm.net.reachability import Reach
from swarm.net.record import PeerRecord
from swarm.net.relay import RelayBudget
from swarm.net.transport import Transport
from swarm.peer_config import PeerConfig, Reachability

logger = logging.getLogger(__name__)

_BIND_ATTEMPTS = 16
# Reads of the run's records that only keep a view current (the prober's, the heartbeat's) come
# at most once per this many seconds per record read last time: a read costs every holder and
# reader bytes in proportion to the swarm, so spacing them so keeps each peer's read traffic
# flat as the swarm grows (1024 peers: one every 51 s instead of every 5 s, 1.9 instead of 19
# MB per peer per minute). Planners still read once per round.
READ_S_PER_RECORD = 0.05
# a leave marker waits for its answers this many of the DHT's stall times (a few RTTs), at least
# LEAVE_MIN_S: its datagrams are sent at once and stored where they land, and the last peer of
# a swarm waited a whole request timeout (1 s) for neighbours that had left before it
LEAVE_STALLS, LEAVE_MIN_S = 4, 0.1


def peers_key(run_id: str) -> str:
    """The DHT key under which every peer of a run announces its record."""
    return f"{run_id}/peers"


def guess_announce_host(listen: PeerAddress) -> str:
    """The address others should dial when we listen on every interface.

    Best effort without sending anything: the address this host's name resolves to. Users behind
    a router pass ``--announce`` with their public address instead.
    """
    if not listen.is_wildcard:
        return listen.host
    try:
        host = socket.gethostbyname(socket.gethostname())
    except OSError:
        host = "127.0.0.1"
    if host.startswith("127."):
        logger.warning(
            "listening on all interfaces but this host's name resolves to %s: others on the "
            "network cannot dial that; pass --announce HOST:PORT",
            host,
        )
    return host


class Peer:
    """A running peer. Create with ``await Peer.start(config)`` or ``async with Peer(config)``."""

    def __init__(self, config: PeerConfig, identity: Identity | None = None):
        self.config = config
        if identity is None:
            identity = (
                Identity.load_or_create(config.identity_path)
                if config.identity_path is not None
                else Identity.generate()
            )
        self.identity = identity
        self.transport: Transport | None = None
        self.dht: DHTNode | None = None
        self.nat: NatTraversal | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._closed = asyncio.Event()
        self.progress = ProgressTracker()
        self.metrics = PeerMetrics(refusals=self._refusal_counts)
        self.watcher = PeerWatcher(self.identity.peer_id)
        # peers whose leave marker we read -> when we last read it (kept one record TTL: a read
        # may miss the marker while an older record of the peer still circulates)
        self.departed: dict[PeerID, float] = {}
        self.monitoring = True  # publish progress and watch the run at each heartbeat
        self._no_room = False  # the last announce had no room for the progress (warned once)
        self._expiration = 0.0  # of our last announcement
        # the last read of the run's records (when it finished, what it returned) and the read
        # in flight: the prober, the planner and the heartbeat share them (see known_peers)
        self._last_read: tuple[float, dict[PeerID, PeerRecord]] | None = None
        self._reading: asyncio.Task[dict[PeerID, PeerRecord]] | None = None

    @property
    def peer_id(self) -> PeerID:
        return self.identity.peer_id

    @property
    def run_id(self) -> str:
        return self.config.run_id

    @property
    def address(self) -> PeerAddress:
        """What others dial: HTTP over TCP and the DHT over UDP share this port number."""
        return self._transport.record().address

    @property
    def _transport(self) -> Transport:
        if self.transport is None:
            raise SwarmError("the peer is not started")
        return self.transport

    @property
    def _dht(self) -> DHTNode:
        if self.dht is None:
            raise SwarmError("the peer is not started")
        return self.dht

    @classmethod
    async def start(cls, config: PeerConfig, identity: Identity | None = None) -> Peer:
        peer = cls(config, identity)
        await peer._start()
        return peer

    async def __aenter__(self) -> Peer:
        if self.transport is None:
            await self._start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _start(self) -> None:
        try:
            await self._bind()
            if self.config.initial_peers:
                await self._bootstrap()
            await self.announce()
            if self.config.reachability is Reachability.AUTO:
                await self._start_nat()
        except BaseException:
            await self.close()
            raise
        self._heartbeat = asyncio.create_task(self._heartbeat_loop(), name="swarm-heartbeat")
        logger.info(
            "peer %s up at %s (run %s, %d initial peers)",
            self.peer_id.short,
            self.address,
            self.run_id,
            len(self.config.initial_peers),
        )

    async def _bind(self) -> None:
        listen = self.config.listen
        for attempt in range(_BIND_ATTEMPTS):
            transport = Transport(
                self.identity,
                self.config.membership,
                run_id=self.run_id,
                listen=listen,
                announce=self.config.announce,
                device=self.config.device,
                bandwidth=self.config.bandwidth,
            )
            await transport.start()
            port = transport.bound_address.port
            try:
                dht = await DHTNode.create(
                    self.identity,
                    self.config.membership,
                    host=listen.host or "0.0.0.0",
                    port=port,
                    request_timeout=self.config.dht_request_timeout_s,
                )
            except DHTError:
                await transport.close()
                if listen.port != 0 or attempt == _BIND_ATTEMPTS - 1:
                    raise
                logger.debug("UDP port %d is taken; trying another port number", port)
                continue
            self.transport, self.dht = transport, dht
            if self.config.metrics:
                transport.metrics = self._render_metrics
            if self.config.announce is None and listen.is_wildcard:
                host = guess_announce_host(listen)
                transport.update_record(address=PeerAddress(host, port))
            return

    async def _start_nat(self) -> None:
        dht = self._dht

        async def udp_probe(address: PeerAddress, expected: PeerID) -> bool:
            contact = await dht.ping_address(address.host, address.port)
            return (
                contact is not None and PeerID.from_public_key(contact.keys.public_key) == expected
            )

        self.nat = NatTraversal(
            self._transport,
            list_peers=self.known_peers,
            announce=self.announce,
            udp_probe=udp_probe,
            set_dht_client=dht.set_client,
            port_mapping=self.config.port_mapping,
            budget=RelayBudget(peers=self.config.relay_slots, rate=self.config.relay_rate),
            relays=self.config.relay_peers,
        )
        await self.nat.start()

    @property
    def reach(self) -> Reach:
        """How others reach this peer (``unknown`` until a dial-back check has answered)."""
        return self.nat.reach if self.nat is not None else Reach.UNKNOWN

    async def _bootstrap(self) -> None:
        contacts = await self._dht.bootstrap(self.config.initial_peers)
        if contacts == 0:
            raise DHTError(
                "no initial peer answered: "
                + ", ".join(self.config.initial_peers)
                + " (check the address, the port forwarding and the swarm key)"
            )

    async def announce(self) -> int:
        """Publish (and re-sign) this peer's record; returns how many DHT nodes stored it."""
        transport = self._transport
        if self.monitoring:
            reach = "public" if transport.record().bandwidth > 0 else "client"
            record = self._with_progress(self.progress.snapshot(reachability=reach))
        else:
            record = transport.update_record()
        return await self._store_record(record)

    def _with_progress(self, progress: Progress) -> PeerRecord:
        """Our record with ``progress`` in it: with half as many lowered peers each time the
        record's extra has no room for them (a scorer that lowered 8 peers, beside its
        coordinate and lists), and without a progress at worst, never without a record."""
        transport = self._transport
        extra = {k: v for k, v in transport.record().extra.items() if k != PROGRESS_FIELD}
        lowered = progress.lowered
        while True:
            shown = dataclasses.replace(progress, lowered=lowered).to_wire()
            try:
                record = transport.update_record(extra={**extra, PROGRESS_FIELD: shown})
                self._no_room = False
                return record
            except ConfigError:
                if not lowered:
                    break
                lowered = lowered[: len(lowered) // 2]
        if not self._no_room:
            logger.warning("no room for this peer's progress in its record: announced without it")
        self._no_room = True
        return transport.update_record(extra=extra)

    async def _store_record(self, record: PeerRecord) -> int:
        # later than the stored entry, so that it replaces ours in every node it reaches
        expiration = max(time.time() + self.config.record_ttl, self._expiration)
        self._expiration = expiration + 1e-3
        try:
            stored = await self._dht.store(peers_key(self.run_id), record.serialize(), expiration)
        except SwarmError:
            self.metrics.count_dht("store", failed=True)
            raise
        self.metrics.count_dht("store", failed=stored == 0)
        return stored

    def record_round(self, figures: RoundFigures) -> None:
        """Count a finished averaging round (the training facade calls this)."""
        self.progress.on_round(figures)
        self.metrics.on_round(figures)

    def _render_metrics(self) -> bytes:
        counts, engine = self.metrics.counts, self.progress.engine
        if engine is not None:
            counts.step, counts.round = engine.step_count, engine.round
            counts.utilization = float(engine.utilization.value)
        return self.metrics.render()

    def _refusal_counts(self) -> dict[tuple[str, str], int]:
        counts: dict[tuple[str, str], int] = {}
        if self.transport is not None:
            counts.update({("http", status): n for status, n in self.transport.refused.items()})
        refusals = getattr(getattr(self.dht, "protocol", None), "_refusals", None)
        if refusals is not None:
            counts[("dht", "datagram")] = refusals.total
        return counts

    async def _heartbeat_loop(self) -> None:
        # fixed rate: a slow store (a dead node in the lookup) must not push the next one past
        # the record's expiry
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            due += self.config.heartbeat_s
            await asyncio.sleep(max(0.0, due - loop.time()))
            due = max(due, loop.time() - self.config.heartbeat_s)
            try:
                stored = await self.announce()
            except SwarmError as e:
                logger.warning("heartbeat failed: %s", e)
                continue
            if stored == 0:
                logger.warning("heartbeat: no DHT node stored our record (alone in the swarm?)")
            if self.monitoring:
                try:
                    # logs who joined and who left (a read of the last half heartbeat will do)
                    await self.known_peers(max_age_s=self.config.heartbeat_s / 2, spaced=True)
                except SwarmError as e:
                    logger.debug("reading the run's records failed: %s", e)

    async def known_peers(
        self, max_age_s: float = 0.0, *, spaced: bool = False
    ) -> dict[PeerID, PeerRecord]:
        """Records of the live peers of this run (signature-checked), this peer included.

        Args:
            max_age_s: a read that finished less than this long ago is answered again instead
                of a new one (callers that look every few seconds share the reads of those
                that need them fresh). A read in flight is always shared.
            spaced: ``max_age_s`` is at least ``READ_S_PER_RECORD`` per record the last read
                returned (for reads that only keep a view current).
        """
        loop = asyncio.get_running_loop()
        if self._last_read is not None:
            age = loop.time() - self._last_read[0]
            if spaced:
                max_age_s = max(max_age_s, READ_S_PER_RECORD * len(self._last_read[1]))
            if age < max_age_s:
                return dict(self._last_read[1])
        if self._reading is None or self._reading.done():
            # a task of its own: a caller that gives up waiting does not cancel the others' read
            self._reading = loop.create_task(self._read_records(), name="swarm-read-records")
            self._reading.add_done_callback(_retrieve)
        return dict(await asyncio.shield(self._reading))

    async def _read_records(self) -> dict[PeerID, PeerRecord]:
        try:
            live, left = await fetch_run_records(self._dht, self.run_id)
        except SwarmError:
            self.metrics.count_dht("get", failed=True)
            raise
        self.metrics.count_dht("get", failed=False)
        now = time.monotonic()
        marked = {pid: t for pid, t in self.departed.items() if t > now - self.config.record_ttl}
        self.departed = {**marked, **dict.fromkeys(left, now)}
        for pid in live:
            self.departed.pop(pid, None)
        self.watcher.update(live, left)
        self.metrics.counts.peers_known = len(set(live) | {self.peer_id})
        self._last_read = (asyncio.get_running_loop().time(), live)
        return live

    async def _leave(self) -> None:
        """Publish a leave marker in our record's slot (best effort, bounded in time)."""
        transport = self._transport
        record = transport.update_record(extra={**transport.record().extra, LEFT_FIELD: True})
        wait = max(LEAVE_MIN_S, LEAVE_STALLS * self._dht.stall_after)
        try:
            await asyncio.wait_for(
                self._store_record(record), min(wait, self.config.dht_request_timeout_s)
            )
        except (SwarmError, OSError, asyncio.TimeoutError) as e:
            logger.debug("could not publish the leave marker: %s", e)

    async def close(self) -> None:
        """Stop announcing, then close the DHT socket and the HTTP server and client."""
        for task in (self._heartbeat, self._reading):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._heartbeat = self._reading = None
        if self.dht is not None and self.transport is not None and self._expiration:
            await self._leave()
        if self.nat is not None:
            await self.nat.close()
            self.nat = None
        if self.dht is not None:
            await self.dht.close()
            self.dht = None
        if self.transport is not None:
            await self.transport.close()
            self.transport = None
        self._closed.set()


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a shared read's failure seen: its callers may all have stopped waiting."""
    if not task.cancelled():
        task.exception()


async def fetch_peer_records(dht: DHTNode, run_id: str) -> dict[PeerID, PeerRecord]:
    """Read ``{run_id}/peers`` and keep the records that parse, verify and match their owner."""
    return (await fetch_run_records(dht, run_id))[0]


async def fetch_run_records(
    dht: DHTNode, run_id: str
) -> tuple[dict[PeerID, PeerRecord], dict[PeerID, PeerRecord]]:
    """Like :func:`fetch_peer_records`, split into (live peers, peers whose leave marker is up)."""
    entries = await dht.get(peers_key(run_id))
    records: dict[PeerID, PeerRecord] = {}
    left: dict[PeerID, PeerRecord] = {}
    for (owner, _subkey), entry in entries.items():
        value: Any = entry.value
        try:
            record = PeerRecord.parse(bytes(value)).aged(entry.age_s)
        except (SwarmError, TypeError, ValueError) as e:
            logger.debug("ignoring an invalid peer record from %s: %s", owner.short, e)
            continue
        if record.peer_id != owner or record.run_id != run_id:
            logger.debug("ignoring a peer record whose owner or run does not match")
            continue
        (left if record.left else records)[owner] = record
    return records, left
