"""Matchmaking of one round in the scale simulation (sans-I/O): who ends up in which group, when.

A model of :mod:`swarm.averaging.groups.matchmaking` (read it beside this), driven by each peer's
own plan: the peers that computed the same key meet, and only they (keys never mix).

- The planned leader ``L`` (the key names it) leads when it computed the key too. A member that
  starts while ``L`` has started, or within its gather window before ``L`` starts, joins ``L``
  directly (``_join_planned``: retries every 20 ms); one that started earlier looks for ``L``'s
  declaration in the DHT (``_candidates``, a get every poll interval) and joins once it is there.
- When ``L`` is absent (dead: its address refuses at once; alive but under another key or not
  averaging yet: the direct joins are refused until the gather window ends), the members fall
  back to the DHT: the smallest PeerID among them leads (``choose_leader``), the others join it
  once its declaration is readable. (Joining whichever smaller candidate is visible first and
  merging later, as the code does, ends in the same group; that detour is not timed.)
- A leader closes (``_match``'s leader branch) at the target size, once every planned member it
  does not know to be gone has joined (members it did not plan count too), after its patience
  with at least ``min_group_size``, or at the earliest member deadline. It learns that a planned
  member is dead from one ping after its gather window (``_check_missing``), and that a dead
  planned leader is gone from the refused join.
- A member that arrives after its leader closed is refused and gets no group: it would only find
  other late members, and (unlike the code) the model forms no group of those: conservative.
- A member that sees nobody else's declaration past its patience gives up ("no planned member
  came"); nobody waits past the matchmaking timeout.

DHT operations are counted per peer: declaration stores (one on start, one more per follower a
leader takes, one "busy" once grouped; an upper bound, as updates that come while the last store
is under way are merged into one) and gets of the key (polls).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from scale_sim_net import GET_MEDIAN_S, get_delay, store_delay

JOIN_RETRY_S = 0.02  # matchmaking._GATHER_POLL_S: between direct joins to a planned leader
CLOSE_MARGIN_S = 0.3  # match_round.CLOSE_MARGIN_S


@dataclass(frozen=True)
class MatchConfig:
    """The matchmaking settings (the averager's, see :class:`swarm.config.AveragingConfig`)."""

    min_group_size: int
    target_group_size: int
    gather_window: float
    timeout: float
    poll_interval: float = 0.25  # Matchmaker's default


@dataclass(frozen=True)
class Seeker:
    """One due peer looking for a group under the key its own plan gave it."""

    peer: int
    digest: bytes  # its PeerID's: the leader order
    start: float  # the round started (the plan's read began)
    declare: float  # form_group started: the plan is done
    key: str
    leader: int  # the planned leader (the key's first member)
    planned: tuple[int, ...]  # the planned members, this peer included
    patience: float  # seconds this peer waits for planned members (JoinDesk.patience)


@dataclass
class Outcome:
    """How one seeker's round ended."""

    group: tuple[int, ...] | None  # the members of its closed group, or None
    reason: str
    done: float  # simulated time its matchmaking ended
    stores: int = 0  # DHT stores of its declaration
    gets: int = 0  # DHT gets of the matchmaking key
    gone: dict[int, float] = field(default_factory=dict)  # peers it found dead, and when


Rtt = Callable[[int, int], float]


def match(
    seekers: list[Seeker],
    dead: Collection[int],
    rtt: Rtt,
    cfg: MatchConfig,
    rng: random.Random,
) -> tuple[dict[int, Outcome], dict[int, list[float]]]:
    """Every seeker's outcome, and the lags (seconds after its start) at which planned members
    joined each leader (its JoinDesk's history)."""
    by_key: dict[str, list[Seeker]] = {}
    for s in seekers:
        by_key.setdefault(s.key, []).append(s)
    outcomes: dict[int, Outcome] = {}
    lags: dict[int, list[float]] = {}
    for key in sorted(by_key):
        _KeyRound(by_key[key], dead, rtt, cfg, rng).run(outcomes, lags)
    return outcomes, lags


class _KeyRound:
    """The seekers of one key: the leader's close and every member's arrival."""

    def __init__(
        self,
        members: list[Seeker],
        dead: Collection[int],
        rtt: Rtt,
        cfg: MatchConfig,
        rng: random.Random,
    ):
        self.members = sorted(members, key=lambda s: s.digest)
        self.dead, self.rtt, self.cfg, self.rng = dead, rtt, cfg, rng
        planned_leader = self.members[0].leader
        present = {s.peer: s for s in self.members}
        self.planned_present = planned_leader in present
        self.lead = present.get(planned_leader, self.members[0])  # else: smallest present
        self.planned_leader = planned_leader
        self.visible = {s.peer: s.declare + store_delay(rng) for s in self.members}
        lead = self.lead
        if not self.planned_present and planned_leader in dead:  # its join was refused at once
            self.loop_start = lead.declare + rtt(lead.peer, planned_leader)
        else:  # after _await_planned, or after the direct joins were turned down
            self.loop_start = lead.declare + cfg.gather_window
        # the planned members the leader finds dead (_check_missing), and when
        self.lead_gone = {
            p: self.loop_start + rtt(lead.peer, p)
            for p in lead.planned
            if p != lead.peer and p in dead
        }

    def run(self, outcomes: dict[int, Outcome], lags: dict[int, list[float]]) -> None:
        cfg, lead = self.cfg, self.lead
        arrivals: dict[int, float] = {}
        for s in self.members:
            if s is lead:
                continue
            outcome, arrival = self._arrive(s)
            outcomes[s.peer] = outcome
            if arrival is not None:
                arrivals[s.peer] = arrival
        close, joined = self._close(arrivals)
        outcomes[lead.peer] = self._outcome_of_lead(close, joined)
        planned = set(lead.planned)
        lags[lead.peer] = [max(0.0, a - lead.declare) for p, a in arrivals.items() if p in planned]
        group = outcomes[lead.peer].group
        for peer, arrival in arrivals.items():
            s, o = self._seeker(peer), outcomes[peer]
            r = self.rtt(peer, lead.peer)
            if group is not None and peer in group:
                assert close is not None
                o.group, o.reason, o.done = group, "averaged", close + r / 2
                o.stores += 1  # busy
                continue
            o.reason = "refused: the leader closed" if group else "the leader formed no group"
            o.done = min(max(arrival + r / 2, s.declare + s.patience), s.declare + cfg.timeout)
            o.gets += self._polls(o.done - arrival)

    def _arrive(self, s: Seeker) -> tuple[Outcome, float | None]:
        """``s``'s outcome so far and when it asks the leader to take it (None: it gave up)."""
        cfg, lead, leader = self.cfg, self.lead, self.planned_leader
        r = self.rtt(s.peer, lead.peer)
        if self.planned_present and lead.declare <= s.declare + cfg.gather_window:
            arrival = max(s.declare, lead.declare) + r / 2
            if s.declare < lead.declare:  # it was retrying: the next try after the leader started
                arrival += self.rng.uniform(0.0, r + JOIN_RETRY_S)
            return Outcome(None, "", arrival, stores=1), arrival
        gone: dict[int, float] = {}
        if leader in self.dead:
            enter = s.declare + self.rtt(s.peer, leader)  # refused at once: gone
            gone[leader] = enter
        else:
            enter = s.declare + cfg.gather_window  # not looking under this key: retried
        others = [p for p in s.planned if p != s.peer]
        dead_planned = [p for p in others if p in self.dead]
        for p in dead_planned:  # _check_missing pings the planned members that did not join
            gone.setdefault(p, enter + self.rtt(s.peer, p))
        if others and len(dead_planned) == len(others):
            done = max(gone.values())
            return Outcome(None, "every other planned member is gone", done, 1, 0, gone), None
        t, polls, deadline = enter, 0, s.declare + cfg.timeout
        while t < deadline:
            took = get_delay(self.rng)
            polls += 1
            if t >= self.visible[lead.peer]:
                arrival = t + took + r / 2
                return Outcome(None, "", arrival, 1, polls, gone), arrival
            coming = any(self.visible[m.peer] <= t for m in self.members if m is not s)
            if not coming and t >= s.declare + s.patience:
                return Outcome(None, "no planned member came", t + took, 1, polls, gone), None
            t += took + cfg.poll_interval
        return Outcome(None, "no group formed", deadline, 1, polls, gone), None

    def _close(self, arrivals: dict[int, float]) -> tuple[float | None, list[int]]:
        """The leader's close time (None: no group) and the members it took."""
        cfg, lead = self.cfg, self.lead
        patient_until = lead.declare + lead.patience
        order = sorted(arrivals, key=lambda p: (arrivals[p], p))
        times = sorted({*arrivals.values(), *self.lead_gone.values(), patient_until})
        joined: list[int] = []
        deadlines = [lead.declare + cfg.timeout]
        waiting = iter(order)
        pending = next(waiting, None)
        for t in times:
            while pending is not None and arrivals[pending] <= t:
                if len(joined) + 1 < cfg.target_group_size:
                    joined.append(pending)
                    deadlines.append(self._seeker(pending).declare + cfg.timeout)
                pending = next(waiting, None)
            close_by = min(deadlines) - CLOSE_MARGIN_S
            if t >= close_by:
                break
            size = len(joined) + 1
            expected = len(lead.planned) - sum(g <= t for g in self.lead_gone.values())
            if size >= cfg.target_group_size or size >= max(expected, cfg.min_group_size):
                return t, joined
            if t >= patient_until and size >= cfg.min_group_size:
                return t, joined
        size = len(joined) + 1
        if size >= cfg.min_group_size:
            return min(deadlines) - CLOSE_MARGIN_S, joined
        return None, joined

    def _outcome_of_lead(self, close: float | None, joined: list[int]) -> Outcome:
        cfg, lead, loop_start = self.cfg, self.lead, self.loop_start
        gone = {p: t for p, t in self.lead_gone.items() if close is None or t <= close}
        if not self.planned_present and self.planned_leader in self.dead:
            gone[self.planned_leader] = loop_start
        if close is None:
            end = min(max(lead.declare + lead.patience, loop_start), lead.declare + cfg.timeout)
            return Outcome(None, "alone under its key", end, 1, self._polls(end - loop_start), gone)
        polls = self._polls(close - loop_start) + len(joined) if close > loop_start else 0
        group = tuple(sorted([lead.peer, *joined]))
        return Outcome(group, "averaged", close, 2 + len(joined), polls, gone)

    def _seeker(self, peer: int) -> Seeker:
        return next(s for s in self.members if s.peer == peer)

    def _polls(self, seconds: float) -> int:
        return max(0, math.ceil(seconds / (self.cfg.poll_interval + GET_MEDIAN_S)))
