"""The owners this peer accused, and for how many of its rounds it leaves them out (sans-I/O).

An accused owner owns no part in the accuser's plans and its part streams are refused (403).
An accusation can be wrong: the owner check compares distances, and an honest owner whose part
averaged a far member's values with few others' lies far from the checker's values (seen in
calm runs at 10 Mbit/s, where two of three members accused an honest peer and it averaged
nothing with them for the rest of the run). So an exclusion lasts :data:`FIRST_ROUNDS` of the
accuser's rounds, doubling with each further accusation of the same peer. A liar readmitted
costs one refused part (a refused part keeps the checker's own values, nothing is applied) and
is accused again for twice as long; an honest peer accused once is back after a few rounds.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from swarm.identity import PeerID

FIRST_ROUNDS = 8  # rounds a first accusation excludes for
_MAX_DOUBLINGS = 10  # past 8 * 2**10 rounds, a repeat offender is out for good in practice
MAX_REMEMBERED = 1024  # accused peers remembered (least recently accused forgotten first)


@dataclass
class _Exclusion:
    why: str
    last_round: int  # the last of this peer's rounds that leaves it out
    accusations: int


class Exclusions:
    """Accused owners, each left out until a round count that doubles with every accusation.

    Call :meth:`start_round` as each round starts; ``peer in exclusions`` then says whether
    ``peer`` is left out of it.
    """

    def __init__(self, first_rounds: int = FIRST_ROUNDS, remembered: int = MAX_REMEMBERED):
        if first_rounds < 1 or remembered < 1:
            raise ValueError("first_rounds and remembered must be at least 1")
        self.first_rounds = first_rounds
        self.remembered = remembered
        self.round = 0
        self._entries: OrderedDict[PeerID, _Exclusion] = OrderedDict()

    def start_round(self) -> None:
        """Count one more round of this peer's."""
        self.round += 1

    def accuse(self, peer: PeerID, why: str) -> None:
        """Leave ``peer`` out of this peer's next rounds (twice as many as last time)."""
        entry = self._entries.pop(peer, None)
        accusations = entry.accusations + 1 if entry is not None else 1
        rounds = self.first_rounds << min(accusations - 1, _MAX_DOUBLINGS)
        self._entries[peer] = _Exclusion(why, self.round + rounds, accusations)
        while len(self._entries) > self.remembered:
            self._entries.popitem(last=False)

    def why(self, peer: PeerID) -> str:
        """Why ``peer`` is left out (KeyError when it is not)."""
        if peer not in self:
            raise KeyError(peer)
        return self._entries[peer].why

    def accusations(self, peer: PeerID) -> int:
        """How often this peer accused ``peer`` (as far as it remembers)."""
        entry = self._entries.get(peer)
        return entry.accusations if entry is not None else 0

    def __contains__(self, peer: object) -> bool:
        entry = self._entries.get(peer) if isinstance(peer, PeerID) else None
        return entry is not None and self.round <= entry.last_round

    def __len__(self) -> int:
        return sum(1 for peer in self._entries if peer in self)
