"""A discrete-event simulation of latency-aware grouping at scale (issue 32): N peers under churn,
each planning its rounds from its own view with the real planner.

Real library code: :func:`~swarm.averaging.groups.regions.plan_groups` computes every due peer's
group key from that peer's own view, and its CPU time is measured (``time.perf_counter``); every
peer's coordinate is a real :class:`~swarm.averaging.groups.coordinates.Vivaldi` fed with
simulated pings by the prober's rule (every ``probe_period_s``, half of the ``probes`` to the
peers predicted nearest, the rest at random, then the record is published with the placement
:class:`~swarm.averaging.groups.placement.Placer` gives, and plans read placements as
:meth:`~swarm.averaging.groups.prober.Prober.placed` does); the settings and
limits are the library's (AveragingConfig, PeerConfig, the prober's gone reports, the join desk's
patience, the DHT's slots per key).

Simulated (no sockets, a simulated clock): the network (:mod:`scale_sim_net`), churn (every peer
stays an exponential time of mean ``1 / churn_per_min`` minutes, and a newcomer takes its place
about 10 s after it left; half leave cleanly), the DHT and matchmaking (:mod:`scale_sim_match`).
The DHT, as the code uses it:

- a peer publishes its record (coordinate, and the peers it found gone) at join and after every
  probe; a version is readable after a store delay; a killed peer's record lives until its last
  version's TTL (``record_ttl``), a peer that leaves cleanly publishes a leave marker instead;
- a read lists records oldest first (the holders' listing order) and returns at most
  ``read_cap`` of them (what a get's pages hold: measured by ``benchmarks/scale.py``); a key
  holds at most ``slot_cap`` slots, so a newcomer's store is refused while it is full;
- a peer's view: the records its read returned, less leave markers and the peers it found gone
  (a refused ping of a probe or a matchmaking round, or a check of peers that other records
  report gone, up to 8 per plan, as ``GroupPlanner`` does).

Rounds are due every ``round_s`` (at a random phase of the clock); each started peer starts its
round within ``start_spread_s`` of the due time (unequal compute); its plan's read of the peer
list began ``READ_AHEAD_S`` before the due time (RoundLookout; ``read_ahead=False``: when the
peer starts its round), and it declares once the read is done. A peer that leaves before its
round could end is not due, and counts as dead from the round's start for the others. A joiner
averages from its first round ``startup_s`` after it joined. The planner's CPU time is not added
to the simulated times. ``view_quantum_s`` is a what-if, not the code's rule (see
:meth:`World._anchored_view`).
"""

from __future__ import annotations

import gc
import hashlib
import heapq
import math
import random
import time
from typing import Any

import numpy as np
from scale_sim_match import MatchConfig, Outcome, Seeker, match
from scale_sim_net import draw_site, get_delay, ping, store_delay, true_rtt
from scale_sim_state import RoundStats, SimConfig, SimPeer, Version

from swarm.averaging.groups import grid, regions
from swarm.averaging.groups.coordinates import Coordinate, Vivaldi, VivaldiConfig, predict_rtt
from swarm.averaging.groups.join_desk import LAG_SAMPLES, PATIENCE_SLACK_S
from swarm.averaging.groups.placement import placement_at, put
from swarm.averaging.groups.planner import REPORT_WAIT_S
from swarm.averaging.groups.prober import MAX_GONE_LISTED, MAX_REPORT_CHECKS, REPORT_RECHECK_S
from swarm.identity import PeerID
from swarm.training.cadence import READ_AHEAD_S

VIVALDI = VivaldiConfig()
DIMS = VIVALDI.dims
ORIGIN = Coordinate.origin(DIMS)
INITIAL_AGES_S = 600.0  # the first peers joined up to this long before the simulation starts
REPLACE_MEAN_S = 10.0  # a departure is followed by a newcomer this long after, on average
ANCHOR_MARGIN_S = 5.0  # SimConfig.view_quantum_s: stores land well within this


class World:
    """The peers, their records and the event queue; :meth:`run` returns every round's figures."""

    def __init__(self, config: SimConfig):
        self.cfg = config
        self.rng = random.Random(config.seed)
        avg = config.averaging
        self.grouping = regions.GroupingConfig(
            avg.min_group_size,
            avg.target_group_size,
            cross_every=avg.cross_every,
            region_rtt=avg.region_rtt_s,
        )
        self.match_cfg = MatchConfig(
            avg.min_group_size, avg.target_group_size, avg.gather_window, avg.matchmaking_timeout_s
        )
        self.ttl = config.peer.record_ttl
        self.peers: list[SimPeer] = []
        self.by_pid: dict[PeerID, int] = {}
        self.stored: list[int] = []  # peers whose record a holder took, oldest first
        self.rounds: list[RoundStats] = []
        self._events: list[tuple[float, int, str, int]] = []
        self._seq = 0
        self._due: dict[int, list[Seeker]] = {}
        self._due_at = 0.0  # the round being planned fell due then
        self._candidates: tuple[Any, ...] | None = None  # see _probe_candidates
        for _ in range(config.peers):
            self._add_peer(-self.rng.uniform(0.0, INITIAL_AGES_S), 0.0)
        r = 0  # rounds come every round_s, at no particular phase of the wall clock
        while (due := config.warmup_s + (r + self.rng.random()) * config.round_s) < config.end:
            self._push(due, "round", r)
            r += 1

    def run(self) -> list[RoundStats]:
        while self._events:
            t, _, kind, arg = heapq.heappop(self._events)
            if kind == "probe":
                self._probe(self.peers[arg], t)
            elif kind == "plan":
                self._plan(arg, t)
            elif kind == "match":
                self._match(arg, t)
            elif kind == "round":
                self._round(arg, t)
            elif kind == "leave":
                self._leave(self.peers[arg], t)
            elif kind == "join":
                self._add_peer(t, t)
        return self.rounds

    # ---- peers and their records

    def _push(self, t: float, kind: str, arg: int) -> None:
        heapq.heappush(self._events, (t, self._seq, kind, arg))
        self._seq += 1

    def _add_peer(self, joined: float, now: float) -> None:
        idx = len(self.peers)
        digest = hashlib.sha256(b"scale-sim %d %d" % (self.cfg.seed, idx)).digest()
        vivaldi = Vivaldi(VIVALDI, rng=random.Random(digest))
        peer = SimPeer(idx, PeerID(digest), draw_site(self.rng), joined, vivaldi)
        self.peers.append(peer)
        self.by_pid[peer.pid] = idx
        if self.cfg.churn_per_min > 0:  # memoryless: as if a random peer left at random times
            peer.leave = now + self.rng.expovariate(self.cfg.churn_per_min / 60.0)
            if peer.leave < self.cfg.end:
                self._push(peer.leave, "leave", idx)
        self._publish(peer, now)  # Peer.start announces (no coordinate yet)
        period = self.cfg.averaging.probe_period_s
        first = now + (
            self.rng.uniform(0.0, period) if joined < now else self.rng.uniform(0.5, 1.5)
        )
        self._push(first, "probe", idx)

    def _leave(self, peer: SimPeer, t: float) -> None:
        peer.graceful = self.rng.random() < self.cfg.graceful_share
        if peer.graceful:
            self._publish(peer, t, left=True)
        self._push(t + self.rng.expovariate(1.0 / REPLACE_MEAN_S), "join", -1)

    def _publish(self, peer: SimPeer, t: float, *, left: bool = False) -> None:
        if peer.first_stored is None:
            if self._slots(t) >= self.cfg.slot_cap:
                return  # the key is full: refused (the next publish tries again)
            peer.first_stored = t
            self.stored.append(peer.idx)
        gone = tuple(sorted(peer.gone, key=lambda i: (peer.gone[i], i))[-MAX_GONE_LISTED:])
        coordinate = peer.vivaldi.coordinate if peer.samples else None
        if coordinate is not None:  # (a joiner plans from the swarm's next round)
            peer.placer.update(coordinate, len(self.rounds))
        placed = peer.placer.extra()
        version = Version(t, t + store_delay(self.rng), coordinate, gone, left, placed)
        at = len(peer.versions)
        while at and peer.versions[at - 1].publish > t:  # (gone reports come in out of order)
            at -= 1
        peer.versions.insert(at, version)

    def _slots(self, t: float) -> int:
        """Slots the peer list's key holds at ``t`` (unexpired records and leave markers)."""
        count = 0
        for i in self.stored:
            v = self.peers[i].latest(t)
            count += v is not None and v.publish + self.ttl > t
        return count

    def _listing(self, t: float) -> list[tuple[int, Version]]:
        """What a read at ``t`` returns: unexpired records, oldest first, at most read_cap."""
        rows = []
        for i in self.stored:
            v = self.peers[i].latest(t)
            if v is not None and v.publish + self.ttl > t:
                rows.append((i, v))
        return rows if self.cfg.read_cap is None else rows[: self.cfg.read_cap]

    # ---- probing (the prober's rule, real Vivaldi)

    def _probe(self, peer: SimPeer, t: float) -> None:
        if peer.leave <= t:
            return
        rows, ids, vectors, heights = self._probe_candidates(t)
        keep = ids != peer.idx
        if peer.gone:
            keep &= ~np.isin(ids, list(peer.gone))
        keep = np.flatnonzero(keep)
        probes = self.cfg.averaging.probes_per_period
        if len(keep) <= probes:
            targets = [rows[k] for k in keep]
        else:  # Prober._choose: half the nearest predicted (none: infinitely far), half at random
            here = np.array(peer.vivaldi.coordinate.vector)
            predicted = np.linalg.norm(vectors[keep] - here, axis=1) + heights[keep]
            order = np.argsort(predicted, kind="stable")
            near, rest = keep[order[: probes // 2]], keep[order[probes // 2 :]]
            picked = self.rng.sample(range(len(rest)), probes - len(near))
            targets = [rows[k] for k in [*near, *rest[picked]]]
        taken, found_gone = 0, False
        for i, remote in targets:
            other = self.peers[i]
            if other.leave <= t:  # a refused ping: gone (Prober.mark_gone)
                peer.gone[i] = t
                found_gone = True
                continue
            rtt = ping(true_rtt(peer.site, other.site, (peer.idx, i)), self.rng)
            if rtt <= VIVALDI.max_rtt:
                peer.vivaldi.observe(rtt, remote or ORIGIN, i)
                taken += 1
        peer.samples += taken
        if taken or found_gone:
            self._publish(peer, t)
        if t + self.cfg.averaging.probe_period_s < self.cfg.end:
            self._push(t + self.cfg.averaging.probe_period_s, "probe", peer.idx)

    def _probe_candidates(
        self, t: float
    ) -> tuple[list[tuple[int, Coordinate | None]], np.ndarray, np.ndarray, np.ndarray]:
        """The readable records as of the start of this second (a prober reads every period;
        a second's staleness changes nothing here), with their coordinates as arrays."""
        second = math.floor(t)
        if self._candidates is None or self._candidates[0] != second:
            rows = [(i, v.coordinate) for i, v in self._listing(float(second)) if not v.left]
            ids = np.array([i for i, _ in rows], dtype=np.intp)
            vectors = np.array([(c or ORIGIN).vector for _, c in rows]).reshape(-1, VIVALDI.dims)
            heights = np.array([np.inf if c is None else c.height for _, c in rows])
            self._candidates = (second, rows, ids, vectors, heights)
        return self._candidates[1:]

    # ---- rounds

    def _round(self, r: int, due_at: float) -> None:
        cfg = self.cfg
        stats = RoundStats(r)
        self.rounds.append(stats)
        self._due_at = due_at
        self._due[r] = []
        last = due_at + cfg.start_spread_s
        gone_for_good = due_at - 2 * self.ttl  # (their records expired long ago)
        self.stored = [i for i in self.stored if self.peers[i].versions[-1].publish > gone_for_good]
        for peer in self.peers:
            if peer.leave <= due_at or peer.joined + cfg.startup_s > due_at:
                continue
            start = due_at + self.rng.uniform(0.0, cfg.start_spread_s)
            if peer.leave < start + cfg.averaging.matchmaking_timeout_s:
                stats.left_mid_round += 1
                continue
            stats.due += 1
            self._push(start, "plan", peer.idx)
        self._push(last, "match", r)

    def _plan(self, idx: int, start: float) -> None:
        """One due peer plans its round from its own view (GroupPlanner.plan)."""
        peer, stats = self.peers[idx], self.rounds[-1]
        # the read: ahead of the round (its records as they stood then), or at the start
        read_at = self._due_at - READ_AHEAD_S if self.cfg.read_ahead else start
        read_done = read_at + get_delay(self.rng)
        view, cells, wait = self._view_of(peer, stats.round, read_at, max(start, read_done))
        gc.disable()  # (a collection of the simulation's own objects is not the planner's)
        try:
            started = time.perf_counter()
            plan = regions.plan_groups(view, stats.round, self.grouping, cells)
            key = plan.key_of(peer.pid) if len(view) > 1 else None
            stats.planner_s.append(time.perf_counter() - started)
        finally:
            gc.enable()
        stats.view_sizes.append(len(view))
        stats.keys[peer.pid.digest.hex()] = key
        if key is None:
            stats.idle += 1
            stats.reasons["idle: alone in its region"] += 1
            return
        members = plan.groups[key]
        leader = self.by_pid[min(members, key=lambda p: p.digest)]
        declare = max(start, read_done) + wait
        planned = tuple(self.by_pid[p] for p in members)
        seeker = Seeker(
            idx, peer.pid.digest, start, declare, key, leader, planned, self._patience(peer)
        )
        self._due[stats.round].append(seeker)

    def _view_of(
        self, reader: SimPeer, round_: int, t: float, now: float | None = None
    ) -> tuple[dict[PeerID, Coordinate], dict[PeerID, grid.Cell], float]:
        """The reader's view of ``round_`` from a read at ``t``, then checks of reported peers
        at ``now`` (default ``t``): the placements the records give for the round, and how long
        the checks held the plan up."""
        now = t if now is None else now
        if self.cfg.view_quantum_s:
            return *self._anchored_view(reader, round_, t, self.cfg.view_quantum_s), 0.0
        view: dict[PeerID, Coordinate] = {}
        cells: dict[PeerID, grid.Cell] = {}
        reported: list[int] = []
        for i, v in self._listing(t):
            if v.left or i in reader.gone:
                continue
            put(view, cells, self.peers[i].pid, placement_at(v.placed, DIMS, round_), DIMS)
            reported.extend(v.gone)
        put(view, cells, reader.pid, reader.placer.at(round_), DIMS)
        recent = now - REPORT_RECHECK_S
        suspects: list[int] = []
        for i in dict.fromkeys(reported):
            if len(suspects) == MAX_REPORT_CHECKS:
                break
            if (
                i != reader.idx
                and self.peers[i].pid in view
                and reader.checked.get(i, -1e9) < recent
            ):
                suspects.append(i)
        wait = 0.0
        for i in suspects:
            reader.checked[i] = now
            rtt = true_rtt(reader.site, self.peers[i].site, (reader.idx, i))
            wait = max(wait, rtt)
            if self.peers[i].leave <= now:
                reader.gone[i] = now + rtt
                del view[self.peers[i].pid]
        return view, cells, min(wait, REPORT_WAIT_S)

    def _anchored_view(
        self, reader: SimPeer, round_: int, t: float, quantum: float
    ) -> tuple[dict[PeerID, Coordinate], dict[PeerID, grid.Cell]]:
        """What-if: the records of one read as they stood at the last multiple of ``quantum``
        less a margin for stores to land, which every peer starting a round between the same
        two multiples shares: joins, departures and moves after it wait for the next one. No
        gone reports (subjective); the matchmaking pings dead planned peers anyway."""
        anchor = math.floor(t / quantum) * quantum - ANCHOR_MARGIN_S
        view: dict[PeerID, Coordinate] = {}
        cells: dict[PeerID, grid.Cell] = {}
        for i, _ in self._listing(t):
            v = self.peers[i].latest(t, published=anchor)
            if v is not None and not v.left and v.publish + self.ttl > anchor:
                put(view, cells, self.peers[i].pid, placement_at(v.placed, DIMS, round_), DIMS)
        put(view, cells, reader.pid, reader.placer.at(round_), DIMS)
        return view, cells

    def _patience(self, peer: SimPeer) -> float:
        most = self.cfg.averaging.matchmaking_timeout_s / 2  # Averager.patience
        if len(peer.lags) < LAG_SAMPLES:
            return most
        return min(most, 2 * max(peer.lags) + PATIENCE_SLACK_S)

    def _match(self, r: int, now: float) -> None:
        stats, seekers = self.rounds[-1], self._due.pop(r)
        dead_by = now + self.cfg.averaging.matchmaking_timeout_s
        dead = {p.idx for p in self.peers if p.leave < dead_by}
        outcomes, lags = match(seekers, dead, self._rtt, self.match_cfg, self.rng)
        groups: set[tuple[int, ...]] = set()
        for s in seekers:
            outcome: Outcome = outcomes[s.peer]
            peer = self.peers[s.peer]
            stats.matchmaking_s.append(outcome.done - s.start)
            stats.planned_sizes.append(len(s.planned))
            stats.stores += outcome.stores
            stats.gets += outcome.gets
            stats.reasons[outcome.reason] += 1
            if outcome.group is not None:
                stats.averaged += 1
                groups.add(outcome.group)
            fresh = {p: t for p, t in outcome.gone.items() if p not in peer.gone}
            if fresh:  # it lists them in its record at once (Prober._tell_gone)
                peer.gone.update(fresh)
                self._publish(peer, max(fresh.values()))
            peer.lags.extend(lags.get(s.peer, []))
        stats.group_sizes = sorted(len(g) for g in groups)

    def _rtt(self, a: int, b: int) -> float:
        return true_rtt(self.peers[a].site, self.peers[b].site, (a, b))

    def prediction_error(self, t: float, pairs: int = 2000) -> float:
        """Median relative error of the RTTs the published coordinates predict (sampled pairs)."""
        rows = [(i, v.coordinate) for i, v in self._listing(t) if not v.left and v.coordinate]
        rng = random.Random(0)
        errors = []
        for _ in range(min(pairs, len(rows) ** 2) if len(rows) > 1 else 0):
            (a, ca), (b, cb) = rng.sample(rows, 2)
            rtt = self._rtt(a, b)
            errors.append(abs(predict_rtt(ca, cb) - rtt) / rtt)
        return float(np.median(errors)) if errors else math.nan
