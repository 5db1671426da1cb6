"""Dictionary records (sans-I/O): owner-signed subkeys that merge on store, and their storage.

A DHT key maps to a dictionary ``(owner, subkey) -> entry``. Each entry is signed by its owner over
the key, the subkey, the value and the expiration, so a storing node can check that nobody but
the owner wrote it. Storing MERGES: per ``(owner, subkey)`` slot the entry with the later
expiration wins, and an expired entry is dropped on every access. This replaces kademlia's one
value per key, which the last writer overwrites.

Values are small pointers (an address, a declaration), never tensors: a store rides in one UDP
datagram, which the protocol caps at 8 KiB.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
from kademlia.storage import IStorage

from swarm.dht.listing import listing_order, rounds_of, standing_of
from swarm.dht.provenance import LIVE_FOR_S, UNKNOWN_ORIGIN, Origin, SlotHistory
from swarm.dht.scopes import ScopeTally
from swarm.errors import DHTError
from swarm.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, PeerID, verify_signature

KEY_DIGEST_BYTES = 20  # kademlia's 160-bit key space
MAX_SUBKEY_CHARS = 64
MAX_VALUE_BYTES = 4096
MAX_TTL_S = 7 * 24 * 3600.0  # an expiration further away than this is refused
MAX_SUBKEYS_PER_KEY = 1024
MAX_SUBKEYS_PER_OWNER = 32  # slots of one owner under one key
MAX_OWNER_ENTRIES = 1024  # entries of one owner on one node, all keys together
MAX_OWNER_BYTES = 512 * 1024  # their wire bytes
MAX_STORED_ENTRIES = 32_768  # per node, all owners and keys together
MAX_STORED_BYTES = 16 * 1024 * 1024  # their wire bytes
_CONTEXT = b"swarm/dht-entry/v1"


def key_digest(key: str) -> bytes:
    """The 160-bit DHT id of a textual key (SHA-1, as in kademlia)."""
    return hashlib.sha1(key.encode("utf-8")).digest()


@dataclass(frozen=True)
class DHTEntry:
    """One owner-signed subkey of a dictionary record."""

    key: bytes  # 20 B digest of the record's key
    subkey: str  # chosen by the owner; (owner, subkey) is the slot that merges
    value: bytes  # at most MAX_VALUE_BYTES
    expiration: float  # wall-clock time.time() after which the entry is gone
    public_key: bytes  # 32 B Ed25519 of the owner
    signature: bytes = field(repr=False)  # 64 B: owner's signature of the fields above
    # how long the DHT has held this slot, as its holders report it (their median): set by a
    # reader, never signed, never compared; what an outsider cannot buy but with time
    age_s: float = field(default=0.0, repr=False, compare=False)

    @classmethod
    def create(
        cls, identity: Identity, key: bytes, subkey: str, value: bytes, expiration: float
    ) -> DHTEntry:
        """Sign a new entry; raises :class:`DHTError` on an invalid field."""
        _check_fields(key, subkey, value, expiration, identity.public_key)
        message = _signed_message(key, subkey, value, expiration, identity.public_key)
        return cls(key, subkey, value, expiration, identity.public_key, identity.sign(message))

    @property
    def owner(self) -> PeerID:
        return PeerID.from_public_key(self.public_key)

    @property
    def slot(self) -> tuple[bytes, str]:
        """What merges: one entry per owner and subkey."""
        return (self.public_key, self.subkey)

    def verify(self) -> None:
        """Raise :class:`DHTError` unless the owner's signature is valid."""
        message = _signed_message(
            self.key, self.subkey, self.value, self.expiration, self.public_key
        )
        if not verify_signature(self.public_key, self.signature, message):
            raise DHTError("entry signature does not match its owner")

    def to_wire(self) -> list[Any]:
        """The msgpack-able form (the key travels beside it, once per request)."""
        return [self.subkey, self.value, self.expiration, self.public_key, self.signature]

    @classmethod
    def from_wire(cls, key: bytes, obj: Any) -> DHTEntry:
        """Parse and type-check an entry received for ``key`` (the signature is checked apart).

        Raises:
            DHTError: wrong shape, types or sizes.
        """
        if not isinstance(obj, list) or len(obj) != 5:
            raise DHTError("an entry is [subkey, value, expiration, public_key, signature]")
        subkey, value, expiration, public_key, signature = obj
        if isinstance(expiration, int) and not isinstance(expiration, bool):
            expiration = float(expiration)
        _check_fields(key, subkey, value, expiration, public_key)
        if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
            raise DHTError("entry signature must be 64 bytes")
        return cls(key, subkey, value, expiration, public_key, signature)

    def wire_size(self) -> int:
        return len(msgpack.packb(self.to_wire(), use_bin_type=True))


def _signed_message(
    key: bytes, subkey: str, value: bytes, expiration: float, public_key: bytes
) -> bytes:
    return _CONTEXT + msgpack.packb([key, subkey, value, expiration, public_key], use_bin_type=True)


def _check_fields(key: Any, subkey: Any, value: Any, expiration: Any, public_key: Any) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_DIGEST_BYTES:
        raise DHTError(f"a key digest is {KEY_DIGEST_BYTES} bytes")
    if not isinstance(subkey, str) or len(subkey) > MAX_SUBKEY_CHARS:
        raise DHTError(f"a subkey is text of at most {MAX_SUBKEY_CHARS} characters")
    if not isinstance(value, bytes) or len(value) > MAX_VALUE_BYTES:
        raise DHTError(f"a value is bytes, at most {MAX_VALUE_BYTES} of them")
    if not isinstance(expiration, float) or not math.isfinite(expiration):
        raise DHTError("an expiration is a finite float (seconds since the epoch)")
    if not isinstance(public_key, bytes) or len(public_key) != PUBLIC_KEY_BYTES:
        raise DHTError(f"an owner is a {PUBLIC_KEY_BYTES}-byte Ed25519 public key")


def check_expiration(expiration: float, now: float) -> None:
    """Refuse an expiration in the past or absurdly far in the future."""
    if not expiration > now:
        raise DHTError("the entry has already expired")
    if expiration > now + MAX_TTL_S:
        raise DHTError(f"an entry may live at most {MAX_TTL_S:.0f} s")


class RecordStorage(IStorage):
    """A node's local share of the DHT: key digest -> {(owner, subkey) -> entry}, merged.

    Each slot keeps its history (:mod:`swarm.dht.provenance`): the scope that stored it and
    since when. No one owner, host or subnet can fill the storage (libp2p's resource manager is
    the model: a limit per owner and per scope):

    - per key: at most ``max_subkeys_per_owner`` slots of one owner and :data:`MAX_SUBKEYS_PER_KEY`
      in all; a full key makes room for a newcomer by evicting from the subnet, then the host,
      then the owner that holds the most slots there (:mod:`swarm.dht.scopes`), so a newcomer
      from a less crowded subnet always gets room, whatever the number of identities in the
      crowd;
    - per node: at most ``max_owner_entries`` / ``max_owner_bytes`` for one owner, and
      ``max_entries`` / ``max_bytes`` in all; a full node evicts the same way, by bytes.

    Refreshing an existing slot (a heartbeat) is always allowed within the owner's quota, and
    keeps the slot's history.
    """

    def __init__(
        self,
        max_entries: int = MAX_STORED_ENTRIES,
        max_bytes: int = MAX_STORED_BYTES,
        max_owner_entries: int = MAX_OWNER_ENTRIES,
        max_owner_bytes: int = MAX_OWNER_BYTES,
        max_subkeys_per_owner: int = MAX_SUBKEYS_PER_OWNER,
    ):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_owner_entries = max_owner_entries
        self.max_owner_bytes = max_owner_bytes
        self.max_subkeys_per_owner = max_subkeys_per_owner
        self._records: dict[bytes, dict[tuple[bytes, str], DHTEntry]] = {}
        self._sizes: dict[tuple[bytes, tuple[bytes, str]], int] = {}  # (key, slot) -> wire bytes
        self._histories: dict[tuple[bytes, tuple[bytes, str]], SlotHistory] = {}
        self._owners: dict[bytes, dict[tuple[bytes, str, bytes], None]] = {}  # owner -> its slots
        self._owner_bytes: dict[bytes, int] = {}
        self._key_owner: dict[tuple[bytes, bytes], int] = {}  # (key, owner) -> slots there
        self._tally = ScopeTally()  # bytes by subnet, host and owner of origin
        self._generations: dict[bytes, int] = {}  # key -> changes so far (invalidates orders)
        self._orders: dict[bytes, tuple[int, float, list[list[DHTEntry]]]] = {}
        self._count = 0
        self._bytes = 0
        self.refused = 0  # entries refused for a quota (visible in logs and benchmarks)
        self.evicted = 0  # entries dropped to make room for another owner

    @property
    def stored_bytes(self) -> int:
        return self._bytes

    def merge(
        self, entry: DHTEntry, now: float | None = None, origin: Origin = UNKNOWN_ORIGIN
    ) -> bool:
        """Store ``entry`` unless its slot holds a later one or a quota refuses it; True when
        it was taken. ``origin``: who stored it (see :mod:`swarm.dht.provenance`).

        The caller has verified the signature.
        """
        now = time.time() if now is None else now
        if entry.expiration <= now or entry.expiration > now + MAX_TTL_S:
            return False
        owner = entry.public_key
        size = entry.wire_size()
        self._cull(entry.key, now)
        current = self._records.get(entry.key, {}).get(entry.slot)
        if current is None:
            history = SlotHistory.start(origin, now)
            if not self._admit_new(entry, history.origin, size, now):
                self.refused += 1
                return False
        else:
            if current.expiration >= entry.expiration:
                self.touch(entry, origin, now)
                return False
            old = self._sizes[(entry.key, entry.slot)]
            if self._owner_bytes.get(owner, 0) - old + size > self.max_owner_bytes:
                self.refused += 1
                return False
            history = self._remove(entry.key, entry.slot)
            history.observe(origin, now)
            if not self._make_room(history.origin, owner, 1, size, now):
                self._add(current, old, history)  # as it was
                self.refused += 1
                return False
        self._add(entry, size, history)
        return True

    def holds(self, entry: DHTEntry) -> bool:
        """Whether ``entry``'s slot already holds it or a later one (a merge would be a no-op,
        so its signature need not be checked again)."""
        current = self._records.get(entry.key, {}).get(entry.slot)
        return current is not None and current.expiration >= entry.expiration

    def has_slot(self, entry: DHTEntry) -> bool:
        """Whether ``entry``'s slot exists here (a store of it is a refresh, not a new slot)."""
        return entry.slot in self._records.get(entry.key, {})

    def touch(self, entry: DHTEntry, origin: Origin, now: float | None = None) -> None:
        """Another store of a slot held here (the entry was checked when first stored): a
        first-hand one proves the owner live and corrects the slot's origin."""
        history = self._histories.get((entry.key, entry.slot))
        if history is None:
            return
        now = time.time() if now is None else now
        before, was_live = history.origin, history.live(now)
        moved = history.observe(origin, now)
        if moved:
            member = (entry.key, entry.slot)
            self._tally.remove(before, entry.public_key, member)
            self._tally.add(history.origin, entry.public_key, member, self._sizes[member])
        if moved or (origin.first_hand and not was_live):
            self._changed(entry.key)  # origin and liveness order listings

    def history(self, entry: DHTEntry) -> SlotHistory | None:
        """What this node remembers of ``entry``'s slot (None when it does not hold it)."""
        return self._histories.get((entry.key, entry.slot))

    def witnessed_age(self, entry: DHTEntry, now: float | None = None) -> float:
        """How long this node has held ``entry``'s slot (0.0 when it does not)."""
        history = self.history(entry)
        return 0.0 if history is None else history.age(time.time() if now is None else now)

    def size_of(self, entry: DHTEntry) -> int:
        """``entry.wire_size()``, from memory when the slot is held here."""
        size = self._sizes.get((entry.key, entry.slot))
        return entry.wire_size() if size is None else size

    def _admit_new(self, entry: DHTEntry, origin: Origin, size: int, now: float) -> bool:
        owner = entry.public_key
        if self._key_owner.get((entry.key, owner), 0) >= self.max_subkeys_per_owner:
            return False
        owner_slots = self._owners.get(owner, {})
        if len(owner_slots) >= self.max_owner_entries:
            return False
        if self._owner_bytes.get(owner, 0) + size > self.max_owner_bytes:
            return False
        record = self._records.get(entry.key, {})
        if len(record) >= MAX_SUBKEYS_PER_KEY:
            slots = ScopeTally()
            for slot in record:
                slots.add(self._histories[(entry.key, slot)].origin, slot[0], slot, 1)
            victim = slots.victim(origin, owner, 1)
            if victim is None:
                return False  # every subnet, host and owner here holds its fair share
            self._remove(entry.key, victim)  # type: ignore[arg-type]
            self.evicted += 1
        return self._make_room(origin, owner, 1, size, now)

    def _make_room(self, origin: Origin, owner: bytes, entries: int, size: int, now: float) -> bool:
        """Evict by scope (:mod:`swarm.dht.scopes`) until ``entries``/``size`` more fit."""
        culled = False
        while self._count + entries > self.max_entries or self._bytes + size > self.max_bytes:
            if not culled:
                self.cull(now)
                culled = True
                continue
            victim = self._tally.victim(origin, owner, size)
            if victim is None:
                return False
            key, slot = victim  # type: ignore[misc]
            self._remove(key, slot)
            self.evicted += 1
        return True

    def _add(self, entry: DHTEntry, size: int, history: SlotHistory) -> None:
        owner = entry.public_key
        member = (entry.key, entry.slot)
        self._records.setdefault(entry.key, {})[entry.slot] = entry
        self._sizes[member] = size
        self._histories[member] = history
        self._tally.add(history.origin, owner, member, size)
        self._owners.setdefault(owner, {})[(entry.key, entry.subkey, owner)] = None
        self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + size
        key_owner = (entry.key, owner)
        self._key_owner[key_owner] = self._key_owner.get(key_owner, 0) + 1
        self._count += 1
        self._bytes += size
        self._changed(entry.key)

    def _remove(self, key: bytes, slot: tuple[bytes, str]) -> SlotHistory:
        record = self._records[key]
        del record[slot]
        if not record:
            del self._records[key]
        owner, subkey = slot
        size = self._sizes.pop((key, slot))
        history = self._histories.pop((key, slot))
        self._tally.remove(history.origin, owner, (key, slot))
        owned = self._owners[owner]
        del owned[(key, subkey, owner)]
        if owned:
            self._owner_bytes[owner] -= size
        else:
            del self._owners[owner]
            del self._owner_bytes[owner]
        key_owner = (key, owner)
        self._key_owner[key_owner] -= 1
        if not self._key_owner[key_owner]:
            del self._key_owner[key_owner]
        self._count -= 1
        self._bytes -= size
        self._changed(key)
        return history

    def _changed(self, key: bytes) -> None:
        if key in self._records:
            self._generations[key] = self._generations.get(key, 0) + 1
        else:
            self._generations.pop(key, None)
            self._orders.pop(key, None)

    def entries(self, key: bytes, now: float | None = None) -> list[DHTEntry]:
        """The live entries under ``key``, latest expiration first."""
        now = time.time() if now is None else now
        self._cull(key, now)
        record = self._records.get(key, {})
        return sorted(record.values(), key=lambda e: e.expiration, reverse=True)

    def fair_order(self, key: bytes, now: float | None = None) -> list[list[DHTEntry]]:
        """The live entries under ``key`` in rounds: round r holds the r-th newest entry of
        every owner that has one, owners in listing order (:mod:`swarm.dht.listing`: round-robin
        over subnets and hosts of origin, live and oldest first). An answer page never spans two
        rounds, so it carries at most one entry per owner and the first pages list every owner.
        """
        now = time.time() if now is None else now
        self._cull(key, now)
        generation = self._generations.get(key, 0)
        cached = self._orders.get(key)
        if cached is not None and cached[0] == generation and now < cached[1]:
            return cached[2]
        by_owner: dict[bytes, list[DHTEntry]] = {}
        histories: dict[bytes, list[SlotHistory]] = {}
        valid_until = math.inf  # the order holds until an entry expires or an owner goes stale
        for entry in self.entries(key, now):
            history = self._histories[(key, entry.slot)]
            by_owner.setdefault(entry.public_key, []).append(entry)
            histories.setdefault(entry.public_key, []).append(history)
            valid_until = min(valid_until, entry.expiration)
            if history.live(now) and history.heard_at is not None:
                valid_until = min(valid_until, history.heard_at + LIVE_FOR_S)
        standings = {owner: standing_of(h, now) for owner, h in histories.items()}
        rounds = rounds_of(listing_order(standings), by_owner)
        if rounds:
            self._orders[key] = (generation, valid_until, rounds)
        return rounds

    def keys(self) -> list[bytes]:
        return list(self._records)

    def cull(self, now: float | None = None) -> None:
        """Drop every expired entry."""
        now = time.time() if now is None else now
        for key in list(self._records):
            self._cull(key, now)

    def _cull(self, key: bytes, now: float) -> None:
        record = self._records.get(key)
        if record is None:
            return
        for slot in [s for s, e in record.items() if e.expiration <= now]:
            self._remove(key, slot)

    def __len__(self) -> int:
        return self._count

    # kademlia's IStorage interface: a "value" is the list of entries of a key

    def __setitem__(self, key: bytes, value: list[DHTEntry]) -> None:
        for entry in value:
            self.merge(entry)

    def __getitem__(self, key: bytes) -> list[DHTEntry]:
        found = self.entries(key)
        if not found:
            raise KeyError(key)
        return found

    def get(self, key: bytes, default: Any = None) -> Any:
        return self.entries(key) or default

    def iter_older_than(self, seconds_old: float) -> list[tuple[bytes, list[DHTEntry]]]:
        # owners re-announce before expiry (the heartbeat): storing nodes never republish
        return []

    def __iter__(self) -> Iterator[tuple[bytes, list[DHTEntry]]]:
        now = time.time()
        for key in list(self._records):
            found = self.entries(key, now)
            if found:
                yield key, found
