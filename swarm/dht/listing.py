"""The order in which a holder lists a key's owners (sans-I/O), so free identities buy nothing.

An answer carries one page of a key's entries, and a reader follows a few pages only; whoever
comes first in the order is what every reader sees. Ordering owners by public key (as before)
let an attacker grind keys that sort first and push every honest owner past the pages a reader
reads. Here the order depends only on what an attacker cannot make for free:

1. **round-robin over subnets** (IPv4 /24, IPv6 /48) of the slots' origins (see
   :mod:`swarm.dht.provenance`): one owner of each subnet, then the next of each, ...; a
   thousand identities from one subnet take one turn in each cycle, like any single subnet;
2. inside a subnet, **round-robin over hosts** (IPv4 /32, IPv6 /64);
3. inside a host, **live owners first** (stored first-hand within ``LIVE_FOR_S``), then the
   **oldest first** (witnessed age), then by key.

Subnets and hosts take their turns in the order of their best owner by rule 3. Every owner
still appears once per round (its newest entry in round 0, its second newest in round 1, ...).

Cost to honest peers: peers that share a subnet with many others wait longer for their turn
(in a cycle of as many owners as there are subnets); a peer that just joined lists after the
older owners of its host, never after other hosts' crowds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from swarm.dht.provenance import SlotHistory

T = TypeVar("T")


@dataclass(frozen=True)
class Standing:
    """What orders one owner of a key: where its slots came from and since when."""

    subnet: str
    host: str
    live: bool  # stored first-hand lately
    since: float  # when its oldest slot under the key was first stored (wall clock)

    def rank(self, owner: bytes) -> tuple[bool, float, bytes]:
        return (not self.live, self.since, owner)


def standing_of(histories: list[SlotHistory], now: float) -> Standing:
    """An owner's place in a listing, from its slots under the key: the origin of its oldest
    first-hand slot (else of its oldest), live if any slot is, as old as its oldest."""
    if len(histories) == 1:  # the common case, made cheap: one slot per owner
        h = histories[0]
        return Standing(h.origin.subnet, h.origin.host, h.live(now), h.first_stored)
    source = min(histories, key=lambda h: (not h.origin.first_hand, h.first_stored))
    return Standing(
        source.origin.subnet,
        source.origin.host,
        any(h.live(now) for h in histories),
        min(h.first_stored for h in histories),
    )


def listing_order(standings: dict[bytes, Standing]) -> list[bytes]:
    """The owners in listing order (see the module docstring)."""
    hosts: dict[tuple[str, str], list[bytes]] = {}
    for owner, standing in standings.items():
        hosts.setdefault((standing.subnet, standing.host), []).append(owner)
    subnets: dict[str, list[list[bytes]]] = {}
    for (subnet, _), owners in hosts.items():
        owners.sort(key=lambda o: standings[o].rank(o))
        subnets.setdefault(subnet, []).append(owners)

    def best(owners: list[bytes]) -> tuple[bool, float, bytes]:
        return standings[owners[0]].rank(owners[0])

    cycles = []
    for groups in subnets.values():
        groups.sort(key=best)
        cycles.append(interleave(groups))
    cycles.sort(key=best)
    return interleave(cycles)


def interleave(sequences: Sequence[Sequence[T]]) -> list[T]:
    """One item of each sequence in turn, skipping those that ran out: [a1, b1, a2, b2, b3]."""
    out: list[T] = []
    active = [s for s in sequences if s]
    depth = 0
    while active:
        out.extend(s[depth] for s in active)
        depth += 1
        active = [s for s in active if depth < len(s)]
    return out


def rounds_of(order: Iterable[bytes], entries: dict[bytes, list[T]]) -> list[list[T]]:
    """Round ``r`` holds the ``r``-th entry of each owner that has one, owners in ``order``."""
    ranked = [entries[o] for o in order]
    depth = max((len(e) for e in ranked), default=0)
    return [[e[r] for e in ranked if r < len(e)] for r in range(depth)]
