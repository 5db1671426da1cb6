"""What a node takes from one ``store`` request (sans-I/O): budgets per host and subnet, owner
signatures checked in order, and a penalty for forgeries.

Ports, identities and addresses are free, so every budget here is a
:class:`~swarm.hosts.HostBuckets` (per host and per subnet, see :mod:`swarm.dht.budgets`), never
per ``(address, port)`` or per key. A store passes, cheapest check first:

1. the source's signature budget must not be in debt (a recent forgery): otherwise the store is
   refused before a byte of it is parsed;
2. entries are parsed and type-checked; those already held (or older than what is held) cost
   nothing more, and a first-hand one (sent by its owner) proves the owner live;
3. the new slots among the rest are metered by the slot budget (how fast one scope may grow the
   storage), then every entry left by the signature budget, all or nothing;
4. signatures are checked **in order and the check stops at the first bad one**: the entries
   before it are kept (each is signed on its own), so re-sending them costs the verifier nothing;
   the source is charged :data:`~swarm.dht.budgets.FORGERY_PENALTY` on top of its checks, which
   puts its host and subnet in debt: their next stores are refused unchecked for seconds.

Each stored entry's origin (:mod:`swarm.dht.provenance`) is the source's scope, first-hand when
the datagram's sender key is the entry's owner key and the sender proved it holds that key (the
signed binding of its agreement key, checked once per sender and cached: in an open swarm a
datagram's public key alone proves nothing, and a relayer claiming to be the owner could move
the owner's slot into its own crowd).

Cost to honest peers: a peer that shares a host (a NAT) or a /24 with a forger has its stores
refused for a few seconds after each forgery (its records stay where they were stored, and its
next heartbeat retries); one host may create :data:`~swarm.dht.budgets.SLOT_RATE` new slots and
check :data:`~swarm.dht.budgets.VERIFY_RATE` signatures per second, far above what a few peers
behind one address announce.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from swarm.dht.budgets import FORGERY_PENALTY, SLOT_BURST, SLOT_RATE, SUBNET_SHARE
from swarm.dht.envelope import DatagramAuth, SenderKeys
from swarm.dht.provenance import Origin
from swarm.dht.records import DHTEntry, RecordStorage
from swarm.errors import DHTError
from swarm.hosts import HostBuckets

MAX_ENTRIES_PER_STORE = 64


class StoreIntake:
    """Admits the entries of store requests into ``storage`` (see the module docstring).

    Args:
        storage: where accepted entries go.
        verify_budget: public-key work per host and subnet (shared with datagram opening).
        auth: the node's datagram auth, which checks (and caches) senders' key bindings.
    """

    def __init__(self, storage: RecordStorage, verify_budget: HostBuckets, auth: DatagramAuth):
        self.storage = storage
        self.verify_budget = verify_budget
        self.auth = auth
        self.slot_budget = HostBuckets(SLOT_RATE, SLOT_BURST, SUBNET_SHARE)
        self.signatures_checked = 0
        self.forgeries = 0  # stores that carried a bad signature
        self.refused_unchecked = 0  # stores refused before any signature check (budget, debt)

    def admit(
        self,
        source: str,
        sender: SenderKeys,
        key: bytes,
        wire_entries: Any,
        now: float | None = None,
    ) -> int:
        """Take what may be taken from one store of ``wire_entries`` under ``key``, sent from
        IP ``source`` by the node with keys ``sender``; returns how many entries are now held
        (already held ones count).

        Raises:
            DHTError: malformed, over a budget (nothing checked), or forged (the entries
                before the forged one are kept).
        """
        if not isinstance(wire_entries, list) or len(wire_entries) > MAX_ENTRIES_PER_STORE:
            raise DHTError(f"a store carries a list of at most {MAX_ENTRIES_PER_STORE} entries")
        if not self.verify_budget.allows(source):
            self.refused_unchecked += 1
            raise DHTError("this source's signature budget is spent (or it sent a forgery)")
        now = time.time() if now is None else now
        entries = [DHTEntry.from_wire(key, obj) for obj in wire_entries]
        second_hand = Origin.of(source, first_hand=False)
        first_hand = second_hand
        if any(e.public_key == sender.public_key for e in entries) and self.auth.binds(
            sender, lambda: self.verify_budget.take(source)
        ):
            first_hand = Origin.of(source, first_hand=True)

        def origin(entry: DHTEntry) -> Origin:
            return first_hand if entry.public_key == sender.public_key else second_hand

        fresh = []
        for entry in entries:
            if self.storage.holds(entry):
                self.storage.touch(entry, origin(entry), now)
            else:
                fresh.append(entry)
        held = len(entries) - len(fresh)
        new_slots = sum(not self.storage.has_slot(e) for e in fresh)
        if new_slots and not self.slot_budget.allows(source, new_slots):
            self.slot_budget.refused += 1
            self.refused_unchecked += 1
            raise DHTError(f"this source's slot budget is spent: {new_slots} new slots refused")
        if fresh and not self.verify_budget.take(source, len(fresh)):
            self.refused_unchecked += 1
            raise DHTError(f"signature budget spent: {len(fresh)} entries not checked")
        if new_slots:
            self.slot_budget.take(source, new_slots)  # in budget: checked just above
        verified, forged = _verified_prefix(fresh, self._count_check)
        stored = held + sum(self.storage.merge(e, now, origin(e)) for e in verified)
        if forged is not None:
            self.forgeries += 1
            self.verify_budget.penalize(source, FORGERY_PENALTY)
            raise DHTError(
                f"a forged entry stopped the store: the {len(verified)} checked before it were "
                "kept, the rest refused"
            )
        return stored

    def _count_check(self) -> None:
        self.signatures_checked += 1


def _verified_prefix(
    entries: list[DHTEntry], counted: Callable[[], None]
) -> tuple[list[DHTEntry], int | None]:
    """The entries up to the first bad signature, and that one's index (None: all good)."""
    for index, entry in enumerate(entries):
        counted()
        try:
            entry.verify()
        except DHTError:
            return entries[:index], index
    return entries, None
