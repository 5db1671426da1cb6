"""The owners this peer accused, and for how many of its rounds it leaves them out (sans-I/O).

An accused owner's part is refused in the round it was accused in (the checker keeps its own
values; the part is averaged again without it). An excluded owner gets nothing from this peer
and its part streams are refused (403). Accusations can be wrong: the owner check compares
distances, and in 5 calm runs of 4 honest peers behind 10 Mbit/s links (int8, 20 inner steps,
12 rounds) members accused honest owners 15 times; excluded for good, one honest peer averaged
nothing with two of the three others again. So:

- a first accusation refuses the part and excludes nobody (a *strike*);
- a second one within :data:`STRIKE_ROUNDS` of this peer's rounds excludes the owner for
  :data:`FIRST_ROUNDS` rounds; once excluded, every accusation excludes it again, for twice as
  long each time.

A liar lies every round it can: it is excluded at its second lie, one round later, having had
nothing applied (each lie is refused). Of those honest owners, most were accused once by a
given member and kept averaging with it; in the 2 runs under this rule 3 were accused twice
within 8 rounds and left out for 8. An attacker that gets many identities accused can push a
liar's record out of the :data:`MAX_REMEMBERED` kept: the liar then starts again at a strike,
still refused every time it lies.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from swarm.identity import PeerID

STRIKE_ROUNDS = 8  # a second accusation within this many rounds of the first excludes
FIRST_ROUNDS = 8  # rounds a first exclusion lasts (doubling with each one after)
_MAX_DOUBLINGS = 10  # past 8 * 2**10 rounds, a repeat offender is out for good in practice
MAX_REMEMBERED = 1024  # accused peers remembered (least recently accused forgotten first)


@dataclass
class _Record:
    why: str
    accused_round: int  # the round of its last accusation
    excluded_until: int  # the last of this peer's rounds that leaves it out (0: none)
    exclusions: int  # how often it was excluded


class Exclusions:
    """Accused owners: excluded at a second accusation within ``strike_rounds`` rounds (and at
    every one after an exclusion), for ``first_rounds`` rounds doubling with every exclusion.

    Call :meth:`start_round` as each round starts; ``peer in exclusions`` then says whether
    ``peer`` is left out of it.
    """

    def __init__(
        self,
        first_rounds: int = FIRST_ROUNDS,
        strike_rounds: int = STRIKE_ROUNDS,
        remembered: int = MAX_REMEMBERED,
    ):
        if first_rounds < 1 or strike_rounds < 0 or remembered < 1:
            raise ValueError("first_rounds and remembered must be >= 1, strike_rounds >= 0")
        self.first_rounds = first_rounds
        self.strike_rounds = strike_rounds
        self.remembered = remembered
        self.round = 0
        self._records: OrderedDict[PeerID, _Record] = OrderedDict()

    def start_round(self) -> None:
        """Count one more round of this peer's."""
        self.round += 1

    def accuse(self, peer: PeerID, why: str) -> bool:
        """File an accusation of ``peer``; True when it now excludes ``peer``."""
        record = self._records.pop(peer, None)
        if record is None:
            record = _Record(why, self.round, 0, 0)
            striking = self.strike_rounds == 0
        else:
            recent = self.round - record.accused_round <= self.strike_rounds
            striking = recent or record.exclusions > 0
            record.why, record.accused_round = why, self.round
        if striking:
            rounds = self.first_rounds << min(record.exclusions, _MAX_DOUBLINGS)
            record.excluded_until = self.round + rounds
            record.exclusions += 1
        self._records[peer] = record
        while len(self._records) > self.remembered:
            self._records.popitem(last=False)
        return striking

    def why(self, peer: PeerID) -> str:
        """Why ``peer`` is left out (KeyError when it is not)."""
        if peer not in self:
            raise KeyError(peer)
        return self._records[peer].why

    def accused(self, peer: PeerID) -> bool:
        """Whether this peer accused ``peer`` (as far as it remembers)."""
        return peer in self._records

    def exclusions(self, peer: PeerID) -> int:
        """How often this peer excluded ``peer`` (as far as it remembers)."""
        record = self._records.get(peer)
        return record.exclusions if record is not None else 0

    def __contains__(self, peer: object) -> bool:
        record = self._records.get(peer) if isinstance(peer, PeerID) else None
        return record is not None and self.round <= record.excluded_until

    def __len__(self) -> int:
        return sum(1 for peer in self._records if peer in self)
