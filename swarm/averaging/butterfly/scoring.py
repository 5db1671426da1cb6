"""Scores of update contributions and the record each peer keeps of the others (sans-I/O).

CenteredClip bounds what one contribution does in *one* round, but an attacker that stays inside
the clip radius (a small inverse of its update, ALIE, a zero update claiming full samples, a
stale one) is averaged in every round, and its bias adds up. What gives such an update away is
its direction: an honest pseudo-gradient points roughly where the group's robust mean points, the
attacks above do not. So, in rounds that average *updates* (pseudo-gradients, not parameters):

- the owner of a part measures, over its whole part, each member's **alignment**: the cosine of
  its contribution with the part's robust mean (:mod:`~swarm.averaging.butterfly.alignment`,
  from the same pass as the clip), its own included;
- and each member's **progress**: its contribution's projection on that mean, in units of the
  mean (``r . c / |c|^2``: 1 for a contribution that delivers as much as the mean, 0 for none),
  both as it is and per unit of the member's claimed weight (absurd claims capped);
- and each member's **balance**: the share of its values above the robust mean's minus the
  share below (noise sits on both sides, ALIE's mean minus standard deviations below
  everywhere), counted in the same pass;
- each peer keeps a **record** of the others (:class:`Reputation`): running means of their
  alignments, progress, balance and echoes as *it* measured them (nobody else's word counts, so
  colluders cannot talk an honest peer's record down), and the running means and spreads of
  its *own*;
- the weight an owner gives a sender is its claimed weight times its **trust**
  (:func:`trust_of`): full while its record lies within 2 spreads below the owner's own mean,
  falling linearly to :data:`TRUST_FLOOR` at 4 spreads below; the lowest of the alignment's
  trust, the progress's, where progress counts the better of its two forms (a slow peer
  delivers less but claims less; a peer with large batches claims more for the same steps),
  the balance's, judged on its distance from the owner's own on either side, and the echo's
  (:mod:`~swarm.averaging.butterfly.echoes`), judged on how far it lies above the owner's own.

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

Why progress: an update shrunk to sit inside the clip radius points where honest updates do
but delivers a fraction of what its weight claims: 0.04-0.72 of the mean (6 peers, one
attacker) where honest members deliver 0.83-1.38 (deciles; with unlike data -0.1 to 2.1, and
so do their scorers' own parts). ALIE and a stale update point where honest updates do and
deliver as much: ALIE is named by its balance, below; a stale one by its **echo**, how much
more than the scorer's own it matches an update the scorer applied rounds before
(:mod:`~swarm.averaging.butterfly.echoes`), the fourth measure a trust is the lowest of.

Why balance: ALIE sends the honest mean minus ``z`` standard deviations in every coordinate.
Its direction and size are an honest update's, but its offset from the mean lies below it
nearly everywhere: per part its balance read -0.84 to -0.40 (5th to 95th percentile; 2 of 8
colluding) where honest members read -0.13 to 0.45, the scorer's own as much (the colluders
pull the mean down, so honest rows sit above it). Without attackers honest members read within
0.05 of 0 (equal data) or -0.19 to 0.39 (8 peers holding 2 of 10 classes each, running means
-0.02 to 0.12); IPM, free riders, stale and shrunk updates read as honest ones.

Why the records widen the rule: with unlike data honest records lie far from the scorer's own
for reasons of data. So a spread is the larger of the scorer's own and how far the records it
holds at half weight or more lie from its mean (:func:`widened`): with equal data they lie close
and nothing changes, and one or two attackers among them cannot move their median.

Why progress's rule also narrows to them: late in a run one part's progress varies widely (the
scorer's own by 0.2-0.36 from part to part, 8 peers), while a record is a running mean of many
parts (honest records of progress lay within 0.3 of the scorer's mean). Judged on one part's
spread, updates shrunk to about a third (records at 0.1-0.3 against the scorer's 1.0-1.3) sat
2.5-3 spreads below it and, in the median view, ended a run of 2 of 8 near half weight.
So progress's spread narrows to the records' distance too, down to :data:`PROGRESS_NARROWEST`
of the scorer's own, never below :data:`MIN_SPREAD`. The records that narrow it are those that
widen it (scored 3 times, at half weight or more), whose median one or two attackers cannot move.

No verdict is final: a record recovers by the same rule as it falls. A newcomer starts at the
scorer's own means (full weight): a lower start would tilt every part of a young swarm toward its
owner. The cost is that a fresh identity keeps its weight for 2 to 4 scorings.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from swarm.averaging.butterfly.echoes import (
    ECHO_SPREAD,
    ECHO_WINDOW,
    excess,
    follow_echo,
    loudest,
)
from swarm.averaging.butterfly.robust import cap_weights
from swarm.identity import PeerID

NEW_TRUST = 1.0  # the record of a peer not scored yet
TRUST_RATE = 0.15  # weight of one part's alignment in a record's running mean
REFERENCE_RATE = 0.1  # weight of one part in the running reference (the scorer's own)
TRUST_FLOOR = 0.02  # no record falls below this: a score is evidence, not a ban
TRUSTED_SPREADS = 2.0  # a record this many spreads below the scorer's keeps its full weight
FLOOR_SPREADS = 4.0  # a record this many spreads below falls to TRUST_FLOOR
MIN_SPREAD = 0.1  # never taken smaller: peers that agree closely are not judged on noise
WARMUP_PARTS = 6  # a scorer judges nobody before it has seen this many of its own parts vary
MIN_MEDIAN_ALIGNMENT = 0.05  # below this the group's updates share no direction: no scores
# claims past this many times the group's lower median count as that much in progress per unit
# of weight: the clip's cap of 2 would make a peer with a quarter of the steps read 0.4
PROGRESS_WEIGHT_CAP = 8.0
LOWERED_BELOW = 0.5  # a record below this is reported with its reason each round
# balance's own spread, not the scorer's: that swings by twice this with an ALIE attacker in
# some of its groups, which hid it, and is 0.1 in calm runs, on which unlike data fell below half
BALANCE_SPREAD = 0.125
POPULATION_RECORDS = 64  # the most recently scored records widen the rule (:func:`widened`)
POPULATION_SCORINGS = 3  # ... those scored this often, at half weight or more
POPULATION_MIN = 3  # ... with at least this many of them
POPULATION_CAP = 3.0  # ... to at most this many times the scorer's own spread
# progress's rule also narrows to the records, down to this share of the scorer's own spread
PROGRESS_NARROWEST = 0.5
_NORMAL_MAD = 1.4826  # a normal distribution's spread per unit of its median absolute deviation


@dataclass(frozen=True)
class Progress:
    """What one contribution delivered along the part's robust mean, in units of the mean."""

    total: float  # its projection on the mean
    per_weight: float  # the same per unit of its claimed weight (1 where it delivers its share)


@dataclass(frozen=True)
class PartScores:
    """The alignments (and progress) an owner measured in its part in one update round."""

    own: float  # the owner's own alignment
    alignments: dict[int, float]  # sender index -> its alignment (the owner left out)
    own_progress: Progress | None = None
    progress: dict[int, Progress] = field(default_factory=dict)  # sender index -> its progress
    own_balance: float | None = None
    balance: dict[int, float] = field(default_factory=dict)  # sender index -> its balance
    # sender index -> its cosines with the updates this owner applied 1, 2, ... rounds before,
    # minus the owner's own (see butterfly.echoes)
    echoes: dict[int, tuple[float, ...]] = field(default_factory=dict)


def part_scores(
    alignments: Mapping[int, float],
    owner: int,
    progress: Mapping[int, float] | None = None,
    weights: Mapping[int, float] | None = None,
    balance: Mapping[int, float] | None = None,
    echoes: Mapping[int, Sequence[float]] | None = None,
) -> PartScores | None:
    """The senders' alignments in a part with the group's ``alignments`` (the owner's own
    included), their progress where ``progress`` and the claimed ``weights`` of the same
    members are given, their ``balance`` and their ``echoes`` (over the owner's own) where
    given; None when fewer than 3 aligned or the group shares no direction."""
    if len(alignments) < 3 or owner not in alignments:
        return None
    if not statistics.median(alignments.values()) > MIN_MEDIAN_ALIGNMENT:
        return None
    members = set(alignments)
    others = {m: a for m, a in alignments.items() if m != owner}
    own_balance, balances = None, {}
    if balance is not None and members <= set(balance):
        own_balance = balance[owner]
        balances = {m: balance[m] for m in others}
    echoed = {}
    if echoes is not None and members <= set(echoes):
        echoed = {m: excess(echoes[m], echoes[owner]) for m in others}
    own, delivered = None, {}
    if progress is not None and weights is not None and members <= set(progress) & set(weights):
        delivered = _progress(progress, weights, list(alignments))
        own = delivered.pop(owner)
    return PartScores(alignments[owner], others, own, delivered, own_balance, balances, echoed)


def _progress(
    progress: Mapping[int, float], weights: Mapping[int, float], members: list[int]
) -> dict[int, Progress]:
    """Each member's progress, also per unit of its claimed weight (capped at
    :data:`PROGRESS_WEIGHT_CAP` times the lower median), scaled so that members that deliver in
    proportion to their weights all read 1: the weighted mean of ``progress`` is about 1, so a
    member's share is ``w_i / sum(w^2) * sum(w)``."""
    claims = [weights[m] for m in members]
    capped = dict(zip(members, cap_weights(claims, PROGRESS_WEIGHT_CAP), strict=True))
    total, squares = sum(capped.values()), sum(w * w for w in capped.values())
    unit = squares / total if total > 0 else 0.0
    return {
        m: Progress(progress[m], progress[m] * unit / capped[m] if capped[m] > 0 else progress[m])
        for m in members
    }


@dataclass(frozen=True)
class Standing:
    """This peer's record of another."""

    trust: float  # the weight factor its contributions get
    alignment: float  # the running mean of its alignments
    rounds: int  # rounds it was scored in
    why: str  # the last score's reason
    progress: Progress | None = None  # the running means of its progress (once measured)
    low: str = ""  # what its trust was judged on (the lowest measure), against the scorer's
    balance: float | None = None  # the running mean of its balance (once measured)
    echo: tuple[float, ...] | None = None  # per lag, the running mean of its echo's excess


class _Moments:
    """A running mean and spread of one measure of this peer's own parts (corrected for their
    zero start)."""

    def __init__(self) -> None:
        self.parts, self._sum, self._sum2 = 0, 0.0, 0.0

    def add(self, x: float) -> None:
        r = REFERENCE_RATE
        self.parts += 1
        self._sum = (1 - r) * self._sum + r * x
        self._sum2 = (1 - r) * self._sum2 + r * x * x

    def mean(self) -> float:
        return self._sum / (1 - (1 - REFERENCE_RATE) ** self.parts) if self.parts else 0.0

    def reference(self) -> tuple[float, float] | None:
        """Mean and spread (at least ``MIN_SPREAD``); None before ``WARMUP_PARTS``."""
        if self.parts < WARMUP_PARTS:
            return None
        mean, mean2 = self.mean(), self._sum2 / (1 - (1 - REFERENCE_RATE) ** self.parts)
        return mean, max(MIN_SPREAD, math.sqrt(max(0.0, mean2 - mean * mean)))


def _follow(old: float, new: float) -> float:
    return (1 - TRUST_RATE) * old + TRUST_RATE * new


class Reputation:
    """This peer's record of every peer whose updates it scored (in memory, per run), and of
    its own alignments and progress: the reference the others are judged against."""

    def __init__(self, limit: int = 4096):
        self._limit = limit
        self._records: dict[PeerID, Standing] = {}
        self._own = _Moments()  # its own alignments
        self._own_total, self._own_per_weight = _Moments(), _Moments()  # its own progress
        self._own_balance = _Moments()

    def trust(self, peer: PeerID) -> float:
        s = self._records.get(peer)
        return NEW_TRUST if s is None else s.trust

    def standing(self, peer: PeerID) -> Standing | None:
        return self._records.get(peer)

    @property
    def reference(self) -> tuple[float, float] | None:
        """This peer's own alignment on average and how far one part's lies from it (at least
        ``MIN_SPREAD``); None before ``WARMUP_PARTS`` of its own parts were scored."""
        return self._own.reference()

    def observe(self, scores: PartScores, peers: Mapping[int, PeerID]) -> dict[int, Standing]:
        """File one part's alignments and progress (sender index -> its peer in ``peers``);
        their new records."""
        self._own.add(scores.own)
        if scores.own_progress is not None:
            self._own_total.add(scores.own_progress.total)
            self._own_per_weight.add(scores.own_progress.per_weight)
        if scores.own_balance is not None:
            self._own_balance.add(scores.own_balance)
        population = self._population()
        reference = widened(self.reference, [s.alignment for s in population])
        ref = reference[0] if reference else self._own.mean()
        progress_of = [s.progress for s in population if s.progress is not None]
        total = widened(
            self._own_total.reference(), [p.total for p in progress_of], PROGRESS_NARROWEST
        )
        per_weight = widened(
            self._own_per_weight.reference(),
            [p.per_weight for p in progress_of],
            PROGRESS_NARROWEST,
        )
        own_balance = self._own_balance.reference()
        balance_ref = widened(
            own_balance and (own_balance[0], BALANCE_SPREAD),
            [s.balance for s in population if s.balance is not None],
        )
        louds = [loudest(s.echo) for s in population]
        echo_ref = widened((0.0, ECHO_SPREAD), [loud[1] for loud in louds if loud])
        filed = {}
        for i, a in sorted(scores.alignments.items()):
            peer = peers[i]
            old = self._records.pop(peer, None)
            mean = _follow(ref if old is None else old.alignment, a)  # a newcomer: ordinary
            progress = self._progress(old, scores.progress.get(i))
            balance = self._balance(old, scores.balance.get(i))
            echo = old.echo if old else None
            if i in scores.echoes:
                echo = follow_echo(echo, scores.echoes[i])
            why = f"alignment {a:.2f}, {mean:.2f} on average; " + (
                f"own {ref:.2f} +- {reference[1]:.2f}" if reference else "scorer warming up"
            )
            trust, low = NEW_TRUST, ""
            if reference:
                trust = trust_of(mean, *reference)
                low = f"aligned {mean:.2f} on average, own {ref:.2f} +- {reference[1]:.2f}"
                delivered, low_progress = self._trust_in_progress(progress, total, per_weight)
                if delivered < trust:
                    trust, low = delivered, low_progress
                balanced, low_balance = self._trust_in_balance(balance, balance_ref)
                if balanced < trust:
                    trust, low = balanced, low_balance
                fresh, low_echo = _trust_in_echo(echo, echo_ref)
                if fresh < trust:
                    trust, low = fresh, low_echo
            rounds = (old.rounds if old else 0) + 1
            new = Standing(trust, mean, rounds, why, progress, low, balance, echo)
            self._records[peer] = new  # re-inserted: the dict's order is least recently scored
            filed[i] = new
        while len(self._records) > self._limit:
            self._records.pop(next(iter(self._records)))
        return filed

    def _progress(self, old: Standing | None, measured: Progress | None) -> Progress | None:
        """A record's running means of progress with one more part (a newcomer's start at the
        scorer's own means)."""
        before = old.progress if old else None
        if measured is None:
            return before
        if before is None:
            before = Progress(self._own_total.mean(), self._own_per_weight.mean())
        return Progress(
            _follow(before.total, measured.total), _follow(before.per_weight, measured.per_weight)
        )

    def _balance(self, old: Standing | None, measured: float | None) -> float | None:
        """A record's running mean of balance with one more part (a newcomer's start at the
        scorer's own mean)."""
        before = old.balance if old else None
        if measured is None:
            return before
        return _follow(self._own_balance.mean() if before is None else before, measured)

    def _trust_in_balance(
        self, balance: float | None, reference: tuple[float, float] | None
    ) -> tuple[float, str]:
        """The trust a record's balance earns against ``reference`` (the scorer's own mean and
        the spread it judges on): lowered as far from it on either side as alignment is below
        it (1.0 unmeasured)."""
        if balance is None or reference is None:
            return NEW_TRUST, ""
        ref, spread = reference
        trust = trust_of(ref - abs(balance - ref), ref, spread)
        return trust, f"offset skewed {balance:+.2f}, own {ref:+.2f}+-{spread:.2f}"

    def _trust_in_progress(
        self,
        progress: Progress | None,
        total: tuple[float, float] | None,
        per_weight: tuple[float, float] | None,
    ) -> tuple[float, str]:
        """The trust a record's progress earns against the references of its two forms: the
        better of the two (1.0 unmeasured)."""
        if progress is None or total is None or per_weight is None:
            return NEW_TRUST, ""
        trust = max(trust_of(progress.total, *total), trust_of(progress.per_weight, *per_weight))
        # short: published in the peer's record, whose reasons hold 64 characters
        return trust, (
            f"delivered {progress.total:.3g} ({progress.per_weight:.3g}/weight),"
            f" own {total[0]:.3g}+-{total[1]:.2g}"
        )

    def _population(self) -> list[Standing]:
        """The records that widen the rule: the most recently scored, each scored at least
        :data:`POPULATION_SCORINGS` times and held at half weight or more."""
        recent = itertools.islice(reversed(self._records.values()), POPULATION_RECORDS)
        return [s for s in recent if s.rounds >= POPULATION_SCORINGS and s.trust >= LOWERED_BELOW]

    def snapshot(self) -> dict[PeerID, Standing]:
        return dict(self._records)

    def lowered(self, limit: int) -> tuple[tuple[str, float, str], ...]:
        """Up to ``limit`` peers held below :data:`LOWERED_BELOW`, lowest first: (short id,
        trust, why), for the peer's published progress."""
        low = sorted((s.trust, p.short, s.low) for p, s in self._records.items())
        return tuple(
            (short, round(t, 4), why) for t, short, why in low[:limit] if t < LOWERED_BELOW
        )


def _trust_in_echo(
    echo: Sequence[float] | None, reference: tuple[float, float] | None
) -> tuple[float, str]:
    """The trust a record's echo earns: lowered as far as its loudest lags' running means lie
    above the scorer's own, on the spread of ``reference`` (see butterfly.echoes; 1.0
    unmeasured)."""
    loud = loudest(echo)
    if loud is None or reference is None:
        return NEW_TRUST, ""
    (lag, over), spread = loud, reference[1]
    return _falling(
        over / spread
    ), f"echoes updates {lag}-{lag + ECHO_WINDOW - 1} rounds old {over:+.2f}"


def widened(
    reference: tuple[float, float] | None, records: Sequence[float], narrowest: float = 1.0
) -> tuple[float, float] | None:
    """The mean and spread a record is judged on: the scorer's own ``reference``, its spread
    widened to the median distance of the finite ``records`` of others from its mean, as a normal
    spread, up to :data:`POPULATION_CAP` times, and narrowed to it down to the ``narrowest``
    share of the spread (never below :data:`MIN_SPREAD`, nor a spread already below it); as it
    is with fewer than :data:`POPULATION_MIN`."""
    if reference is None:
        return None
    mean, spread = reference
    distances = [abs(r - mean) for r in records if math.isfinite(r)]
    if len(distances) < POPULATION_MIN:
        return reference
    population = _NORMAL_MAD * statistics.median(distances)
    least = min(spread, max(MIN_SPREAD, narrowest * spread))
    return mean, min(POPULATION_CAP * spread, max(least, population))


def trust_of(alignment: float, reference: float, spread: float) -> float:
    """The weight factor of a peer whose alignments average ``alignment`` where the scorer's own
    average ``reference``, +- ``spread`` from part to part: 1 within ``TRUSTED_SPREADS`` spreads
    below the reference, linearly down to ``TRUST_FLOOR`` at ``FLOOR_SPREADS``."""
    return _falling((reference - alignment) / max(spread, MIN_SPREAD))


def _falling(spreads: float) -> float:
    """Trust at ``spreads`` spreads below the reference: 1 up to ``TRUSTED_SPREADS``, then
    linearly down to ``TRUST_FLOOR`` at ``FLOOR_SPREADS``."""
    if spreads <= TRUSTED_SPREADS:
        return 1.0
    falls = (spreads - TRUSTED_SPREADS) / (FLOOR_SPREADS - TRUSTED_SPREADS)
    return max(TRUST_FLOOR, 1.0 - falls)
