"""Is an owner's average plausible? (sans-I/O) A receiver's check on the parts it gets back.

An owner could return anything as "the average" of its part. Every member knows its own values
of every part, and the owners of the other parts are other peers, mostly honest: so a member
compares, part by part, how far the returned average lies from its own values, relative to the
size of its own values,

    r_j = ||avg_j - mine_j|| / ||mine_j||,

and refuses a part whose ``r_j`` exceeds ``factor`` times the median over all the parts it got
back (its own part included). An honest owner's robust mean lies about as far from each member's
values as the other honest owners' do; an owner that returns huge, flipped or unrelated values
does not. A part refused this way keeps the member's own values, and the owner is accused.

The median is taken over the parts that averaged this member's values with another member's
(their contributors say so): a part that came back as the member's own values (nothing else
was averaged into it, say because its other senders were excluded or late) lies from them by
no more than the codec's rounding and says nothing of the honest spread. When fewer than three
parts were averaged with others, a part is refused only when its average lies farther from the
own values than their own size (``r_j > 1``: flipped, huge or unrelated values), not for being
averaged at all. (Before, the own-value parts counted: after a round that lost streams, an
honest average 0.145 from the own values was refused against a median of 0.006, int8's
rounding, and its owner accused, at 10 Mbit/s in calm runs.)

A part is judged against the parts whose contributors include all of its own (itself among
them): a part that a far member's values went into, while the other parts were averaged without
them (the member's other sends were refused or late), lies farther from the own values for an
honest reason, and the parts without that member say nothing of how far. (Before, in loaded
8-peer runs where two members refused a third's streams, an honest member accused that third
member as an owner: 0.0364 from its values against a median of 0.00232.) A part with fewer than
three such parts gets the looser of the ``r_j > 1`` bound and the usual rule over all the
mixed parts: updates of one round barely align, so an honest average of them lies about as far
from a member's own update as its size, and ``r_j > 1`` alone accused honest owners at 1.01-1.06
(10 Mbit/s, 4 peers, a late member's values in one part only). In a round where every part had
every member, this is the median of all of them, whatever an owner claims (a subset of all).
Where members are missing from the other parts, an owner that claims them among its
contributors gets that looser bound: the claim is the owner's word, and only the checker's own
membership can be verified.

A member whose own values are the odd ones out (the robust mean of its own part clipped them)
does not judge: every honest average then lies as far from its values as they drifted in that
part, which differs from part to part (a part of biases near zero drifts further, relative to its
size, than a part of large weights), so its ``r_j`` would accuse honest owners. The members
close to the others still judge.

Whatever the rule, an average within ``NOISE_FLOOR`` (0.1%) of the own values is plausible. Members
that agree that closely (an anchor sync of a swarm in sync, repeated int8 rounds of the same
values) differ by rounding, which differs from part to part by several times: the median rule
accused an honest owner at 8e-5 against a median of 1e-5. One int8 pass rounds values by about
0.75%; a liar kept under the floor moves a part by at most 0.1% of its size per round.

In a round of values, the ranges where the member kept its own values in its recent rounds
(:mod:`swarm.averaging.butterfly.kept`) part from the others' for an honest reason: their
averages are held to the ``r > 1`` bound only (``lenient``), or to the usual rule's where that
is looser (rounds of updates, whose honest parts read about 1.6), and the rest of each part to
the rule above, measured against the size of the whole part's values (a slice left between kept
ranges may be a bias near 0, far from its own small values for no fault of its owner). A kept
range's ``r`` takes its own values' size as at least the whole part's over as many values: plans
cut the vector a little differently each round, so a range kept in one round may overlap the
next one's part by a single small value, whose honest average read 2.7-4.0 times its size away.

This is cheaper than BTARD's validators (no re-download, no recomputation: one pass over the
vector) and needs no agreement; what it cannot see is a lie smaller than ``factor`` times the
honest spread, whose damage is bounded by that same amount.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping

PLAUSIBLE_FACTOR = 4.0
_MIN_PARTS = 3  # the median of fewer parts says nothing
_EPS = 1e-6  # a median this small says the parts came back as the own values
#: averages closer than this to the own values (relative) are plausible whatever the other
#: parts say: members already that close differ by rounding, whose part-to-part ratio is noise
NOISE_FLOOR = 1e-3
UNAVERAGED_BOUND = 1.0  # the bound when most parts came back as own values (median 0)
NOT_FINITE = "average is not finite"  # refused whatever the other parts say


def not_finite(*deviations: Mapping[int, float]) -> dict[int, str]:
    """Parts whose average holds NaN or inf (deviation NaN by convention), each with why."""
    return {p: NOT_FINITE for devs in deviations for p, d in devs.items() if math.isnan(d)}


def implausible_parts(
    deviations: Mapping[int, float],
    factor: float = PLAUSIBLE_FACTOR,
    mixed: Collection[int] | None = None,
    contributors: Mapping[int, Collection[int]] | None = None,
    lenient: Mapping[int, float] | None = None,
) -> dict[int, str]:
    """Parts whose relative deviation is not plausible, each with why.

    Args:
        deviations: part -> ``r_j`` for every part averaged this round (own part included).
        factor: how many times the median deviation a part may reach.
        mixed: the parts averaged with another member's values, whose deviations make the
            median (default: every part).
        contributors: part -> the members whose values it averaged; a part is then judged
            against the mixed parts whose contributors include all of its own (default: every
            mixed part).
        lenient: part -> ``r`` over the ranges of it held to the ``r > 1`` bound (or the
            usual rule's, where looser) only: those the member kept its own values of lately;
            ``deviations`` then covers the rest of each part, and a part wholly in those ranges
            is missing from it.
    """
    lenient = lenient or {}
    verdicts = not_finite(deviations, lenient)
    judged = {p for devs in (deviations, lenient) for p, d in devs.items() if not math.isnan(d)}
    if len(judged) < _MIN_PARTS:
        return verdicts
    spread = {
        p: d for p, d in deviations.items() if not math.isnan(d) and (mixed is None or p in mixed)
    }
    overall = statistics.median(spread.values()) if len(spread) >= _MIN_PARTS else 0.0
    # never stricter than the usual rule: in rounds of updates honest parts read 1.6 from a
    # member's own update, and the r > 1 bound accused an honest owner of a kept range at 2.4
    kept_bound = max(UNAVERAGED_BOUND, factor * overall)
    for part, d in lenient.items():
        if part not in verdicts and d > kept_bound + _EPS:
            verdicts[part] = (
                f"average {d:.3g} from own values where this member kept them lately, "
                f"over {kept_bound:.3g}"
            )
    for part, d in deviations.items():
        if part in verdicts:
            continue
        reference = _reference(part, spread, contributors)
        # (inf when most own values are 0: no verdict)
        median = statistics.median(reference) if len(reference) >= _MIN_PARTS else 0.0
        if median > _EPS:
            bound, rule = factor * median, f"over {factor:g}x the median {median:.3g}"
        elif len(reference) < _MIN_PARTS and factor * overall > UNAVERAGED_BOUND:
            bound = factor * overall
            rule = f"over {factor:g}x the median {overall:.3g} of all parts (few comparable)"
        else:
            bound, rule = UNAVERAGED_BOUND, f"over {UNAVERAGED_BOUND:g} (too few comparable parts)"
        if d > max(bound, NOISE_FLOOR):
            verdicts[part] = f"average {d:.3g} from own values, {rule}"
    return verdicts


def _reference(
    part: int, spread: Mapping[int, float], contributors: Mapping[int, Collection[int]] | None
) -> list[float]:
    """The deviations ``part`` is judged against: the mixed parts whose contributors include
    all of its own."""
    if contributors is None or part not in contributors:
        return list(spread.values())
    mine = set(contributors[part])
    return [d for p, d in spread.items() if mine.issubset(contributors.get(p, ()))]
