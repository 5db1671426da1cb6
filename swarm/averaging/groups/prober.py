"""Network coordinates of this peer: RTT probes to known peers, Vivaldi, published in the record.

Every ``period`` seconds the :class:`Prober` reads the peer records of the run (one DHT read, or
the peer's last one when it is younger than a period: the planner reads them every round), sends
one ``/ping`` (:meth:`swarm.net.transport.Transport.ping`) to each of at most ``probes`` peers,
feeds every answer to :class:`~swarm.averaging.groups.coordinates.Vivaldi` together with the
coordinate that peer published, and publishes the new coordinate under ``extra["vc"]`` of this
peer's :class:`~swarm.net.record.PeerRecord`: re-announced at once when the coordinate moved
``publish_move_s`` (5 ms) since it was last announced, otherwise by the next heartbeat.

Which peers: half of the probes go to the peers predicted nearest (Vivaldi is most accurate where
it is sampled, and near peers are the ones grouping depends on), the rest to a random sample of
the others, so distant regions stay measured and a peer that moved is found. The cost is bounded:
``probes`` pings of 64 bytes and at most one DHT read and store per period, whatever the swarm
size.

A sample during which this peer's own event loop was held up (:mod:`.loop_lag`: a training
step, a round's tensor work) is dropped once that peer has a clean one: the hold-up would read as
distance and move this peer out of its region.

Departures travel the same way: a peer that found another one gone (its address refused a
connection, see :mod:`.liveness`) lists it under ``extra["gn"]`` and re-announces at once; the
others read that list with the records before they plan a round and check those peers themselves
(a report is a hint, never proof), so every view drops a killed peer within about a round instead
of each peer finding out on its own.

:meth:`Prober.placed` is the input of :func:`swarm.averaging.groups.regions.plan_groups`: where
every live peer's record places it for a round (:mod:`.placement`: a cell and a rounded
coordinate, published rounds before they count); a peer it does not place yet sits at the
origin. :meth:`Prober.view` is every peer's newest coordinate.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time

from swarm.averaging.groups.apart import APART_FIELD, KeptApart
from swarm.averaging.groups.coordinates import Coordinate, Vivaldi, VivaldiConfig, predict_rtt
from swarm.averaging.groups.grid import Cell
from swarm.averaging.groups.loop_lag import LagWatch
from swarm.averaging.groups.peer_tags import by_tag, tag_of, tags_in
from swarm.averaging.groups.placement import (
    PLACEMENT_FIELD,
    PREVIOUS_FIELD,
    Placer,
    moved,
    placement_at,
    put,
)
from swarm.errors import ConfigError, SwarmError, TransportError
from swarm.identity import PeerID
from swarm.net.progress import PROGRESS_FIELD
from swarm.net.record import PeerRecord
from swarm.protocols import Peer

logger = logging.getLogger(__name__)

COORDINATE_FIELD = "vc"  # key of the coordinate in PeerRecord.extra
GONE_FIELD = "gn"  # key of the peers this peer found gone, in PeerRecord.extra
# peers a record lists as gone (the latest ones; longer lists are ignored): 8 tags take about
# 110 of the 768 bytes a record's extra may hold
MAX_GONE_LISTED = 8
# A sample during which this peer's event loop was held up longer than this measured the
# hold-up as much as the path: dropped, unless the peer has no clean sample yet (a loop that is
# always busy still gets coordinates). Below Windows' ~16 ms timer granularity, and well below
# the 50 ms region diameter that an inflated sample would break.
HELD_UP_S = 0.02
PUBLISH_MOVE_S = 0.005  # a coordinate that moved this far is announced at once
MAX_REPORT_CHECKS = 8  # reported peers checked per plan (a lying list costs a few pings)
REPORT_RECHECK_S = 5.0  # a reported peer that answered is not checked again for this long


def coordinate_of(record: PeerRecord, dims: int) -> Coordinate | None:
    """The coordinate a record publishes, or None (none, malformed, other dimension count)."""
    raw = record.extra.get(COORDINATE_FIELD)
    if raw is None:
        return None
    try:
        coordinate = Coordinate.from_wire(raw)
    except SwarmError as e:
        logger.debug("ignoring the coordinate of %s: %s", record.peer_id.short, e)
        return None
    return coordinate if coordinate.dims == dims else None


class Prober:
    """Keeps this peer's Vivaldi coordinate up to date and published.

    Args:
        peer: a started :class:`swarm.peer.Peer`.
        period: seconds between probe rounds.
        probes: peers pinged per period (at most).
        vivaldi: tuning of the coordinate system; every peer of a run uses the same ``dims``.
        ping_timeout: a probe not answered by then is dropped (no sample).
        rng: peer choice and Vivaldi's random directions (seed it for reproducible tests).
        publish_move_s: a probe round publishes the coordinate at once only when it moved this
            far (seconds of RTT) since it was last published, or the placement changed (it
            moves by as much, or to another grid cell); a smaller move rides on the next
            heartbeat, which announces the record anyway.
        region_rtt: the run's region diameter (seconds), which sizes the grid cell published
            in the placement (:mod:`.grid`).

    Attributes:
        vivaldi: the coordinate state (``vivaldi.coordinate`` is this peer's current one).
        records: the peer records read last (every live peer of the run, this one included).
        placer: this peer's placements (:mod:`.placement`), published in its record.
        round_order: the next round this peer's planner plans (it keeps it up to date): a new
            placement counts from ``LEAD_ROUNDS`` rounds after it.
        samples: RTT samples taken so far.
        held_up: RTT samples dropped because this peer's event loop was held up during them.
    """

    def __init__(
        self,
        peer: Peer,
        *,
        period: float = 5.0,
        probes: int = 4,
        vivaldi: VivaldiConfig | None = None,
        ping_timeout: float = 2.0,
        rng: random.Random | None = None,
        publish_move_s: float = PUBLISH_MOVE_S,
        region_rtt: float = 0.05,
    ):
        if not period > 0 or not ping_timeout > 0:
            raise ConfigError("probe period and ping_timeout must be positive")
        if probes < 1:
            raise ConfigError("probes per period must be >= 1")
        self.peer = peer
        self.period = period
        self.probes = probes
        self.ping_timeout = ping_timeout
        self.rng = rng or random.Random()
        self.vivaldi = Vivaldi(vivaldi, rng=self.rng)
        self.publish_move_s = publish_move_s
        self.placer = Placer(region_rtt, publish_move_s)  # where this peer's record places it
        self.round_order = 0  # the next round the planner plans (it keeps this up to date)
        self._published: Coordinate | None = None  # the coordinate last announced
        self.records: dict[PeerID, PeerRecord] = {}
        self.gone: dict[PeerID, float] = {}  # peer -> time.time() its address refused us
        self.apart: KeptApart | None = None  # peers never grouped with this one (its record's)
        self._apart_told: list[str] = []  # the apart list last put in the record
        self._reports_checked: dict[PeerID, float] = {}  # reported peer -> when we checked it
        self._publishing: asyncio.Task[None] | None = None
        self.samples = 0
        self.held_up = 0  # samples dropped because this peer's loop was held up during them
        self._measured: dict[PeerID, None] = {}  # peers with a sample free of hold-ups (LRU)
        self.refreshed_at = -math.inf  # time.monotonic() of the last refresh
        self._task: asyncio.Task[None] | None = None

    @property
    def coordinate(self) -> Coordinate:
        return self.vivaldi.coordinate

    def start(self) -> None:
        """Start probing in the background (idempotent)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="swarm-probe")

    async def close(self) -> None:
        if self._publishing is not None:
            self._publishing.cancel()
            await asyncio.gather(self._publishing, return_exceptions=True)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def refresh(
        self, max_age_s: float = 0.0, *, spaced: bool = False
    ) -> dict[PeerID, PeerRecord]:
        """Read the peer records now (one DHT read, or the peer's last one when it is younger
        than ``max_age_s``; ``spaced``: see :meth:`swarm.peer.Peer.known_peers`) and merge them
        into :attr:`records`.

        A DHT read may miss some entries (it asks a quorum, not every node), and a peer whose
        view lacks a peer may compute other group keys than the rest; so a record stays until
        it would have expired in the DHT (``record_ttl_s`` after it was signed), the newest
        record of each peer wins.
        """
        try:
            fresh = await self.peer.known_peers(max_age_s, spaced=spaced)
        except SwarmError as e:
            logger.debug("reading peer records failed: %s", e)
            fresh = {}
        ttl = self.peer.config.record_ttl
        oldest = time.time() - ttl
        departed = self.peer.departed  # their leave marker is up: do not wait for them
        self.gone = {pid: t for pid, t in self.gone.items() if t > oldest}
        merged = {
            pid: r
            for pid, r in self.records.items()
            if r.timestamp > oldest and pid not in departed and not self._gone(r)
        }
        for pid, record in fresh.items():
            known = merged.get(pid)
            if (known is None or record.timestamp >= known.timestamp) and not self._gone(record):
                merged[pid] = record
        self.records = merged
        self.refreshed_at = time.monotonic()
        return merged

    def mark_gone(self, peer_id: PeerID) -> None:
        """``peer_id``'s address refused a connection: plan no group with it until it signs a
        newer record (a killed peer's record lives on in the DHT until its TTL runs out)."""
        known = peer_id in self.gone
        self.gone[peer_id] = time.time()
        self.records.pop(peer_id, None)
        if not known and peer_id != self.peer.peer_id:
            self._tell_gone()

    def reported_gone(self) -> list[PeerRecord]:
        """Peers that other records list as gone and that this view still holds: to check
        (each at most once per ``REPORT_RECHECK_S``, at most ``MAX_REPORT_CHECKS`` at once)."""
        tagged = by_tag(self.records)
        now = time.monotonic()
        self._reports_checked = {
            p: t for p, t in self._reports_checked.items() if now - t < REPORT_RECHECK_S
        }
        suspects: list[PeerRecord] = []
        for record in list(self.records.values()):
            for tag in tags_in(record, GONE_FIELD, MAX_GONE_LISTED):
                pid = tagged.get(tag)
                if pid is None or pid == self.peer.peer_id or pid in self._reports_checked:
                    continue
                self._reports_checked[pid] = now
                suspects.append(self.records[pid])
                if len(suspects) >= MAX_REPORT_CHECKS:
                    return suspects
        return suspects

    def _tell_gone(self) -> None:
        """List the latest gone peers in this peer's record and re-announce (in the background;
        one announcement at a time, later departures join the next)."""
        if self._publishing is not None and not self._publishing.done():
            return
        self._publishing = asyncio.get_running_loop().create_task(
            self._publish(), name="swarm-probe-gone"
        )

    def tell_apart(self) -> None:
        """Re-announce (in the background) when the peers kept apart changed since the record
        last listed them: planners that do not know a pair yet plan other groups."""
        if self.apart is not None and self.apart.tags() != self._apart_told:
            self._tell_gone()

    def _gone(self, record: PeerRecord) -> bool:
        return record.timestamp <= self.gone.get(record.peer_id, -math.inf)

    def view(self) -> dict[PeerID, Coordinate]:
        """The coordinate of every peer in :attr:`records`, and this peer's own."""
        dims = self.vivaldi.config.dims
        origin = Coordinate.origin(dims)
        view = {pid: coordinate_of(r, dims) or origin for pid, r in self.records.items()}
        me = self.peer.peer_id
        if view.get(me, origin) == origin:
            view[me] = self.coordinate
        return view

    def placed(self, round_: int) -> tuple[dict[PeerID, Coordinate], dict[PeerID, Cell]]:
        """The coordinate and cell every peer of :attr:`records` and this one has in the plan
        of ``round_`` (:mod:`.placement`): what its record places it at for that round, the
        origin and no cell for a peer it does not place yet."""
        dims = self.vivaldi.config.dims
        view: dict[PeerID, Coordinate] = {}
        cells: dict[PeerID, Cell] = {}
        me = self.peer.peer_id
        for pid, record in self.records.items():
            if pid != me:
                put(view, cells, pid, placement_at(record.extra, dims, round_), dims)
        put(view, cells, me, self.placer.at(round_), dims)  # (what its newest record says)
        return view, cells

    async def probe_once(self) -> int:
        """One period's work: read records, ping, update and publish; returns samples taken."""
        # the planner's reads will do, and in a large swarm one read every few periods
        records = await self.refresh(max_age_s=self.period, spaced=True)
        targets = self._choose({pid: r for pid, r in records.items() if pid != self.peer.peer_id})
        async with LagWatch() as watch:
            timed = await asyncio.gather(*(self._timed_ping(r) for r in targets))
        taken = 0
        dims = self.vivaldi.config.dims
        for record, (rtt, start, end) in zip(targets, timed, strict=True):
            remote = coordinate_of(record, dims) or Coordinate.origin(dims)
            if rtt is None:
                continue
            held = watch.worst(start, end)
            if held > HELD_UP_S and record.peer_id in self._measured:
                self.held_up += 1  # this loop's hold-up, not the path: keep the clean samples
                logger.debug(
                    "RTT sample to %s dropped: loop held %.3f s", record.peer_id.short, held
                )
                continue
            try:
                self.vivaldi.observe(rtt, remote, record.peer_id)
            except SwarmError as e:
                logger.debug("RTT sample to %s rejected: %s", record.peer_id.short, e)
                continue
            if held <= HELD_UP_S:
                self._measured.pop(record.peer_id, None)  # re-inserted last: order = recency
                self._measured[record.peer_id] = None
                while len(self._measured) > self.vivaldi.config.max_filtered_peers:
                    del self._measured[next(iter(self._measured))]
            taken += 1
        self.samples += taken
        if taken:
            far = self._published is None or moved(self._published, self.coordinate) >= (
                self.publish_move_s
            )
            # a new placement goes out at once: readers must hold it before it counts
            if self.placer.update(self.coordinate, self.round_order) or far:
                await self._publish()
            else:
                self._put_in_record()
        return taken

    def measured(self, peer_id: PeerID) -> bool:
        """Whether a sample to ``peer_id`` free of hold-ups of this loop was taken (and is
        remembered): later held-up samples to it are dropped."""
        return peer_id in self._measured

    def _choose(self, others: dict[PeerID, PeerRecord]) -> list[PeerRecord]:
        if len(others) <= self.probes:
            return list(others.values())
        dims = self.vivaldi.config.dims
        here = self.coordinate

        def predicted(pid: PeerID) -> float:
            there = coordinate_of(others[pid], dims)
            return predict_rtt(here, there) if there is not None else float("inf")

        near = sorted(others, key=lambda pid: (predicted(pid), pid.digest))[: self.probes // 2]
        rest = [pid for pid in others if pid not in near]
        chosen = near + self.rng.sample(rest, self.probes - len(near))
        return [others[pid] for pid in chosen]

    async def _timed_ping(self, record: PeerRecord) -> tuple[float | None, float, float]:
        """:meth:`_ping`, with when it started and ended (``time.perf_counter()``)."""
        start = time.perf_counter()
        rtt = await self._ping(record)
        return rtt, start, time.perf_counter()

    async def _ping(self, record: PeerRecord) -> float | None:
        try:
            return await self.peer.transport.ping(record.address, timeout=self.ping_timeout)
        except (SwarmError, OSError, asyncio.TimeoutError) as e:
            logger.debug("probe to %s failed: %s", record.peer_id.short, e)
            if isinstance(e, TransportError) and e.refused:
                self.mark_gone(record.peer_id)
            return None

    async def _publish(self) -> None:
        self._put_in_record()
        if self.samples:
            self._published = self.coordinate
        try:
            await self.peer.announce()
        except SwarmError as e:
            logger.debug("publishing the coordinate failed: %s", e)

    def _put_in_record(self) -> None:
        """Put the coordinate and the gone and apart lists in our record (announced by the
        next store)."""
        transport = self.peer.transport
        latest = sorted(self.gone, key=self.gone.__getitem__)[-MAX_GONE_LISTED:]
        ours = (GONE_FIELD, APART_FIELD, PLACEMENT_FIELD, PREVIOUS_FIELD)
        extra = {k: v for k, v in transport.record().extra.items() if k not in ours}
        if latest:
            extra[GONE_FIELD] = [tag_of(pid) for pid in latest]
        if self.samples:  # no coordinate before the first RTT sample
            extra[COORDINATE_FIELD] = self.coordinate.to_wire()
            extra.update(self.placer.extra())
        apart = self._apart_told = self.apart.tags() if self.apart is not None else []
        if apart:
            try:
                transport.update_record(extra={**extra, APART_FIELD: apart})
                return
            except ConfigError:  # no room beside a long progress: the coordinate comes first
                logger.debug("no room in the record for the peers kept apart")
        try:
            transport.update_record(extra=extra)
        except ConfigError:  # a progress that filled the room: the next announce fits it again
            logger.debug("no room in the record beside the progress: announced without it")
            extra.pop(PROGRESS_FIELD, None)
            transport.update_record(extra=extra)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            try:
                await self.probe_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not end probing for good
                logger.exception("probe round failed")
            due = max(due + self.period, loop.time())
            await asyncio.sleep(due - loop.time())
