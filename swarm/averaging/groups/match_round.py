"""One matchmaking round's state (sans-I/O): what the matchmaker and the join RPC share."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from swarm.averaging.groups.group import GroupInfo
from swarm.identity import PeerID
from swarm.net.record import PeerRecord

CLOSE_MARGIN_S = 0.3  # a leader closes this long before the earliest member deadline


@dataclass(frozen=True)
class Follower:
    """What a follower told the leader when it joined."""

    record: PeerRecord
    deadline: float  # wall clock
    state: bytes = b""  # digest of the values it would sync (empty: none)


@dataclass
class MatchRound:
    """One matchmaking round of this peer: its key, deadline, plan, role and followers."""

    key: str
    deadline: float  # wall clock
    started: float  # wall clock
    expected: int = 0  # members the caller planned for (0: unknown)
    patient_until: float = 0.0  # wall clock: until then a leader waits for ``expected`` members
    planned_leader: PeerRecord | None = None
    planned: tuple[PeerRecord, ...] = ()  # the other planned members (their records)
    state: bytes = b""  # digest of the values this peer would sync; see GroupInfo.agreed
    role: str = "candidate"  # candidate | leader | joining | closed
    declared: int = 0  # declarations stored this round (each one expires a little later)
    followers: dict[PeerID, Follower] = field(default_factory=dict)
    checked: set[PeerID] = field(default_factory=set)  # planned members checked for life
    arrived: set[PeerID] = field(default_factory=set)  # planned members whose lag was noted
    closed: asyncio.Future[GroupInfo | None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def close_by(self) -> float:
        return min([self.deadline] + [f.deadline for f in self.followers.values()]) - CLOSE_MARGIN_S
