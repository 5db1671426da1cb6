"""Scores of update contributions and the record each peer keeps of the others (sans-I/O).

CenteredClip bounds what one contribution does in *one* round, but an attacker that stays inside
the clip radius (a small inverse of its update, ALIE, a zero update claiming full samples, a
stale one) is averaged in every round, and its bias adds up. What gives such an update away is
its direction: an honest pseudo-gradient points roughly where the group's robust mean points, the
attacks above do not. So, in rounds that average *updates* (pseudo-gradients, not parameters):

- the owner of a part measures, over its whole part, each member's **alignment**: the cosine of
  its contribution with the part's robust mean (:class:`AlignmentSums`, from the same pass as the
  clip). The owner's own alignment is measured too, for the group's median;
- a member's **round score** is its alignment relative to the group's median alignment
  (:func:`round_score`): 1.0 at or above half the median, falling linearly to 0 at an alignment
  of 0 or below. Half the median is lenient on purpose: honest peers with unusual data (non-IID
  shards) align less than the others but still point the same way; a zero update (a free rider),
  an inverted one and a stale one do not;
- within the round already, each chunk is reduced again with every weight times its score in
  that chunk (:func:`chunk_factors`) when one scored below 1: an attacker's first round costs as
  little as its later ones;
- each peer keeps a **record** of the others (:class:`Reputation`): an exponential mean of their
  round scores as *it* measured them (nobody else's word counts, so colluders cannot talk an
  honest peer's record down), starting at :data:`NEW_TRUST` for a peer it has not scored yet.
  The weight an owner gives a sender is its claimed weight times its record, so an attacker's
  weight falls round after round (below half after two rounds scored 0).

No verdict is final: a record recovers by the same rule as it falls. A newcomer starts trusted:
a start below the owner's own weight would tilt every part of a young swarm toward its owner.
The cost is that a fresh identity (free to make) is trusted for its first rounds, as long as it
takes each peer to score it two or three times.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from swarm.identity import PeerID

NEW_TRUST = 1.0  # the record of a peer not scored yet
TRUST_RATE = 0.3  # weight of one round's score in the record (about 3 rounds to move it)
TRUST_FLOOR = 0.02  # no record falls below this: a score is evidence, not a ban
HALF_MEDIAN = 0.5  # a member aligned at or above this share of the median scores 1
MIN_MEDIAN_ALIGNMENT = 0.05  # below this the group's updates share no direction: no scores
LOWERED_BELOW = 0.5  # a record below this is reported with its reason each round


@dataclass
class AlignmentSums:
    """One contribution's running sums over a part's chunks: ``r . c``, ``|r|^2``."""

    dot: float = 0.0
    norm2: float = 0.0

    def add(self, dot: float, norm2: float) -> None:
        self.dot += dot
        self.norm2 += norm2

    def cosine(self, center_norm2: float) -> float:
        """Its cosine with the center (0 when either is zero)."""
        denom = math.sqrt(self.norm2 * center_norm2)
        return self.dot / denom if denom > 0 and math.isfinite(denom) else 0.0


class PartAlignment:
    """Alignments of one part's contributions, accumulated chunk by chunk (thread-safe: chunks
    reduce in parallel). Keys are member indices (the owner's own included)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums: dict[int, AlignmentSums] = {}
        self._center_norm2 = 0.0

    def add_chunk(
        self,
        members: list[int],
        dots: tuple[float, ...],
        norms2: tuple[float, ...],
        center_norm2: float,
    ) -> None:
        with self._lock:
            self._center_norm2 += center_norm2
            for m, d, n in zip(members, dots, norms2, strict=True):
                self._sums.setdefault(m, AlignmentSums()).add(d, n)

    def reset(self) -> None:
        with self._lock:
            self._sums.clear()
            self._center_norm2 = 0.0

    def cosines(self, members: set[int]) -> dict[int, float]:
        """The alignment of each of ``members`` (those that contributed every chunk)."""
        with self._lock:
            return {m: s.cosine(self._center_norm2) for m, s in self._sums.items() if m in members}


def round_score(alignment: float, median: float) -> float:
    """One member's score in one part: 1.0 at or above ``HALF_MEDIAN`` times the group's
    ``median`` alignment, linearly down to 0 at an alignment of 0 or below."""
    if not median > MIN_MEDIAN_ALIGNMENT:
        return 1.0
    return min(1.0, max(0.0, alignment / (HALF_MEDIAN * median)))


def chunk_factors(
    dots: tuple[float, ...], norms2: tuple[float, ...], center_norm2: float
) -> list[float]:
    """Per row of one clipped chunk, the factor on its weight for this chunk: its round score
    there (1.0 for every row when fewer than 3 or no common direction)."""
    sums = [AlignmentSums(d, n) for d, n in zip(dots, norms2, strict=True)]
    cosines = [s.cosine(center_norm2) for s in sums]
    if len(cosines) < 3:
        return [1.0] * len(cosines)
    median = statistics.median(cosines)
    return [round_score(c, median) for c in cosines]


def part_scores(alignments: Mapping[int, float], owner: int) -> dict[int, tuple[float, str]]:
    """Every sender's score in a part with the group's ``alignments`` (the owner's own
    included), each with why; empty when fewer than 3 aligned or no common direction."""
    if len(alignments) < 3:
        return {}
    median = statistics.median(alignments.values())
    if not median > MIN_MEDIAN_ALIGNMENT:
        return {}
    return {
        m: (round_score(a, median), f"alignment {a:.2f} against the group's median {median:.2f}")
        for m, a in alignments.items()
        if m != owner
    }


@dataclass(frozen=True)
class Standing:
    """This peer's record of another."""

    trust: float  # the weight factor its contributions get
    rounds: int  # rounds it was scored in
    why: str  # the last score's reason


class Reputation:
    """This peer's record of every peer whose updates it scored (in memory, per run)."""

    def __init__(self, limit: int = 4096):
        self._limit = limit
        self._records: dict[PeerID, Standing] = {}

    def trust(self, peer: PeerID) -> float:
        s = self._records.get(peer)
        return NEW_TRUST if s is None else s.trust

    def standing(self, peer: PeerID) -> Standing | None:
        return self._records.get(peer)

    def observe(self, peer: PeerID, score: float, why: str) -> Standing:
        """File one round's ``score`` (in [0, 1]) of ``peer``."""
        old = self._records.pop(peer, None)
        trust = NEW_TRUST if old is None else old.trust
        trust = max(TRUST_FLOOR, (1 - TRUST_RATE) * trust + TRUST_RATE * score)
        new = Standing(trust, (old.rounds if old else 0) + 1, why)
        self._records[peer] = new  # re-inserted: the dict's order is least recently scored first
        while len(self._records) > self._limit:
            self._records.pop(next(iter(self._records)))
        return new

    def snapshot(self) -> dict[PeerID, Standing]:
        return dict(self._records)
