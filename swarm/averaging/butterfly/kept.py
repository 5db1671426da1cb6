"""The ranges where this member's values lately parted from its groups' for an honest reason.

A part that fails for a member (its owner failed, its stream broke, the member refused the
average) keeps that member's own values of the part, while the members that got the average
apply it. From then on the member's values in that range differ from the others' by however far
its own values lay from the average there, and in a round that averages raw values (model
weights, DiLoCo anchors) every honest average of that range lies that far from them. Under
outer momentum, which is never averaged, the difference goes on growing for rounds after. The
owner check (:mod:`swarm.averaging.butterfly.checks`) judges an owner by how far its average lies
from the member's own values, against the other parts: in those ranges it would accuse honest
owners. It did, at 10 Mbit/s (4 peers, int8): after a round where each member had one part
fail, the next anchor sync returned averages 0.10-0.39 from the own values in those ranges,
against medians of 0.005-0.05 elsewhere, and every accuser was a member that had kept its own
values there.

So a member remembers, per vector layout, the ranges it kept during its last
:data:`KEPT_ROUNDS` rounds of that layout, and in rounds of values the check holds the averages
of those ranges only to the blatant bound (no farther from the own values than their size, or
the whole part's over as many values where that is larger: huge, flipped or unrelated values),
and the rest of each part to the usual rule. A round where every part kept its own values
(nothing averaged) moves the member's values away everywhere, which the usual rule, relative to
the other parts, mostly allows: it is not recorded (it would loosen every part).

What it costs: an owner of such a range may shift the average there by less than the values'
own size (or the whole part's over as many values, where larger) without being accused, in
the rounds of the members that kept it. An owner that makes its own part fail on purpose
(every member then keeps that range) earns that slack in the following rounds of values for
the range it owned; the members that averaged a range still judge it by the usual rule. An
owner the member accused before gets no slack: a liar refused once (the member then keeps its
own values of that part) cannot lie there again under the looser bound.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

KEPT_ROUNDS = 24  # outer momentum 0.9 carries a difference on for about this long (0.9^24 = 0.08)
MAX_LAYOUTS = 16  # layouts remembered (one per fragment, plus one-off rounds), oldest dropped

Range = tuple[int, int]
Layout = tuple[str, int]  # (fragment, numel): vectors laid out alike


class KeptRanges:
    """Per layout, the ranges this member kept its own values of in its recent rounds."""

    def __init__(self, rounds: int = KEPT_ROUNDS):
        self.rounds = rounds
        self._clock: dict[Layout, int] = {}
        self._kept: OrderedDict[Layout, deque[tuple[int, tuple[Range, ...]]]] = OrderedDict()

    def recent(self, layout: Layout) -> tuple[Range, ...]:
        """The ranges kept in the last :attr:`rounds` rounds of ``layout``, merged and sorted."""
        entries = self._kept.get(layout)
        if not entries:
            return ()
        return merge(r for _, ranges in entries for r in ranges)

    def record(self, layout: Layout, kept: Iterable[Range], averaged: bool) -> None:
        """One more round of ``layout``: ``kept`` are the ranges it kept own values of, noted
        when some other part was ``averaged``."""
        now = self._clock.get(layout, 0) + 1
        self._clock[layout] = now
        entries = self._kept.setdefault(layout, deque())
        self._kept.move_to_end(layout)
        while entries and entries[0][0] <= now - self.rounds:
            entries.popleft()
        ranges = merge(kept) if averaged else ()
        if ranges:
            entries.append((now, ranges))
        while len(self._kept) > MAX_LAYOUTS:
            gone, _ = self._kept.popitem(last=False)
            self._clock.pop(gone, None)


def merge(ranges: Iterable[Range]) -> tuple[Range, ...]:
    """Sorted, non-empty, non-overlapping ranges covering the same elements."""
    out: list[list[int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return tuple((s, e) for s, e in out)


def split(start: int, end: int, kept: tuple[Range, ...]) -> tuple[list[Range], list[Range]]:
    """``[start, end)`` as the pieces outside and inside the merged ``kept`` ranges."""
    outside: list[Range] = []
    inside: list[Range] = []
    at = start
    for s, e in kept:
        if e <= at:
            continue
        if s >= end:
            break
        if s > at:
            outside.append((at, s))
        inside.append((max(s, at), min(e, end)))
        at = min(e, end)
    if at < end:
        outside.append((at, end))
    return outside, inside
