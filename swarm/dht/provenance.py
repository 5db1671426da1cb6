"""Where and since when a storing node holds each slot (sans-I/O): its origin and witnessed age.

A slot is one ``(owner, subkey)`` of a key. A storing node remembers, per slot:

- its **origin**: the host and subnet (:func:`swarm.hosts.scope_of`) of the address that stored
  it. A *first-hand* store (the datagram's sender key is the entry's owner key) is attributed to
  the owner's own address. A *second-hand* store (replication, or anyone passing on someone
  else's signed entry) is attributed to the sender's scope, never to the owner's, and a later
  first-hand store of the slot corrects it. So a thousand identities stored from one host count
  as that one host, whichever keys they hold;
- when it **first stored** the slot, kept across refreshes (a heartbeat replaces the entry with
  a later expiration but not the slot's history): ``now - first_stored`` is the slot's
  *witnessed age*, what an outsider cannot buy but with time;
- when its owner last stored it **first-hand** (liveness).

The history lives and dies with the stored slot (an expired or evicted slot starts again from
zero), so its memory is bounded by the storage's quotas.

Readers ask several holders; each reports its witnessed age of the slot, and the reader takes
the lower median of the reports (its own storage counting as one holder): raising an owner's age
takes a majority of lying holders, and lowering it (which only costs the owner trust) half. The
result is capped to the entry's possible life, :func:`possible_life`: an entry signed to expire
at ``E`` cannot have been signed before ``E - MAX_TTL_S``. So an entry stored once to last a
week (the cheap way to squat a key) reads as young whatever its holders say, while a peer that
re-announces short-lived records (3 heartbeats) ages up to a week. Cost: a peer that announces
long-lived records reads younger than it is.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from swarm.hosts import scope_of

# the longest life of one entry (records.MAX_TTL_S): a witnessed age is capped to it, since an
# age beyond it proves nothing more to a reader and a holder's clock or lie must not weigh more
MAX_WITNESSED_AGE_S = 7 * 24 * 3600.0
LIVE_FOR_S = 300.0  # an owner that stored its slot first-hand this recently is live


@dataclass(frozen=True)
class Origin:
    """Who stored a slot: the scope of the sending address, and whether it was the owner."""

    subnet: str  # "192.0.2.0/24", "2001:db8:1::/48"
    host: str  # "192.0.2.1/32", "2001:db8:1:2::/64"
    first_hand: bool  # the sender was the entry's owner

    @classmethod
    def of(cls, address: str, first_hand: bool) -> Origin:
        scope = scope_of(address)
        return cls(scope.subnet, scope.host, first_hand)


UNKNOWN_ORIGIN = Origin("?", "?", False)  # a merge without an address (kademlia's interface)


@dataclass
class SlotHistory:
    """What a storing node remembers of one slot (see the module docstring)."""

    origin: Origin
    first_stored: float  # wall-clock time of the first store of the slot
    heard_at: float | None  # wall-clock time of the owner's last first-hand store

    @classmethod
    def start(cls, origin: Origin, now: float) -> SlotHistory:
        return cls(origin, now, now if origin.first_hand else None)

    def observe(self, origin: Origin, now: float) -> bool:
        """Record another store of the slot; True when its origin changed.

        A first-hand store corrects the origin (the owner speaks for itself, and may have
        moved); a second-hand one never replaces it.
        """
        if not origin.first_hand:
            return False
        self.heard_at = now
        if origin == self.origin:
            return False
        self.origin = origin
        return True

    def age(self, now: float) -> float:
        """The witnessed age, in ``[0, MAX_WITNESSED_AGE_S]`` (a clock step back reads 0)."""
        return min(MAX_WITNESSED_AGE_S, max(0.0, now - self.first_stored))

    def live(self, now: float) -> bool:
        return self.heard_at is not None and now - self.heard_at <= LIVE_FOR_S


def reported_age(value: object) -> float | None:
    """A holder's reported age, checked: a finite number, capped; None when malformed."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value):
        return None
    return min(MAX_WITNESSED_AGE_S, max(0.0, float(value)))


def possible_life(expiration: float, now: float) -> float:
    """How long an entry expiring at ``expiration`` can have existed at ``now``: it was signed
    at most :data:`MAX_WITNESSED_AGE_S` (the longest TTL) before it expires."""
    return min(MAX_WITNESSED_AGE_S, max(0.0, MAX_WITNESSED_AGE_S - (expiration - now)))


def median_age(reports: Iterable[float]) -> float:
    """The lower median of the holders' reports (0.0 for none): with two reports, the smaller."""
    values = [min(MAX_WITNESSED_AGE_S, max(0.0, r)) for r in reports]
    return statistics.median_low(values) if values else 0.0
