"""How a peer becomes reachable: port mapping, dial-back checks, relays, in that order.

:class:`NatTraversal` runs beside a peer's transport:

1. A peer bound to a home address (RFC 1918) asks its router for a port mapping
   (:mod:`swarm.net.portmap`) unless that is turned off.
2. It asks a few other peers to dial it back (:mod:`swarm.net.reachability`) at the mapped or
   announced port: reachable means ``direct`` (or ``mapped``).
3. Unreachable, it keeps a control stream open to up to two relays (:mod:`swarm.net.relay`) and
   announces the first one's relayed address (``relayed``), or, with no relay to be had, goes on
   as a ``client`` that only dials out (bandwidth 0: it never owns a part of an all-reduce). A
   lost relay is replaced by the standby at once and a new standby is sought.

A reachable peer relays for others within its :class:`~swarm.net.relay.RelayBudget`. A relayed
peer announces a tenth of its bandwidth, so that the all-reduce plan gives direct peers most of
the vector to own and the relay's link is not the round's bottleneck.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from swarm.address import PeerAddress
from swarm.errors import PortMapError, SwarmError
from swarm.identity import PeerID
from swarm.net.portmap import PortMapper, PortMapping, is_home_address
from swarm.net.reachability import (
    REACH_KEY,
    DialbackResult,
    DialbackService,
    Reach,
    UdpProbe,
    reach_of,
    request_dialback,
)
from swarm.net.record import PeerRecord
from swarm.net.relay import RELAY_KEY, RelayBudget, RelayLink, RelayService
from swarm.net.transport import Transport

logger = logging.getLogger(__name__)

HELPERS = 3  # peers asked to dial us back at once
RELAYS = 2  # relays kept: the one announced, and a standby
# a relayed peer's part crosses its relay's link twice (in and out), on top of what the relay
# sends as a member itself: with one relay in a group of three at 100 Mbit/s, a relayed share
# of 0.5 gives 0.45 of the ideal all-reduce time and 0.1 gives 0.6 (benchmarks/nat.py). A group
# of relayed peers only still splits by their own bandwidths (every share is scaled alike).
RELAYED_BANDWIDTH_SHARE = 0.1
RETRY_S = 2.0  # no helper or no relay yet: look again after this long
RECHECK_S = 300.0  # a reachable peer re-checks this often (a router may drop the mapping)
RELAY_READY_S = 5.0  # a relay that has not answered by then is skipped
FAILED_RELAY_S = 60.0  # a relay that refused or died is not asked again for this long

PeerLister = Callable[[], Awaitable[dict[PeerID, PeerRecord]]]
Announcer = Callable[[], Awaitable[Any]]


def may_relay(record: PeerRecord) -> bool:
    """Whether ``record`` offers relaying and looks dialable (checked, or a public address)."""
    reach = reach_of(record)
    if not record.extra.get(RELAY_KEY):
        return False
    return reach.dialable or (reach is Reach.UNKNOWN and not is_home_address(record.address.host))


class NatTraversal:
    """Learns and keeps this peer's reachability; relays for others when reachable.

    Args:
        transport: the peer's transport (started).
        list_peers: the run's peer records, from the DHT.
        announce: re-publishes our record (after the address or reach changed).
        udp_probe: pings an address over the DHT's UDP socket (dial-back for others).
        set_dht_client: True while nobody can dial us, so others leave us out of their tables.
        port_mapping: ask the router for a mapping when bound to a home address.
        budget: what we give away as a relay (``RelayBudget(peers=0)`` turns it off).
        relays: the ``HOST:PORT`` of the only peers we may use as relays, in order of
            preference (an empty list: none); None: any reachable peer that offers it.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        list_peers: PeerLister,
        announce: Announcer,
        udp_probe: UdpProbe | None,
        set_dht_client: Callable[[bool], None],
        port_mapping: bool = True,
        budget: RelayBudget | None = None,
        relays: Sequence[str] | None = None,
    ):
        self.transport = transport
        self.list_peers = list_peers
        self.announce = announce
        self.set_dht_client = set_dht_client
        self.port_mapping = port_mapping
        self.budget = budget or RelayBudget()
        self.relays = None if relays is None else [PeerAddress.parse(a) for a in relays]
        self.reach = Reach.UNKNOWN
        self.mapping: PortMapping | None = None
        self.mapping_error: str | None = None
        self.links: list[RelayLink] = []
        self._failed: dict[PeerID, float] = {}  # relays that refused or died: when
        self._bandwidth = float(transport.record().bandwidth)  # the offer, before reach
        self._written: float | None = None  # the bandwidth our last record update wrote
        self._mapper: PortMapper | None = None
        self._task: asyncio.Task[None] | None = None
        self.dialback = DialbackService(transport, udp_probe)
        self.relay = RelayService(transport, self.budget, self._can_relay)

    @property
    def me(self) -> PeerID:
        return self.transport.identity.peer_id

    @property
    def local(self) -> PeerAddress:
        bound = self.transport.bound_address
        if bound is None:
            raise SwarmError("the transport is not started")
        return PeerAddress("127.0.0.1", bound.port) if bound.is_wildcard else bound

    def _lan_address(self) -> PeerAddress | None:
        """Our home-network address and port (what the router maps to), or None."""
        bound = self.local
        host = self.transport.record().address.host if bound.host == "127.0.0.1" else bound.host
        return PeerAddress(host, bound.port) if is_home_address(host) else None

    def _can_relay(self) -> bool:
        if self.reach.dialable:
            return True
        return self.reach is Reach.UNKNOWN and not is_home_address(
            self.transport.record().address.host
        )

    async def start(self) -> None:
        self._set_record(Reach.UNKNOWN)
        self._task = asyncio.create_task(self._run(), name="swarm-nat")

    # ---- record

    def _set_record(self, reach: Reach, address: PeerAddress | None = None) -> None:
        extra = dict(self.transport.record().extra)
        extra[REACH_KEY] = reach.value
        extra[RELAY_KEY] = self.budget.enabled
        current = self.transport.record().bandwidth
        if self._written is not None and current != self._written:
            self._bandwidth = current  # the offer was changed since: it is the new offer
        bandwidth = self._bandwidth
        if reach is Reach.RELAYED:
            bandwidth *= RELAYED_BANDWIDTH_SHARE
        elif reach is Reach.CLIENT:
            bandwidth = 0.0
        fields: dict[str, Any] = {"extra": extra, "bandwidth": bandwidth}
        if address is not None:
            fields["address"] = address
        self.transport.update_record(**fields)
        self._written = bandwidth
        self.reach = reach

    async def _publish(self, reach: Reach, address: PeerAddress | None = None) -> None:
        self._set_record(reach, address)
        self.set_dht_client(reach in (Reach.RELAYED, Reach.CLIENT))
        try:
            await self.announce()
        except SwarmError as e:
            logger.warning("could not announce our new address: %s", e)

    # ---- the loop

    async def _run(self) -> None:
        announced = self.transport.record().address
        if not self.port_mapping:
            self.mapping_error = "port mapping turned off"
        elif (lan := self._lan_address()) is None:
            self.mapping_error = "not on a home network"
        else:
            self._mapper = PortMapper(lan)
            try:
                self.mapping = await self._mapper.map()
                announced = self.mapping.external
                await self._publish(Reach.UNKNOWN, announced)
            except PortMapError as e:
                self.mapping_error = f"router refused: {e}"
                logger.info("no port mapping: %s", e)
        delay = RETRY_S
        while True:
            result = await self._check(announced)
            if result is None:  # nobody to ask yet
                await asyncio.sleep(delay)
                delay = min(delay * 1.5, 10.0)
                continue
            if result.tcp:
                await self._became_reachable(result, announced)
                await asyncio.sleep(RECHECK_S)
                continue
            await self._keep_relays(result)
            return

    async def _check(self, announced: PeerAddress) -> DialbackResult | None:
        """Ask up to :data:`HELPERS` peers to dial us back; the best answer, or None."""
        try:
            records = await self.list_peers()
        except SwarmError as e:
            logger.debug("cannot list peers for a dial-back: %s", e)
            return None
        checked = [r for p, r in records.items() if p != self.me and reach_of(r).dialable]
        unchecked = [
            r
            for p, r in records.items()
            if p != self.me and reach_of(r) is Reach.UNKNOWN and not is_home_address(r.address.host)
        ]
        relayed = [r for p, r in records.items() if p != self.me and reach_of(r) is Reach.RELAYED]
        for group in (checked, unchecked, relayed):
            random.shuffle(group)
        helpers = (checked + unchecked + relayed)[:HELPERS]
        if not helpers:
            return None
        answers = await asyncio.gather(
            *(
                request_dialback(self.transport, h, announced.port, host=announced.host)
                for h in helpers
            ),
            return_exceptions=True,
        )
        results = [a for a in answers if isinstance(a, DialbackResult)]
        for helper, answer in zip(helpers, answers, strict=True):
            if not isinstance(answer, DialbackResult):
                logger.debug("dial-back by %s failed: %s", helper.peer_id.short, answer)
        if not results:
            return None
        return max(results, key=lambda r: (r.tcp, r.udp))

    async def _became_reachable(self, result: DialbackResult, announced: PeerAddress) -> None:
        mapped = self.mapping is not None and result.port == self.mapping.external.port
        reach = Reach.MAPPED if mapped else Reach.DIRECT
        for link in self.links:
            await link.close()
        self.links.clear()
        if reach is not self.reach:
            logger.info(
                "reachable (%s) at %s: %s dialed us back (udp %s)",
                reach.value,
                announced,
                result.helper.short,
                "ok" if result.udp else "failed",
            )
        await self._publish(reach, announced)

    async def _keep_relays(self, result: DialbackResult) -> None:
        why = self.mapping_error or "the router mapped our port, yet nobody could dial it"
        logger.warning(
            "behind NAT (others see us as %s), no port mapping (%s); looking for a relay",
            result.observed_host,
            why,
        )
        while True:
            for link in self.links:
                if link.done.is_set():
                    logger.warning("relay %s lost: %s", link.relay_id.short, link.error)
                    self._failed[link.relay_id] = time.monotonic()
            self.links = [link for link in self.links if not link.done.is_set()]
            if not self.links:
                await self._find_relays(1)
            primary = self.links[0] if self.links else None
            if primary is not None and primary.address is not None:
                if self.reach is not Reach.RELAYED or (
                    self.transport.record().address != primary.address
                ):
                    logger.warning(
                        "behind NAT, no port mapping (%s), relayed through %s at %s",
                        why,
                        primary.relay_id.short,
                        primary.address,
                    )
                    await self._publish(Reach.RELAYED, primary.address)
            elif self.reach is not Reach.CLIENT:
                logger.warning(
                    "behind NAT, no port mapping (%s), no relay available: client only "
                    "(others cannot dial us; we own no part of an all-reduce)",
                    why,
                )
                await self._publish(Reach.CLIENT)
            if self.links and len(self.links) < RELAYS:  # the standby, once the primary is out
                await self._find_relays(RELAYS - len(self.links))
            waits = [asyncio.ensure_future(link.done.wait()) for link in self.links]
            try:
                if waits and len(self.links) >= RELAYS:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                elif waits:
                    await asyncio.wait(waits, timeout=RETRY_S, return_when=asyncio.FIRST_COMPLETED)
                else:
                    await asyncio.sleep(RETRY_S)
            finally:
                for w in waits:
                    w.cancel()

    async def _find_relays(self, wanted: int) -> None:
        try:
            records = await self.list_peers()
        except SwarmError as e:
            logger.debug("cannot list peers to find a relay: %s", e)
            return
        linked = {link.relay_id for link in self.links}
        now = time.monotonic()
        self._failed = {p: t for p, t in self._failed.items() if now - t < FAILED_RELAY_S}
        candidates = [
            r
            for p, r in records.items()
            if p != self.me and p not in linked and p not in self._failed and may_relay(r)
        ]
        random.shuffle(candidates)
        candidates.sort(key=lambda r: not reach_of(r).dialable)  # checked ones first
        if self.relays is not None:  # only those the user named, in the user's order
            named = self.relays
            candidates = sorted(
                (r for r in candidates if r.address in named), key=lambda r: named.index(r.address)
            )
        for record in candidates:
            if wanted == 0:
                return
            link = RelayLink(self.transport, record, self.local)
            try:
                await link.wait_ready(RELAY_READY_S)
            except SwarmError as e:
                logger.info("relay %s refused: %s", record.peer_id.short, e)
                self._failed[record.peer_id] = time.monotonic()
                await link.close()
                continue
            self.links.append(link)
            wanted -= 1

    async def close(self) -> None:
        """Stop; leave the relays; remove the port mapping; stop relaying for others."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for link in self.links:
            await link.close()
        self.links.clear()
        await self.relay.close()
        if self._mapper is not None:
            await self._mapper.close()
