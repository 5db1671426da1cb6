"""How the parts of one all-reduce end: the owner's verdict and what each side reports."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from swarm.averaging.butterfly.scoring import PartScores
from swarm.averaging.result import Refusal
from swarm.errors import AuthError, AveragingError, CompressionError, TransportError

MAX_ATTEMPTS = 2  # the first try, and one retry after a tainted part
FAILURES = (AuthError, TransportError, CompressionError, AveragingError)  # a peer failed


class PartOutcome(enum.Enum):
    """How one attempt at a part ended, as its owner tells the senders."""

    OK = "ok"  # averaged over the listed members: apply it
    RETRY = "retry"  # tainted by a dropped sender: send the part again
    FAILED = "failed"  # not averaged: keep your own values


@dataclass(frozen=True)
class OwnedPart:
    """What the owner's side of a round produced."""

    contributors: tuple[int, ...] | None  # member indices averaged (None: part not averaged)
    note: str  # what went wrong, or "" when nothing did
    refusals: tuple[Refusal, ...] = ()  # senders clipped, capped, dropped or refused
    scores: PartScores | None = None  # in an update round, see butterfly.scoring


@dataclass(frozen=True)
class SentPart:
    """What one sender got back for one part."""

    part: int  # the part's index (= its owner's index)
    contributors: tuple[int, ...] | None  # member indices averaged (None: keep own values)
    note: str  # what went wrong, or ""
    refusals: tuple[Refusal, ...] = ()  # the owner, when it stalled or was refused
