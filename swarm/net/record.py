"""A peer's signed self-description, published in the DHT and served at ``/info``.

Wire form: ``msgpack([body, signature])`` where ``body`` is the msgpack list of the fields and
``signature`` is the owner's Ed25519 signature of ``CONTEXT + body``. Signing the exact body bytes
avoids re-encoding ambiguity; :meth:`PeerRecord.parse` additionally requires the body to be the
canonical encoding of the fields it holds, so one record has exactly one wire form.

A record is ~350 bytes plus ``extra``; it rides in DHT datagrams (8 KiB cap), so ``extra`` is
capped at :data:`MAX_EXTRA_BYTES` and a whole record at :data:`MAX_RECORD_BYTES`.

Errors: :meth:`PeerRecord.parse` raises :class:`~swarm.errors.AuthError` when the bytes are well
formed but a signature does not verify (forged, or another owner's), and
:class:`~swarm.errors.TransportError` for anything malformed (types, sizes, encoding). Building a
record locally with invalid fields raises :class:`~swarm.errors.ConfigError`.
"""

from __future__ import annotations

import copy
import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Any

from swarm.address import PeerAddress
from swarm.errors import AuthError, ConfigError, TransportError
from swarm.identity import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    Identity,
    PeerID,
    agreement_binding_message,
    verify_signature,
)
from swarm.lru import LRU
from swarm.net import wire
from swarm.net.progress import LEFT_FIELD, PROGRESS_FIELD, Progress, check_extra_fields
from swarm.version import __version__

FORMAT = 1
CONTEXT = b"swarm/peer-record/v1"
MAX_RECORD_BYTES = 2048
MAX_EXTRA_BYTES = 768
MAX_TEXT_CHARS = 64  # run_id, device, version, extra keys


@dataclass(frozen=True)
class PeerRecord:
    """Who a peer is, where to dial it and what it offers; signed by the peer itself."""

    public_key: bytes  # 32 B Ed25519: the owner (PeerID = SHA-256 of it)
    agreement_key: bytes  # 32 B X25519 of the owner's current process (pairwise session keys)
    agreement_signature: bytes  # 64 B: owner's signature binding agreement_key to public_key
    address: PeerAddress  # what others dial for HTTP (TCP) and the DHT (UDP)
    run_id: str  # training run the peer takes part in
    device: str  # "cpu", "cuda:NVIDIA H100", ...
    bandwidth: float  # bytes/s others may plan for; 0 means client-only (behind NAT)
    version: str  # swarm version of the peer
    extra: dict[str, Any] = field(hash=False)  # small msgpack-able values (coordinates, progress)
    timestamp: float  # time.time() when signed; newer records replace older ones
    signature: bytes = field(repr=False)  # 64 B Ed25519 over CONTEXT + body
    # how long the DHT has held this record's slot, as a reader was told (DHTEntry.age_s); not
    # signed, not compared, 0.0 where unknown
    age_s: float = field(default=0.0, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name, size in (
            ("public_key", PUBLIC_KEY_BYTES),
            ("agreement_key", 32),
            ("agreement_signature", SIGNATURE_BYTES),
            ("signature", SIGNATURE_BYTES),
        ):
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) != size:
                raise ConfigError(f"record field {name} must be {size} bytes")
        if not isinstance(self.address, PeerAddress):
            raise ConfigError("record field address must be a PeerAddress")
        for name in ("run_id", "device", "version"):
            value = getattr(self, name)
            if not isinstance(value, str) or len(value) > MAX_TEXT_CHARS:
                raise ConfigError(f"record field {name} must be text of <= {MAX_TEXT_CHARS} chars")
        for name in ("bandwidth", "timestamp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, float) or not math.isfinite(value):
                raise ConfigError(f"record field {name} must be a finite float")
        if self.bandwidth < 0:
            raise ConfigError("record field bandwidth must be >= 0")
        _check_extra(self.extra)

    @property
    def peer_id(self) -> PeerID:
        return PeerID.from_public_key(self.public_key)

    @property
    def progress(self) -> Progress | None:
        """The training progress published with the record (checked at construction)."""
        raw = self.extra.get(PROGRESS_FIELD)
        return None if raw is None else Progress.from_wire(raw)

    @property
    def left(self) -> bool:
        """True for a leave marker: the peer closed and others should stop counting on it."""
        return self.extra.get(LEFT_FIELD) is True

    def __repr__(self) -> str:
        return (
            f"PeerRecord({self.peer_id.short} at {self.address}, run={self.run_id!r}, "
            f"device={self.device!r}, bandwidth={self.bandwidth:.3g}, t={self.timestamp:.3f})"
        )

    @classmethod
    def create(
        cls,
        identity: Identity,
        *,
        address: PeerAddress,
        run_id: str,
        device: str = "cpu",
        bandwidth: float = 0.0,
        version: str = __version__,
        extra: dict[str, Any] | None = None,
        timestamp: float | None = None,
    ) -> PeerRecord:
        """Build and sign a record for ``identity``.

        Raises:
            ConfigError: a field has the wrong type or is too large.
        """
        fields = dict(
            public_key=identity.public_key,
            agreement_key=identity.agreement_key,
            agreement_signature=identity.agreement_signature,
            address=address,
            run_id=run_id,
            device=device,
            bandwidth=float(bandwidth),
            version=version,
            extra=dict(extra or {}),
            timestamp=float(time.time() if timestamp is None else timestamp),
        )
        unsigned = cls(**fields, signature=bytes(SIGNATURE_BYTES))
        return cls(**fields, signature=identity.sign(CONTEXT + unsigned._body()))

    def _body(self) -> bytes:
        return wire.pack(
            [
                FORMAT,
                self.public_key,
                self.agreement_key,
                self.agreement_signature,
                self.address.host,
                self.address.port,
                self.run_id,
                self.device,
                self.bandwidth,
                self.version,
                self.extra,
                self.timestamp,
            ]
        )

    def aged(self, age_s: float) -> PeerRecord:
        """This record with the reader's ``age_s`` (a copy: the checks it passed still hold,
        as ``age_s`` is neither signed nor checked)."""
        record = copy.copy(self)
        object.__setattr__(record, "age_s", age_s)
        return record

    def serialize(self) -> bytes:
        return wire.pack([self._body(), self.signature])

    @classmethod
    def parse(cls, data: bytes, *, max_bytes: int = MAX_RECORD_BYTES) -> PeerRecord:
        """Decode and verify a record received from the network.

        Raises:
            TransportError: malformed (too long, wrong types or sizes, non-canonical encoding).
            AuthError: the record or its agreement key is not signed by its ``public_key``.
        """
        # oversized bytes are not hashed (no entry has a digest of b""); unpack refuses them
        seen = hashlib.blake2b(data, digest_size=32).digest() if len(data) <= max_bytes else b""
        known = _VERIFIED.get(seen)
        if known is not None:  # these exact bytes passed every check before
            return known
        outer = wire.unpack(data, max_bytes=max_bytes, what="peer record")
        if not (isinstance(outer, list) and len(outer) == 2 and _all_bytes(outer)):
            raise TransportError("peer record: expected [body, signature]")
        body, signature = outer
        fields = wire.unpack(body, max_bytes=max_bytes, what="peer record body")
        if not isinstance(fields, list) or len(fields) != 12 or fields[0] != FORMAT:
            raise TransportError(f"peer record: expected a format-{FORMAT} body of 12 fields")
        (_, public_key, agreement_key, agreement_sig, host, port, run_id, device) = fields[:8]
        (bandwidth, version, extra, timestamp) = fields[8:]
        if not isinstance(extra, dict) or not isinstance(host, str):
            raise TransportError("peer record: wrong field types")
        if isinstance(port, bool) or not isinstance(port, int):
            raise TransportError("peer record: wrong field types")
        try:
            record = cls(
                public_key=public_key,
                agreement_key=agreement_key,
                agreement_signature=agreement_sig,
                address=PeerAddress(host, port),
                run_id=run_id,
                device=device,
                bandwidth=bandwidth,
                version=version,
                extra=extra,
                timestamp=timestamp,
                signature=signature,
            )
        except ConfigError as e:
            raise TransportError(f"peer record: {e}") from e
        if record._body() != body:
            raise TransportError("peer record: non-canonical encoding")
        if not verify_signature(public_key, signature, CONTEXT + body):
            raise AuthError(f"peer record of {record.peer_id.short}: bad signature")
        binding = agreement_binding_message(public_key, agreement_key)
        if not verify_signature(public_key, agreement_sig, binding):
            raise AuthError(f"peer record of {record.peer_id.short}: agreement key not bound")
        _VERIFIED.put(seen, record)
        return record


# Every read of the peer list parses the same records again (a peer reads it every round and
# every probe period): the hashes of records whose signatures were verified skip the two
# Ed25519 checks (5% of the CPU of 16 peers in one process). Only verified bytes enter.
MAX_VERIFIED = 4096
# records parsed and verified lately, by a digest of their exact bytes: the same bytes come
# back in every read of the peer list (records are immutable; their extra is never mutated)
_VERIFIED: LRU[bytes, PeerRecord] = LRU(MAX_VERIFIED)


def _all_bytes(values: list[Any]) -> bool:
    return all(isinstance(v, bytes) for v in values)


def _check_extra(extra: Any) -> None:
    if not isinstance(extra, dict):
        raise ConfigError("record field extra must be a dict")
    for key in extra:
        if not isinstance(key, str) or len(key) > MAX_TEXT_CHARS:
            raise ConfigError(f"record extra keys must be text of <= {MAX_TEXT_CHARS} chars")
    try:
        packed = wire.pack(extra)
    except (TypeError, ValueError, OverflowError) as e:
        raise ConfigError(f"record extra must be msgpack-able: {e}") from e
    if len(packed) > MAX_EXTRA_BYTES:
        raise ConfigError(f"record extra is {len(packed)} bytes packed, over {MAX_EXTRA_BYTES}")
    check_extra_fields(extra)
