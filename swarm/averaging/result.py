"""What one averaging round reports."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from swarm.identity import PeerID
from swarm.monitor.tracker import RoundFigures


class RefusalAction(str, enum.Enum):
    """What this peer did to another's contribution or answer (a ``str`` enum: it compares
    equal to its text, as logs and reports print it)."""

    CLIPPED = "clipped"  # CenteredClip scaled its offset down
    WEIGHT_CAPPED = "weight-capped"  # its claimed weight was over the cap
    BANDWIDTH_CAPPED = "bandwidth-capped"  # its claimed bandwidth was over what was measured
    DROPPED = "dropped"  # it stalled or vanished mid-round
    REFUSED = "refused"  # what it sent was malformed or out of bounds
    ACCUSED = "accused"  # as an owner, it returned an implausible average
    EXCLUDED = "excluded"  # left out of this round for an earlier accusation
    DOWNWEIGHTED = "down-weighted"  # its updates keep pointing away from the group's

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Refusal:
    """A peer whose contribution or answer this peer did not take as it came, and why."""

    peer: PeerID  # who
    action: RefusalAction  # what was done
    part: int  # the part concerned (-1: the whole round)
    why: str  # human-readable detail

    def __str__(self) -> str:
        where = f" in part {self.part}" if self.part >= 0 else ""
        return f"{self.peer.short} {self.action}{where}: {self.why}"


@dataclass(frozen=True)
class RoundResult:
    """Outcome of :meth:`Averager.average`. A failed round is a result, never an exception.

    ``parts`` tells exactly what was applied: part ``j`` (a range of the flat vector, owned by
    ``members[j]``) was replaced by the weighted mean over the listed peers. A part missing from
    ``parts`` kept this peer's own values (its owner failed, or too few contributions survived).
    """

    averaged: bool  # at least one part was averaged with another peer
    reason: str = ""  # why not averaged, or what went wrong in part ("" when all went well)
    group_id: bytes = b""  # the group's id (empty when no group formed)
    members: tuple[PeerID, ...] = ()  # the agreed, ordered member list (this peer included)
    parts: dict[int, tuple[PeerID, ...]] = field(default_factory=dict)  # part -> averaged over
    bytes_sent: int = 0  # payload bytes this peer streamed (both phases)
    bytes_received: int = 0  # payload bytes this peer received (both phases)
    matchmaking_s: float = 0.0  # time to form (or fail to form) the group
    allreduce_s: float = 0.0  # time of the all-reduce itself
    refusals: tuple[Refusal, ...] = ()  # peers clipped, capped, dropped, refused or accused
    synced: bool = False  # the group also averaged the synced tensors (part of them at least)
    # an update round: this peer's record (weight factor) of each member it scored so far
    trust: dict[PeerID, float] = field(default_factory=dict)
    # an update round under a lossy codec: what this peer's payloads left out of its values
    # (the error-feedback residual, flat, bfloat16), which its next round sends, unless the
    # caller keeps it in its own values (``keep_unsent``: the training engine, in ``diloco``)
    unsent: torch.Tensor | None = field(default=None, repr=False, compare=False)
    orders: tuple[int, ...] = ()  # the round orders the other members claimed in their streams

    @property
    def group_size(self) -> int:
        return len(self.members)

    def figures(self, seconds: float) -> RoundFigures:
        """What the peer's monitor counts of this round, which took ``seconds`` in all."""
        return RoundFigures(
            averaged=self.averaged,
            reason=self.reason,
            group=self.group_id[:4].hex(),
            group_size=len(self.members),
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            seconds=seconds,
            matchmaking_s=self.matchmaking_s,
            allreduce_s=self.allreduce_s,
        )

    def __str__(self) -> str:
        if not self.averaged:
            return f"not averaged ({self.reason}) after {self.matchmaking_s:.2f} s"
        ok = sum(1 for p in self.parts.values() if len(p) > 1)
        return (
            f"averaged {ok} parts in a group of {len(self.members)}, "
            f"matchmaking {self.matchmaking_s:.2f} s, all-reduce {self.allreduce_s:.2f} s"
            + (f" ({self.reason})" if self.reason else "")
        )
