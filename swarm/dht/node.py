"""A DHT node: one UDP socket, the protocol, the routing table and the record storage.

Usage::

    node = await DHTNode.create(identity, membership, host="127.0.0.5", port=7000)
    await node.bootstrap(["127.0.0.2:7000"])
    await node.store("run/peers", record_bytes, time.time() + 30)
    entries = await node.get("run/peers")  # {(owner PeerID, subkey): DHTEntry}
    await node.close()

Reads merge what the k closest nodes hold (newest expiration per owner and subkey) and keep only
entries whose owner signature verifies, so one lying or stale node cannot hide or forge another
peer's entry.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Iterable, Sequence
from typing import Any

from swarm.address import PeerAddress
from swarm.auth import Membership
from swarm.dht.envelope import DatagramAuth
from swarm.dht.lookup import announce, lookup, more_pages, refresh_bands
from swarm.dht.protocol import SwarmProtocol
from swarm.dht.provenance import Origin
from swarm.dht.reads import add_reports, merge_reads
from swarm.dht.records import (
    DHTEntry,
    RecordStorage,
    check_expiration,
    key_digest,
)
from swarm.dht.routing import Contact
from swarm.dht.targets import StoreTargets
from swarm.errors import ConfigError, DHTError
from swarm.identity import Identity, PeerID

logger = logging.getLogger(__name__)

RECEIVE_BUFFER_BYTES = 4 * 1024 * 1024  # bursts of answers must not overflow the socket
DEFAULT_KSIZE = 20
DEFAULT_ALPHA = 3
DEFAULT_GET_QUORUM = 5
BOOTSTRAP_ATTEMPTS = 4
BOOTSTRAP_BACKOFF_S = 0.5  # doubles with each retry
REJOIN_CHECK_S = 5.0  # how often an empty routing table is noticed in the background
REJOIN_BACKOFF_S = (1.0, 60.0)  # wait after a rejoin that nobody answered: doubles up to the cap
# answer pages a reader follows per holder: with the first, 13 pages of 60 kB hold a key's 1024
# slots of trainers' peer records (about 650 bytes each), and bound what a lying holder costs
MAX_PAGES_PER_GET = 12


class DHTNode:
    """A Kademlia node with signed, merged dictionary records. Create with :meth:`create`.

    Args:
        identity: this peer's keys (entries it stores are signed with them).
        membership: who may talk to this node (open, swarm key, allow-list).
        ksize: k from the paper: contacts per bucket and nodes that store each key.
        alpha: requests in flight per lookup.
        get_quorum: a get ends once this many nodes answered with entries (asked closest to the
            key first) or when the k closest have all answered; a store writes to all k closest,
            so any few hold every entry, and merging several covers one that missed a store.
        request_timeout: seconds before a silent node counts as failed; raise it on slow links.
        refresh_interval: seconds between routing-table refreshes (a lookup of our own id and of
            a random id), which also drop expired entries.
        client: only read and write through others, never be added to their routing tables
            (for short-lived tools such as ``swarm-peer peers``).
    """

    def __init__(
        self,
        identity: Identity,
        membership: Membership,
        *,
        ksize: int = DEFAULT_KSIZE,
        alpha: int = DEFAULT_ALPHA,
        get_quorum: int = DEFAULT_GET_QUORUM,
        request_timeout: float = 3.0,
        refresh_interval: float = 600.0,
        client: bool = False,
    ):
        if ksize < 1 or alpha < 1 or get_quorum < 1:
            raise ConfigError("ksize, alpha and get_quorum must be at least 1")
        if not request_timeout > 0:
            raise ConfigError("request_timeout must be positive")
        self.identity = identity
        self.membership = membership
        self.ksize = ksize
        self.alpha = alpha
        self.get_quorum = min(get_quorum, ksize)
        self.request_timeout = request_timeout
        self.refresh_interval = refresh_interval
        self.client = client
        self.storage = RecordStorage()
        self.targets = StoreTargets()  # where keys were stored lately (skips their lookups)
        self.protocol: SwarmProtocol | None = None
        self._refresh: asyncio.Task[None] | None = None
        self._seeds: list[PeerAddress] = []  # the initial peers, to rejoin through
        self._rejoin_lock = asyncio.Lock()
        self._rejoin_after = 0.0  # monotonic time before which no rejoin is tried again
        self._rejoin_wait = REJOIN_BACKOFF_S[0]

    @classmethod
    async def create(
        cls,
        identity: Identity,
        membership: Membership,
        *,
        host: str = "0.0.0.0",
        port: int = 0,
        **kwargs: Any,
    ) -> DHTNode:
        """Bind ``host:port`` over UDP and start answering.

        Raises:
            DHTError: the address cannot be bound (in use, not ours).
        """
        node = cls(identity, membership, **kwargs)  # type: ignore[arg-type]
        await node._listen(host, port)
        return node

    async def _listen(self, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
        except OSError as e:  # some systems cap it; the default still works
            logger.debug("could not enlarge the UDP receive buffer: %s", e)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            raise DHTError(f"cannot bind UDP {host}:{port}: {e.strerror or e}") from e
        bound = sock.getsockname()
        auth = DatagramAuth(self.identity, self.membership)
        source = Contact(auth.keys, bound[0], bound[1])
        protocol = SwarmProtocol(
            source, self.storage, self.ksize, auth, self.request_timeout, client=self.client
        )
        loop = asyncio.get_running_loop()
        await loop.create_datagram_endpoint(lambda: protocol, sock=sock)
        self.protocol = protocol
        self._refresh = asyncio.create_task(self._refresh_loop(), name="swarm-dht-refresh")
        logger.debug("DHT node %s listening on UDP %s:%d", source.id.hex()[:8], *bound[:2])

    @property
    def port(self) -> int:
        return self._protocol.source_node.port

    @property
    def node_id(self) -> bytes:
        return self._protocol.source_node.id

    @property
    def stall_after(self) -> float:
        """Seconds after which an unanswered request is likely lost (a few recent RTTs)."""
        return self._protocol.stall_after

    @property
    def _protocol(self) -> SwarmProtocol:
        if self.protocol is None or self.protocol.closed:
            raise DHTError("the DHT node is not running")
        return self.protocol

    def set_client(self, client: bool) -> None:
        """Ask only, or join others' routing tables again (a peer nobody can dial asks only)."""
        self.client = client
        self._protocol.client = client

    async def ping_address(self, host: str, port: int) -> Contact | None:
        """Ping ``host:port`` (no known keys needed); the node that answered, or None."""
        return await self._protocol.ping_address((host, port))

    def counters(self) -> dict[str, int]:
        """What this node refused or dropped so far, by cause (see :mod:`swarm.dht.budgets`)."""
        return self._protocol.counters()

    def contacts(self) -> list[Contact]:
        """The routing table's contacts."""
        return self._protocol.router.contacts()

    async def bootstrap(
        self, addresses: Iterable[str], *, attempts: int = BOOTSTRAP_ATTEMPTS
    ) -> int:
        """Join through any live nodes given as ``HOST:PORT`` (hostnames are resolved).

        The addresses are remembered: should the routing table ever empty (nobody answered
        here, a network outage evicted every contact), the node joins through them again, and
        through the contacts it evicted last, before its next lookup and in the background.

        Returns:
            How many contacts the routing table holds afterwards (0: nobody answered).

        Raises:
            ConfigError: an address is not ``HOST:PORT``, or ``attempts`` is below 1.
        """
        if attempts < 1:
            raise ConfigError(f"bootstrap attempts must be at least 1, not {attempts}")
        parsed = [PeerAddress.parse(text) for text in addresses]
        self._seeds = list(dict.fromkeys([*self._seeds, *parsed]))
        answered = 0
        for attempt in range(attempts):
            if attempt:  # a lost datagram or a flooded peer: try again, backing off
                await asyncio.sleep(BOOTSTRAP_BACKOFF_S * 2 ** (attempt - 1))
                logger.info("no initial peer answered yet; retry %d", attempt)
            answered = await self._ping_known(parsed)
            if answered or not parsed:
                break
        if answered == 0:
            logger.warning("no initial peer answered: %s", ", ".join(map(str, parsed)))
            return 0
        count = await self._fill_table()
        logger.info("DHT joined through %d initial peer(s); %d contacts", answered, count)
        return count

    async def _ping_known(
        self, seeds: Sequence[PeerAddress], former: Sequence[tuple[str, int]] = ()
    ) -> int:
        """First-contact pings to the seeds (resolved now) and to former contacts' addresses
        (whoever answers there now: a restarted node has new keys); how many answered."""
        resolved = await asyncio.gather(*(self._resolve(a) for a in seeds))
        targets = {addr for group in resolved for addr in group} | set(former)
        answers = await asyncio.gather(*(self._protocol.ping_address(a) for a in sorted(targets)))
        return sum(a is not None for a in answers)

    async def _fill_table(self) -> int:
        await lookup(self._protocol, self.node_id, ksize=self.ksize, alpha=self.alpha)
        if not self.client:
            await self.refresh_buckets()
            await announce(self._protocol)
        return len(self.contacts())

    async def rejoin(self) -> int:
        """Join again through the initial peers and the contacts evicted last, unless the
        routing table has contacts or a rejoin that nobody answered was tried moments ago
        (the wait doubles up to a minute). Returns the routing table's size afterwards."""
        async with self._rejoin_lock:
            protocol = self._protocol
            loop = asyncio.get_running_loop()
            if not protocol.router.empty() or loop.time() < self._rejoin_after:
                return len(protocol.router.contacts())
            former = [c.address for c in protocol.evicted.values()][-self.ksize :]
            if not self._seeds and not former:
                return 0
            if await self._ping_known(self._seeds, former):
                self._rejoin_wait = REJOIN_BACKOFF_S[0]
                count = await self._fill_table()
                logger.info("DHT routing table was empty; rejoined, %d contacts", count)
                return count
            self._rejoin_after = loop.time() + self._rejoin_wait
            self._rejoin_wait = min(2 * self._rejoin_wait, REJOIN_BACKOFF_S[1])
            logger.warning(
                "the DHT routing table is empty and no initial or former peer answered; "
                "retrying within %.0f s",
                self._rejoin_wait,
            )
            return 0

    async def _resolve(self, address: PeerAddress) -> list[tuple[str, int]]:
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if self._protocol.source_node.ip.count(":") else socket.AF_INET
        try:
            infos = await loop.getaddrinfo(
                address.host, address.port, family=family, type=socket.SOCK_DGRAM
            )
        except OSError as e:
            logger.warning("cannot resolve %s: %s", address, e)
            return []
        return sorted({(info[4][0], info[4][1]) for info in infos})

    async def store(self, key: str, value: bytes, expiration: float, *, subkey: str = "") -> int:
        """Sign and store ``value`` under ``(our id, subkey)`` of ``key`` on the k closest nodes.

        The entry merges with what the key holds: other owners' and other subkeys' entries stay;
        ours is replaced when ``expiration`` is later than the stored one.

        Returns:
            How many nodes took the entry (this node included when it is among the closest).

        Raises:
            DHTError: the value is too large, or the expiration is past or too far away.
        """
        check_expiration(expiration, time.time())
        digest = key_digest(key)
        entry = DHTEntry.create(self.identity, digest, subkey, bytes(value), float(expiration))
        protocol = self._protocol
        if protocol.router.empty():
            await self.rejoin()
        closest = self.targets.get(digest, self.get_quorum, protocol.is_suspect)
        if closest is None:
            found = await lookup(protocol, digest, ksize=self.ksize, alpha=self.alpha)
            closest = found.closest
            self.targets.put(digest, closest)
        goal = int.from_bytes(digest, "big")
        stored = 0
        furthest = closest[-1].long_id ^ goal if closest else None
        own = protocol.source_node.long_id ^ goal
        if not self.client and (furthest is None or len(closest) < self.ksize or own < furthest):
            stored += self.storage.merge(entry, origin=Origin.of(protocol.source_node.ip, True))
        tasks = [
            t for c in closest if (t := protocol.spawn(protocol.send_entries(c, digest, [entry])))
        ]
        for task in tasks:  # a target that did not take it (gone?): look the key up next time
            task.add_done_callback(lambda t: None if _took(t) else self.targets.forget(digest))
        # the k closest answered the lookup moments ago, yet one may have died since: once a
        # quorum took the entry, a few RTTs more is all we wait (the rest finish in background)
        pending = set(tasks)
        deadline: float | None = None
        loop = asyncio.get_running_loop()
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - loop.time())
            done, pending = await asyncio.wait(
                pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                break
            taken = sum(map(_took, tasks))
            if deadline is None and taken >= self.get_quorum:
                deadline = loop.time() + protocol.stall_after
        stored += sum(map(_took, tasks))
        logger.debug("stored %r on %d node(s)", key, stored)
        return stored

    async def get(self, key: str) -> dict[tuple[PeerID, str], DHTEntry]:
        """Read the live entries of ``key``, merged from the ``get_quorum`` closest nodes and our
        own storage.

        Returns:
            ``{(owner, subkey): entry}`` with only verified, unexpired entries, the latest per
            slot; each entry's ``age_s`` is the lower median of the slot's witnessed ages that
            its holders reported (see :mod:`swarm.dht.provenance`).
        """
        digest = key_digest(key)
        if self._protocol.router.empty():
            await self.rejoin()
        found = await lookup(
            self._protocol,
            digest,
            ksize=self.ksize,
            alpha=self.alpha,
            value=True,
            holders=self.get_quorum,
        )
        if not found.entries and not self.storage.entries(digest):
            # nothing at all: the first pass may have skipped a holder that failed to answer
            # once (a lost datagram, a busy host), or stopped short of where a store under the
            # same conditions put the entry; ask again, everyone, twice as wide
            found = await lookup(
                self._protocol,
                digest,
                ksize=2 * self.ksize,
                alpha=self.alpha,
                value=True,
                holders=self.get_quorum,
                skip_suspects=False,
            )
        # holders answer one fair page (one entry per owner) at a time; read on from two of them
        extra = await asyncio.gather(
            *(
                more_pages(self._protocol, digest, holder, cursor, MAX_PAGES_PER_GET)
                for holder, cursor in found.more[:2]
            )
        )
        now = time.time()
        own = self.storage.entries(digest, now)  # our own storage counts as one holder
        candidates = [*own, *found.entries]
        reports = found.ages
        add_reports(
            reports, {e.slot: {self.node_id: self.storage.witnessed_age(e, now)} for e in own}
        )
        for pages in extra:
            candidates += pages.entries
            add_reports(reports, pages.ages)
        return merge_reads(candidates, reports, self._verify, now)

    def _verify(self, entry: DHTEntry) -> bool:
        try:
            entry.verify()  # signatures that verified lately are remembered (identity)
        except DHTError:
            logger.debug("dropping an entry with a bad signature from a DHT answer")
            return False
        return True

    async def _refresh_loop(self) -> None:
        loop = asyncio.get_running_loop()
        refresh_at = loop.time() + self.refresh_interval
        while True:
            await asyncio.sleep(max(0.0, min(REJOIN_CHECK_S, refresh_at - loop.time())))
            try:
                if self._protocol.router.empty():
                    await self.rejoin()
                if loop.time() < refresh_at:
                    continue
                refresh_at = loop.time() + self.refresh_interval
                self.storage.cull()
                await self._fill_table()
            except DHTError as e:
                logger.debug("routing-table refresh failed: %s", e)

    async def refresh_buckets(self) -> None:
        """Look up a random id at each distance from ours (see :func:`refresh_bands`)."""
        await refresh_bands(self._protocol, self.node_id, self.alpha)

    async def close(self) -> None:
        """Stop answering, cancel every task and close the socket."""
        if self._refresh is not None:
            self._refresh.cancel()
            await asyncio.gather(self._refresh, return_exceptions=True)
            self._refresh = None
        if self.protocol is not None:
            await self.protocol.close()
            self.protocol = None

    async def __aenter__(self) -> DHTNode:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def _took(task: asyncio.Task[Any]) -> bool:
    """Whether a finished ``send_entries`` task had its entries taken."""
    if not task.done() or task.cancelled() or task.exception() is not None:
        return False
    return bool(task.result() > 0)
