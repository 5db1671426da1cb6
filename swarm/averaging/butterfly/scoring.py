"""Scores of update contributions and the record each peer keeps of the others (sans-I/O).

CenteredClip bounds what one contribution does in *one* round, but an attacker that stays inside
the clip radius (a small inverse of its update, ALIE, a zero update claiming full samples, a
stale one) is averaged in every round, and its bias adds up. What gives such an update away is
its direction: an honest pseudo-gradient points roughly where the group's robust mean points, the
attacks above do not. So, in rounds that average *updates* (pseudo-gradients, not parameters):

- the owner of a part measures, over its whole part, each member's **alignment**: the cosine of
  its contribution with the part's robust mean (:class:`AlignmentSums`, from the same pass as the
  clip), its own included;
- each peer keeps a **record** of the others (:class:`Reputation`): a running mean of their
  alignments as *it* measured them (nobody else's word counts, so colluders cannot talk an
  honest peer's record down), and the running mean and spread of its *own* alignments;
- the weight an owner gives a sender is its claimed weight times its **trust**
  (:func:`trust_of`): full while its record lies within 2 spreads below the owner's own mean,
  falling linearly to :data:`TRUST_FLOOR` at 4 spreads below.

Why a record: honest peers holding different data (non-IID shards) point away from the group's
mean in some parts (with 8 peers holding 2 of 10 classes each, a quarter of their parts), by
amounts that differ from scorer to scorer (the scorer's own data is part of the mean). Judged part
by part they look like attackers; their running mean stays within two spreads, while an update
turned around (IPM) or a zero one (a free rider) falls four spreads below within 3 to 7 scorings
where honest peers agree closely. Why the scorer's own alignment rather than the group's median:
two colluders in a group of four own its median and spread; the scorer's own alignment is honest
by its own account. A scorer judges nobody before :data:`WARMUP_PARTS` of its own parts showed it
how much they vary. With scoring the part layout turns with every group
(``PartPlan.create(first=...)``), so that a scorer's part covers every layer over time.

What such a rule cannot see is an attack that points where honest updates do (ALIE, a stale update,
an update shrunk inside the radius): that is bounded by the clip instead (and the oscillation that
late updates start, by the outer momentum's restart in :mod:`swarm.training.outer`), and measured in
the README. No verdict is final: a record recovers by the same rule as it falls. A newcomer starts
at the scorer's own mean (full weight): a lower start would tilt every part of a young swarm toward
its owner. The cost is that a fresh identity keeps its weight for 2 to 4 scorings.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from swarm.identity import PeerID

NEW_TRUST = 1.0  # the record of a peer not scored yet
TRUST_RATE = 0.15  # weight of one part's alignment in a record's running mean
REFERENCE_RATE = 0.1  # weight of one part in the running reference (the scorer's own)
TRUST_FLOOR = 0.02  # no record falls below this: a score is evidence, not a ban
TRUSTED_SPREADS = 2.0  # a record this many spreads below the scorer's keeps its full weight
FLOOR_SPREADS = 4.0  # a record this many spreads below falls to TRUST_FLOOR
MIN_SPREAD = 0.1  # never taken smaller: peers that agree closely are not judged on noise
WARMUP_PARTS = 4  # a scorer judges nobody before it has seen this many of its own parts vary
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


@dataclass(frozen=True)
class PartScores:
    """The alignments an owner measured in its part in one update round."""

    own: float  # the owner's own alignment
    alignments: dict[int, float]  # sender index -> its alignment (the owner left out)


def part_scores(alignments: Mapping[int, float], owner: int) -> PartScores | None:
    """The senders' alignments in a part with the group's ``alignments`` (the owner's own
    included); None when fewer than 3 aligned or the group shares no direction."""
    if len(alignments) < 3 or owner not in alignments:
        return None
    if not statistics.median(alignments.values()) > MIN_MEDIAN_ALIGNMENT:
        return None
    return PartScores(alignments[owner], {m: a for m, a in alignments.items() if m != owner})


@dataclass(frozen=True)
class Standing:
    """This peer's record of another."""

    trust: float  # the weight factor its contributions get
    alignment: float  # the running mean of its alignments
    rounds: int  # rounds it was scored in
    why: str  # the last score's reason


class Reputation:
    """This peer's record of every peer whose updates it scored (in memory, per run), and of
    its own alignments: the reference the others are judged against."""

    def __init__(self, limit: int = 4096):
        self._limit = limit
        self._records: dict[PeerID, Standing] = {}
        # its own alignments: how many, and running means of them and of their squares
        self._own_parts, self._own_sum, self._own_sum2 = 0, 0.0, 0.0

    def trust(self, peer: PeerID) -> float:
        s = self._records.get(peer)
        return NEW_TRUST if s is None else s.trust

    def standing(self, peer: PeerID) -> Standing | None:
        return self._records.get(peer)

    @property
    def reference(self) -> tuple[float, float] | None:
        """This peer's own alignment on average and how far one part's lies from it (at least
        ``MIN_SPREAD``); None before ``WARMUP_PARTS`` of its own parts were scored."""
        if self._own_parts < WARMUP_PARTS:
            return None
        mean, var = self._own_moments()
        return mean, max(MIN_SPREAD, math.sqrt(var))

    def _own_moments(self) -> tuple[float, float]:
        """Running mean and variance of its own alignments, corrected for their zero start."""
        done = 1 - (1 - REFERENCE_RATE) ** self._own_parts
        mean = self._own_sum / done
        return mean, max(0.0, self._own_sum2 / done - mean * mean)

    def observe(self, scores: PartScores, peers: Mapping[int, PeerID]) -> dict[int, Standing]:
        """File one part's alignments (sender index -> its peer in ``peers``); their new
        records."""
        r = REFERENCE_RATE
        self._own_parts += 1
        self._own_sum = (1 - r) * self._own_sum + r * scores.own
        self._own_sum2 = (1 - r) * self._own_sum2 + r * scores.own * scores.own
        reference = self.reference
        ref = reference[0] if reference else self._own_moments()[0]
        filed = {}
        for i, a in sorted(scores.alignments.items()):
            peer = peers[i]
            old = self._records.pop(peer, None)
            mean = ref if old is None else old.alignment  # a newcomer starts as an ordinary peer
            mean = (1 - TRUST_RATE) * mean + TRUST_RATE * a
            why = f"alignment {a:.2f}, {mean:.2f} on average; " + (
                f"own {ref:.2f} +- {reference[1]:.2f}" if reference else "scorer warming up"
            )
            trust = trust_of(mean, *reference) if reference else NEW_TRUST
            new = Standing(trust, mean, (old.rounds if old else 0) + 1, why)
            self._records[peer] = new  # re-inserted: the dict's order is least recently scored
            filed[i] = new
        while len(self._records) > self._limit:
            self._records.pop(next(iter(self._records)))
        return filed

    def snapshot(self) -> dict[PeerID, Standing]:
        return dict(self._records)

    def lowered(self, limit: int) -> tuple[tuple[str, float, str], ...]:
        """Up to ``limit`` peers held below :data:`LOWERED_BELOW`, lowest first: (short id,
        trust, why), for the peer's published progress."""
        if self.reference is None:
            return ()
        ref, spread = self.reference
        low = sorted((s.trust, p.short, s.alignment) for p, s in self._records.items())
        return tuple(
            (
                short,
                round(trust, 4),
                f"aligned {a:.2f} on average, own {ref:.2f} +- {spread:.2f}",
            )
            for trust, short, a in low[:limit]
            if trust < LOWERED_BELOW
        )


def trust_of(alignment: float, reference: float, spread: float) -> float:
    """The weight factor of a peer whose alignments average ``alignment`` where the scorer's own
    average ``reference``, +- ``spread`` from part to part: 1 within ``TRUSTED_SPREADS`` spreads
    below the reference, linearly down to ``TRUST_FLOOR`` at ``FLOOR_SPREADS``."""
    spreads = (reference - alignment) / max(spread, MIN_SPREAD)
    if spreads <= TRUSTED_SPREADS:
        return 1.0
    falls = (spreads - TRUSTED_SPREADS) / (FLOOR_SPREADS - TRUSTED_SPREADS)
    return max(TRUST_FLOOR, 1.0 - falls)
