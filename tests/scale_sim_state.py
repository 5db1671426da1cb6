"""The state of the scale simulation (tests/scale_sim.py): its settings, peers, records, figures."""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from scale_sim_net import Site

from swarm.averaging.groups.coordinates import Coordinate, Vivaldi
from swarm.averaging.groups.join_desk import LAG_HISTORY
from swarm.averaging.groups.placement import Placer
from swarm.averaging.groups.prober import PUBLISH_MOVE_S
from swarm.config import AveragingConfig
from swarm.dht.records import MAX_SUBKEYS_PER_KEY
from swarm.identity import PeerID
from swarm.peer_config import PeerConfig

REGION_RTT_S = AveragingConfig().region_rtt_s  # (the sim runs the default settings)


@dataclass(frozen=True)
class SimConfig:
    """What one simulation runs (defaults: the library's settings, issue 32's 10% churn)."""

    peers: int = 1024  # alive at any time: as many join as leave
    churn_per_min: float = 0.1  # share of the peers leaving (and joining) per minute
    minutes: float = 5.0  # measured, after the warm-up
    warmup_s: float = 600.0  # coordinates settle and churn mixes ages; no round before
    seed: int = 0
    round_s: float = 60.0  # a round is due this often
    start_spread_s: float = 2.0  # peers start a due round within this (unequal compute)
    startup_s: float = 10.0  # a joiner's first round comes at least this long after it joined
    graceful_share: float = 0.5  # departures that publish a leave marker (the rest are killed)
    read_cap: int | None = None  # records one read of the peer list returns (None: all)
    slot_cap: int = MAX_SUBKEYS_PER_KEY  # records the peer list's key holds
    # what-if, not the code's rule: plan from the records as they stood at the last multiple of
    # this many seconds (less a margin), the same for all peers of a round (None: own read)
    view_quantum_s: float | None = None
    # the planner's read starts READ_AHEAD_S before the round is due (RoundLookout), not when
    # the peer starts its round (False: the code before the read ahead)
    read_ahead: bool = True
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    peer: PeerConfig = field(default_factory=PeerConfig)

    @property
    def end(self) -> float:
        return self.warmup_s + 60.0 * self.minutes


@dataclass(frozen=True)
class Version:
    """One published version of a peer's record."""

    publish: float  # signed and stored at
    visible: float  # readable from
    coordinate: Coordinate | None  # None before its first RTT sample
    gone: tuple[int, ...] = ()  # peers it lists as gone
    left: bool = False  # a leave marker
    placed: dict[str, Any] = field(default_factory=dict)  # its placements (Placer.extra)


@dataclass
class SimPeer:
    idx: int
    pid: PeerID
    site: Site
    joined: float
    vivaldi: Vivaldi
    leave: float = math.inf  # when it leaves (drawn when it joins)
    graceful: bool = False
    first_stored: float | None = None  # its first store that a holder took (listing order)
    versions: list[Version] = field(default_factory=list)
    gone: dict[int, float] = field(default_factory=dict)  # peers found dead, and when
    checked: dict[int, float] = field(default_factory=dict)  # reported peers checked, and when
    lags: deque[float] = field(default_factory=lambda: deque(maxlen=LAG_HISTORY))
    samples: int = 0
    placer: Placer = field(default_factory=lambda: Placer(REGION_RTT_S, PUBLISH_MOVE_S))

    def latest(self, t: float, published: float = math.inf) -> Version | None:
        """The newest version readable at ``t`` (and published by ``published``)."""
        for v in reversed(self.versions):
            if v.visible <= t and v.publish <= published:
                return v
        return None


@dataclass
class RoundStats:
    """One round's figures (seekers: due peers with a key; idle: due peers without one)."""

    round: int
    due: int = 0
    averaged: int = 0
    idle: int = 0
    left_mid_round: int = 0
    group_sizes: list[int] = field(default_factory=list)  # closed groups
    planned_sizes: list[int] = field(default_factory=list)  # each seeker's planned group
    matchmaking_s: list[float] = field(default_factory=list)  # per seeker
    planner_s: list[float] = field(default_factory=list)  # per plan, CPU (real)
    view_sizes: list[int] = field(default_factory=list)
    stores: int = 0  # declaration stores, all seekers
    gets: int = 0  # matchmaking-key gets, all seekers
    reasons: Counter[str] = field(default_factory=Counter)
    keys: dict[str, str | None] = field(default_factory=dict)  # PeerID hex -> key
