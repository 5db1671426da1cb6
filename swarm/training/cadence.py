"""How many local steps between two rounds: fixed, or fitted to the link (``inner_steps="auto"``).

A round costs a peer the time it takes on its link. Overlapped (``overlap``, the default in
``diloco``) it runs behind the next inner steps, and costs no compute as long as those steps take
longer than the round; a blocking round costs all its time. ``inner_steps="auto"`` measures both
and picks the number of steps between rounds:

- overlapped: enough steps to cover ``HIDE_MARGIN`` times the round (the round hides, with room
  for a slower round);
- blocking: enough that the round costs at most ``1 - BLOCKING_UTILIZATION`` of the wall time.

Step time is the wall time of a step less what it waited on the swarm; both figures are
exponential moving averages, so one slow round or step moves the choice a little, a slower link
moves it all the way. The choice stays within ``[min_inner_steps, max_inner_steps]`` (DiLoCo's
outer optimizer is stable for tens to hundreds of inner steps; far more lets the peers drift
apart between rounds) and is a multiple of ``fragments``. It changes only when a round ends, and
peers with different choices still average together: rounds weigh peers by their samples.

``inner_steps="30s"`` (a duration) puts rounds on the wall clock instead: a round falls due at
the first step after every multiple of 30 s since the Unix epoch, the same instants for every
peer whatever its speed (clocks set by NTP agree far closer than a step). A peer four times
slower then arrives with a quarter of the steps, weighed by its samples, instead of making the
fast peers' groups wait for it (or leaving them without it) every round. With ``fragments`` F a
fragment's round falls due every ``30 / F`` s.
"""

from __future__ import annotations

import logging
import math
import sys
import time

logger = logging.getLogger(__name__)

READ_AHEAD_S = 3.0  # RoundLookout: the peer list is read this long before a round falls due
HIDE_MARGIN = 1.5  # overlapped: the inner steps cover this many round times
# an overlapped round counted in steps waits for its planned members until about this many of
# its peer's rounds have passed (past its next due by half a round, where the wait would stall
# training)
OVERLAP_PATIENCE = 1.5
BLOCKING_UTILIZATION = 0.95  # blocking: the round takes at most 5% of the wall time
STEP_EMA = 0.1  # weight of the latest step time
ROUND_EMA = 0.3  # weight of the latest round time
_JUDGED_AFTER = 3  # rounds timed before their length is held against the period


class Cadence:
    """Steps between rounds (``interval``): fixed, fitted to measured step and round times, or
    set by the wall clock (``period_s``: see the module docstring).

    Args:
        inner_steps: steps per whole-model round, or ``None`` to fit them (``"auto"``).
        fragments: rounds per ``inner_steps`` steps (Streaming DiLoCo); every choice divides.
        lowest, highest: the range ``inner_steps`` is fitted in.
        overlapped: rounds run behind the next steps (else they block the step).
        start: ``inner_steps`` before anything was measured.
        period_s: seconds between whole-model rounds on the wall clock (``inner_steps`` is then
            only reported: the steps the last round took).
    """

    def __init__(
        self,
        inner_steps: int | None,
        *,
        fragments: int = 1,
        lowest: int = 1,
        highest: int = 1,
        overlapped: bool = True,
        start: int = 1,
        period_s: float | None = None,
    ):
        self.period_s = period_s
        self.fixed = inner_steps is not None or period_s is not None
        self._next_due: float | None = None  # wall-clock time of the next round (period_s)
        self.fragments = fragments
        self.lowest, self.highest = lowest, highest
        self.overlapped = overlapped
        self.inner_steps = inner_steps if inner_steps is not None else self._fit(start)
        self.step_s: float | None = None  # moving average of a step's compute time
        self.round_s: float | None = None  # moving average of a round's time
        self._last: tuple[float, float] | None = None  # (wall, waited) at the last step
        self._warned_slow = False  # rounds outlast the period (said once until they fit again)
        self._rounds = 0  # rounds timed (a first round may include joining: not judged alone)
        self._planned = False  # a counted round planned its order (see plan_order)

    @property
    def interval(self) -> int:
        """Local steps between two rounds (on the wall clock: no number of steps)."""
        return sys.maxsize if self.period_s is not None else self.round_steps

    @property
    def round_steps(self) -> int:
        """Local steps per round: the interval, or on the wall clock those the last round took."""
        return self.inner_steps // self.fragments

    def due(self, steps_in_round: int, now: float | None = None) -> bool:
        """Whether the step just taken (the ``steps_in_round``-th of this round) ends a round."""
        if self.period_s is None:
            return steps_in_round >= self.interval
        now = time.time() if now is None else now
        slot = self.period_s / self.fragments
        # the first round: the next boundary, not this one; and after the clock was set back
        # (an NTP step), the next boundary from the new time rather than the old one
        next_instant = (math.floor(now / slot) + 1) * slot
        if self._next_due is None or self._next_due - now > slot:
            self._next_due = next_instant
        if steps_in_round < 1 or now < self._next_due:
            return False
        self._next_due = next_instant
        self.inner_steps = steps_in_round * self.fragments
        return True

    def clock_order(self, now: float | None = None) -> int | None:
        """On the wall clock, the round's place among the shared instants: the index of the
        last one passed (None: rounds counted in steps). Peers that start a round after the same
        instant plan the same groups with it, whatever rounds each ran, missed or ran late
        before: counted rounds fell apart (a round in flight across an instant starts the next
        one late, and one count then lags), and peers one round apart plan other groups."""
        if self.period_s is None:
            return None
        now = time.time() if now is None else now
        return math.floor(now / (self.period_s / self.fragments))

    def plan_order(self, counted: int, clock: int | None) -> int | None:
        """The round order a round plans with: on the clock its instant's (``clock``);
        counted, ``counted`` (the peer's round count) in its first round only, so that a peer
        resumed from its own checkpoint starts near the swarm, and after that None: its groups
        keep it in step (GroupPlanner.settle), and a count that ran ahead of the others' (a
        peer whose rounds failed faster) must not hold it apart from them."""
        if clock is not None:
            return clock
        first, self._planned = not self._planned, True
        return counted if first else None

    def seconds_to_due(self, steps_in_round: int, now: float | None = None) -> float | None:
        """About how long until the next round falls due (None: not known yet): the clock's
        next boundary, or the steps left at the measured step time."""
        if self.period_s is not None:
            if self._next_due is None:
                return None
            return self._next_due - (time.time() if now is None else now)
        if self.step_s is None:
            return None
        return max(0, self.interval - steps_in_round) * self.step_s

    def member_patience(self) -> float | None:
        """How long a round that just started may wait for its planned members (None: the
        averager's default). Counted in steps, until about the peer's next round is half a
        round overdue: two peers of equal speed settle about one round apart. Not on the wall
        clock: every member's round falls due at once, so a member that has not come is not
        coming, and a longer wait would start this peer's next round late."""
        if self.period_s is not None:
            return None
        to_due = self.seconds_to_due(0)
        return OVERLAP_PATIENCE * to_due if to_due else None

    def step(self, waited_total: float, now: float | None = None) -> None:
        """Note a step; ``waited_total`` is every second the peer has waited on the swarm."""
        now = time.perf_counter() if now is None else now
        if self._last is not None:
            wall, waited = self._last
            seconds = (now - wall) - (waited_total - waited)
            if seconds > 0:
                self.step_s = _ema(self.step_s, seconds, STEP_EMA)
        self._last = (now, waited_total)

    def round_ended(self, seconds: float) -> int:
        """Note a round's time and, when fitting, choose the steps until the next ones."""
        if seconds > 0 and math.isfinite(seconds):
            self.round_s = _ema(self.round_s, seconds, ROUND_EMA)
            self._rounds += 1
            self._check_period()
        if not self.fixed and self.step_s and self.round_s:
            per_round = self.round_s / self.step_s  # steps one round takes
            if self.overlapped:
                steps = HIDE_MARGIN * per_round * self.fragments
            else:
                share = BLOCKING_UTILIZATION / (1 - BLOCKING_UTILIZATION)
                steps = share * per_round * self.fragments
            self.inner_steps = self._fit(math.ceil(steps))
        return self.inner_steps

    def _check_period(self) -> None:
        """Warn once when rounds take longer than their period: blocking, a round then leaves
        a step or two before the next one is due; overlapped, each starts when the last lands
        (training does not wait, but rounds come less often than asked)."""
        if self.period_s is None or self.round_s is None or self._rounds < _JUDGED_AFTER:
            return
        slot = self.period_s / self.fragments
        if self.round_s <= slot:
            self._warned_slow = False
        elif not self._warned_slow:
            self._warned_slow = True
            logger.warning(
                "rounds take %.1f s, longer than their period (inner_steps=%gs%s): %s; "
                "choose a longer period, or inner_steps='auto'",
                self.round_s,
                self.period_s,
                f" / {self.fragments} fragments" if self.fragments > 1 else "",
                "each round starts late, when the one before lands"
                if self.overlapped
                else "few steps are left between rounds",
            )

    def _fit(self, steps: int) -> int:
        steps = min(max(steps, self.lowest), self.highest)
        return max(self.fragments, steps - steps % self.fragments)


class RoundLookout:
    """Says once per round when it falls due within :data:`READ_AHEAD_S`: the peer list is then
    read ahead of the round, so that planning the round waits for no DHT read (at 64 peers
    the read took 0.3-1.3 s, and a group's members arrive as their reads end)."""

    def __init__(self) -> None:
        self._due_at: float | None = None  # the round last said

    def due_soon(self, seconds_to_due: float | None, now: float | None = None) -> bool:
        if seconds_to_due is None or seconds_to_due > READ_AHEAD_S:
            return False
        due_at = (time.time() if now is None else now) + seconds_to_due
        if self._due_at is not None and abs(due_at - self._due_at) < READ_AHEAD_S:
            return False  # (this round's, said already)
        self._due_at = due_at
        return True


def _ema(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new
