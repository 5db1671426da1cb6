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

from swarm.errors import DHTError
from swarm.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, PeerID, verify_signature

KEY_DIGEST_BYTES = 20  # kademlia's 160-bit key space
MAX_SUBKEY_CHARS = 64
MAX_VALUE_BYTES = 4096
MAX_TTL_S = 7 * 24 * 3600.0  # an expiration further away than this is refused
MAX_SUBKEYS_PER_KEY = 1024
MAX_STORED_ENTRIES = 100_000  # per node, all keys together
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

    Bounded: at most :data:`MAX_SUBKEYS_PER_KEY` slots per key and :data:`MAX_STORED_ENTRIES`
    in all; past that, new slots are refused (existing ones can still be refreshed).
    """

    def __init__(self, max_entries: int = MAX_STORED_ENTRIES):
        self.max_entries = max_entries
        self._records: dict[bytes, dict[tuple[bytes, str], DHTEntry]] = {}
        self._count = 0

    def merge(self, entry: DHTEntry, now: float | None = None) -> bool:
        """Store ``entry`` unless its slot holds a later one; True when it was taken.

        The caller has verified the signature.
        """
        now = time.time() if now is None else now
        if entry.expiration <= now or entry.expiration > now + MAX_TTL_S:
            return False
        record = self._records.get(entry.key)
        if record is None:
            record = {}
        current = record.get(entry.slot)
        if current is not None:
            if current.expiration >= entry.expiration:
                return False
        else:
            self._cull(entry.key, now)
            if len(record) >= MAX_SUBKEYS_PER_KEY or self._count >= self.max_entries:
                return False
            self._count += 1
        record[entry.slot] = entry
        self._records[entry.key] = record
        return True

    def entries(self, key: bytes, now: float | None = None) -> list[DHTEntry]:
        """The live entries under ``key``, latest expiration first."""
        now = time.time() if now is None else now
        self._cull(key, now)
        record = self._records.get(key, {})
        return sorted(record.values(), key=lambda e: e.expiration, reverse=True)

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
            del record[slot]
            self._count -= 1
        if not record:
            del self._records[key]

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
