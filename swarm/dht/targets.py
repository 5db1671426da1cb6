"""Where a key was stored lately: the k closest nodes a store's lookup found, reused for a while.

A peer stores the same few keys over and over (its record every heartbeat, its coordinate after
every probe round, its matchmaking declaration every round), and each store began with a full
lookup of the key: on 16 peers, two thirds of all DHT requests. The nodes closest to a key change
only as peers join and leave, so a store reuses the closest nodes that a lookup found less than
:data:`TARGETS_TTL_S` ago. Targets that the DHT holds suspect (they failed to answer) are left
out, and once a target did not take a store (gone, or refusing), or fewer than a quorum are
left, the next store looks the key up again.
A node that joined closer to the key in the meantime gets the entry after the next lookup; until
then the older holders, among the k closest that a get asks, still serve it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from swarm.dht.routing import Contact

TARGETS_TTL_S = 20.0  # how long a lookup's closest nodes serve later stores of the key
MAX_KEYS = 256  # keys remembered (a peer stores a handful; the oldest go first)


class StoreTargets:
    """The closest nodes of recently stored keys (see the module docstring)."""

    def __init__(self, ttl: float = TARGETS_TTL_S, max_keys: int = MAX_KEYS):
        self.ttl = ttl
        self.max_keys = max_keys
        self._found: OrderedDict[bytes, tuple[float, list[Contact]]] = OrderedDict()

    def get(
        self, digest: bytes, quorum: int, is_suspect: Callable[[bytes], bool]
    ) -> list[Contact] | None:
        """The remembered closest nodes of ``digest`` less the suspect ones, or None when they
        are too old or fewer than ``quorum`` are left (look the key up again)."""
        found = self._found.get(digest)
        if found is None:
            return None
        at, contacts = found
        live = [c for c in contacts if not is_suspect(c.id)]
        if time.monotonic() - at > self.ttl or len(live) < quorum:
            del self._found[digest]
            return None
        return live

    def put(self, digest: bytes, contacts: list[Contact]) -> None:
        self._found[digest] = (time.monotonic(), list(contacts))
        self._found.move_to_end(digest)
        while len(self._found) > self.max_keys:
            self._found.popitem(last=False)

    def forget(self, digest: bytes) -> None:
        self._found.pop(digest, None)
