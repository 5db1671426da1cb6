"""What every side of one member's all-reduce shares: the group, its place in it, its tools."""

from __future__ import annotations

from dataclasses import dataclass, field

from swarm.averaging.faults import FaultInjector
from swarm.averaging.feedback import FlatFeedback
from swarm.averaging.group import GroupInfo
from swarm.averaging.stall import StallPolicy
from swarm.averaging.workers import Workers


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
    # members whose address refused our connection this round: gone, so the owner side stops
    # waiting for their part at once (a killed peer costs no stall limit)
    gone: set[int] = field(default_factory=set)
