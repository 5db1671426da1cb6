"""What every side of one member's all-reduce shares: the group, its place in it, its tools."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from swarm.averaging.butterfly.echoes import EchoSample
from swarm.averaging.butterfly.residuals import FlatFeedback
from swarm.averaging.butterfly.stall import StallPolicy
from swarm.averaging.butterfly.workers import Workers
from swarm.averaging.faults import FaultInjector
from swarm.averaging.groups.group import GroupInfo, is_order
from swarm.averaging.groups.liveness import Liveness
from swarm.averaging.groups.rates import PeerRates

RECHECK_S = 1.0  # a member that keeps us waiting is checked for life again this often


@dataclass(frozen=True)
class RoundContext:
    """One member's view of one all-reduce."""

    group: GroupInfo  # the agreed group
    me: int  # this member's index in it
    weight: float  # this member's weight
    feedback: FlatFeedback  # this averager's error feedback
    workers: Workers  # the round's worker threads
    stall: StallPolicy  # when to give up on a silent peer
    deadline: float  # monotonic time by which the all-reduce ends
    faults: FaultInjector  # this averager's fault hooks (identity for an honest one)
    aggregator: str = "centered_clip"  # how an owner reduces its part: centered_clip or mean
    weight_cap: float = 2.0  # centered_clip: no weight above this times the median weight
    excluded: frozenset[int] = frozenset()  # members this peer accused: neither owner nor sender
    liveness: Liveness | None = None  # checks members that keep us waiting (None: never)
    rates: PeerRates | None = None  # where this member's owner side files senders' rates
    parent: bytes | None = None  # a repair's: the group id of the round it repairs
    updates: bool = False  # the round averages updates (pseudo-gradients), not values
    # an owner scores each contribution's alignment with the group's (updates only; see
    # swarm.averaging.butterfly.scoring)
    score: bool = False
    trust: Mapping[int, float] = field(default_factory=dict)  # member -> its weight factor
    echo: EchoSample | None = None  # scoring: the updates this peer applied lately
    # a round of values: the ranges of the flat vector this member kept its own values of in
    # its recent rounds, merged (see swarm.averaging.butterfly.kept)
    kept: tuple[tuple[int, int], ...] = ()
    # members this peer accused before (as far as it remembers): their parts get no leniency
    # in the kept ranges, so that a refused liar cannot lie there again under the looser bound
    accused: frozenset[int] = frozenset()
    # members whose address refused our connection this round, or that answered that the
    # group is not theirs (over there, or never started): gone, so the owner side stops
    # waiting for their part at once (a killed peer costs no stall limit)
    gone: set[int] = field(default_factory=set)
    suspected: dict[int, float] = field(default_factory=dict)  # member -> when last checked
    refused_us: set[int] = field(default_factory=set)  # owners that excluded this member (403)
    # a group of two averaging updates in a sparse codec: owners send back their own payloads
    # and the shares of the mean (see swarm.averaging.butterfly.pairs)
    pairwise: bool = False
    # the round order this member planned the round with, claimed in its part streams (None:
    # claims none), and the first well-formed claim each other member made in its streams to
    # or from this one: the next round follows the second largest (see GroupPlanner.settle)
    order: int | None = None
    orders: dict[int, int] = field(default_factory=dict)

    def heard_order(self, index: int, claim: object) -> None:
        """Member ``index`` claimed round order ``claim`` (ignored unless well formed)."""
        if index != self.me and is_order(claim):
            self.orders.setdefault(index, claim)  # type: ignore[arg-type]

    def mark_gone(self, index: int) -> None:
        """Member ``index``'s address refused our connection."""
        self.gone.add(index)
        if self.liveness is not None:
            self.liveness.refused(self.group.members[index].peer_id)

    def suspect(self, index: int, *, now: bool = False) -> None:
        """Check whether member ``index`` is still there, in the background (a refusal adds it
        to :attr:`gone`): at most once per ``RECHECK_S``, unless ``now`` (its stream broke)."""
        if self.liveness is None or index in self.gone:
            return
        clock = time.monotonic()
        if not now and clock - self.suspected.get(index, -math.inf) < RECHECK_S:
            return
        self.suspected[index] = clock
        check = self.liveness.check(self.group.members[index])
        check.add_done_callback(
            lambda f: self.gone.add(index) if not f.cancelled() and f.result() else None
        )
