"""Swarm membership, replay protection and the keyed checks shared by the DHT and HTTP layers.

Membership modes:

- ``open``: anyone may join; signatures still stop impersonation.
- ``key``: a shared secret (the swarm key). Every datagram and request carries a MAC under it, so
  peers without the key are refused before anything else is looked at.
- ``allowlist``: only the listed Ed25519 public keys are admitted.

HTTP requests (see :mod:`swarm.net.transport`) carry a :class:`RequestAuth` header: the sender's
Ed25519 public key, its X25519 agreement key and the signature binding the two, the target peer,
a timestamp, a 16-byte nonce, the method, path and stream cipher, all signed by the sender and,
in a keyed swarm, MAC'd under the swarm key (checked first, so outsiders cost one HMAC). Stream
bodies are sealed under :func:`derive_stream_key`: HKDF over the X25519 secret of the two peers,
bound to both identities, the swarm key and the request nonce (one key per stream).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import math
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from swarm import strict_msgpack
from swarm.errors import AuthError, ConfigError, IdentityError, ReplayError
from swarm.identity import (
    PEER_ID_BYTES,
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    Identity,
    agreement_binding_message,
    verify_signature,
)

logger = logging.getLogger(__name__)

MembershipMode = Literal["open", "key", "allowlist"]
MIN_SWARM_KEY_BYTES = 16
NONCE_BYTES = 16


@dataclass(frozen=True)
class Membership:
    """Who may join a swarm."""

    mode: MembershipMode = "open"
    swarm_key: bytes | None = field(default=None, repr=False)  # shared secret, mode "key" only
    allowed: frozenset[bytes] = frozenset()  # Ed25519 public keys, mode "allowlist" only

    def __post_init__(self) -> None:
        if self.mode not in ("open", "key", "allowlist"):
            raise ConfigError(f"unknown membership mode {self.mode!r}")
        if self.mode == "key":
            if not isinstance(self.swarm_key, bytes) or len(self.swarm_key) < MIN_SWARM_KEY_BYTES:
                raise ConfigError(f"a swarm key must be at least {MIN_SWARM_KEY_BYTES} bytes")
        elif self.swarm_key is not None:
            raise ConfigError("swarm_key is only used with mode='key'")
        if self.mode == "allowlist":
            if not self.allowed:
                raise ConfigError("an allow-list needs at least one public key")
            if any(not isinstance(k, bytes) or len(k) != 32 for k in self.allowed):
                raise ConfigError("allow-list entries are 32-byte Ed25519 public keys")
        elif self.allowed:
            raise ConfigError("allowed keys are only used with mode='allowlist'")

    @classmethod
    def open(cls) -> Membership:
        return cls("open")

    @classmethod
    def with_key(cls, swarm_key: bytes | str) -> Membership:
        """A swarm whose members share ``swarm_key`` (any text or bytes, >= 16 bytes)."""
        if isinstance(swarm_key, str):
            swarm_key = swarm_key.strip().encode()
        return cls("key", swarm_key=swarm_key)

    @classmethod
    def allow_list(cls, public_keys: frozenset[bytes] | set[bytes] | list[bytes]) -> Membership:
        return cls("allowlist", allowed=frozenset(public_keys))

    def admits(self, public_key: bytes) -> bool:
        """Whether the holder of ``public_key`` may take part (the swarm key is checked apart)."""
        return self.mode != "allowlist" or public_key in self.allowed

    def check_admitted(self, public_key: bytes) -> None:
        if not self.admits(public_key):
            raise AuthError("public key is not on this swarm's allow-list")

    def mac(self, *parts: bytes) -> bytes:
        """HMAC-SHA256 under the swarm key over ``parts`` (empty bytes in an unkeyed swarm)."""
        if self.swarm_key is None:
            return b""
        mac = hmac.new(self.swarm_key, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(len(part).to_bytes(4, "big"))
            mac.update(part)
        return mac.digest()

    def check_mac(self, tag: bytes, *parts: bytes) -> None:
        """Raise :class:`AuthError` unless ``tag`` is the swarm-key MAC of ``parts``."""
        if self.swarm_key is None:
            return
        if not isinstance(tag, bytes) or not hmac.compare_digest(tag, self.mac(*parts)):
            raise AuthError("missing or wrong swarm key")

    @property
    def key_fingerprint(self) -> bytes:
        """Public, non-secret tag of the swarm key (lets peers tell 'wrong key' apart in logs)."""
        if self.swarm_key is None:
            return b""
        return hashlib.sha256(b"swarm/key-fingerprint/v1" + self.swarm_key).digest()[:8]


class ReplayGuard:
    """Refuses a (timestamp, nonce) pair that is outside the window or was seen before.

    Nonces are kept per sender (its public key), so that no sender can flood the guard into
    refusing the others: each sender keeps at most ``max_per_sender`` nonces, and when it sends
    more inside one window its oldest are forgotten and timestamps before them refused, for that
    sender only. At most ``max_entries`` nonces are kept in all; past that the least recently
    active sender is forgotten whole, remembering only the newest timestamp it used (later
    messages from it must be newer: an idle sender rarely has older ones in flight).
    """

    def __init__(
        self,
        window_s: float = 30.0,
        max_entries: int = 200_000,
        max_per_sender: int = 4096,
        max_forgotten: int = 65_536,
    ):
        if window_s <= 0:
            raise ConfigError("the replay window must be positive")
        self.window_s = window_s
        self.max_entries = max_entries
        self.max_per_sender = max_per_sender
        self.max_forgotten = max_forgotten
        self._senders: OrderedDict[bytes, _SenderNonces] = OrderedDict()
        self._forgotten: OrderedDict[bytes, float] = OrderedDict()  # sender -> newest timestamp
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def check(
        self, timestamp: float, nonce: bytes, *, sender: bytes = b"", now: float | None = None
    ) -> None:
        """Record the pair for ``sender``, or raise :class:`ReplayError` when it must be
        refused."""
        now = time.time() if now is None else now
        if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
            raise AuthError(f"a nonce is {NONCE_BYTES} bytes")
        if not isinstance(timestamp, (int, float)) or timestamp != timestamp:
            raise AuthError("timestamp is not a number")
        if abs(now - timestamp) > self.window_s:
            raise ReplayError(
                f"timestamp {timestamp:.3f} is {now - timestamp:+.1f} s from now, "
                f"outside the {self.window_s:.0f} s window (check the clocks)"
            )
        self._forget_idle(now - self.window_s)
        seen = self._senders.get(sender)
        if seen is None:
            seen = _SenderNonces(self._forgotten.pop(sender, float("-inf")))
            self._senders[sender] = seen
        self._senders.move_to_end(sender)
        self._count -= seen.expire(now - self.window_s)
        if timestamp <= seen.floor:
            raise ReplayError("timestamp is older than this sender's forgotten nonces")
        if nonce in seen.nonces:
            raise ReplayError("nonce seen before (replayed message)")
        seen.nonces[nonce] = timestamp
        seen.newest = max(seen.newest, timestamp)
        self._count += 1
        if len(seen.nonces) > self.max_per_sender:
            _, evicted_ts = seen.nonces.popitem(last=False)
            seen.floor = max(seen.floor, evicted_ts)
            self._count -= 1
        while self._count > self.max_entries and len(self._senders) > 1:
            old_sender, old = self._senders.popitem(last=False)
            self._count -= len(old.nonces)
            newest = max(old.nonces.values(), default=old.floor)
            self._forgotten[old_sender] = max(newest, old.floor)
            while len(self._forgotten) > self.max_forgotten:
                self._forgotten.popitem(last=False)

    def _forget_idle(self, horizon: float) -> None:
        """Drop the least recently active senders whose every timestamp is older than
        ``horizon``: the window refuses them all anyway (a sender that left sends no more
        messages, which is what expired its nonces before)."""
        while self._senders:
            sender, seen = next(iter(self._senders.items()))
            if max(seen.newest, seen.floor) >= horizon:
                return
            del self._senders[sender]
            self._count -= len(seen.nonces)


class _SenderNonces:
    """One sender's nonces (insertion order is close to timestamp order) and its floor."""

    __slots__ = ("floor", "newest", "nonces")

    def __init__(self, floor: float):
        self.floor = floor  # timestamps up to this are refused: their nonces were forgotten
        self.newest = floor  # the newest timestamp seen
        self.nonces: OrderedDict[bytes, float] = OrderedDict()

    def expire(self, limit: float) -> int:
        """Drop nonces older than ``limit``; returns how many."""
        dropped = 0
        while self.nonces:
            nonce, ts = next(iter(self.nonces.items()))
            if ts >= limit:
                break
            del self.nonces[nonce]
            dropped += 1
        return dropped


AUTH_HEADER = "X-Swarm-Auth"
MAX_AUTH_HEADER_CHARS = 1024
STREAM_KEY_BYTES = 32
_REQUEST_CONTEXT = b"swarm/http-request/v1"
_MAC_CONTEXT = b"swarm/http-mac/v1"
_SALT_CONTEXT = b"swarm/stream-salt/v1"
_KEY_CONTEXT = b"swarm/stream-key/v1"
_MAX_PATH_CHARS = 128
_MAX_NAME_CHARS = 32


@dataclass(frozen=True)
class RequestAuth:
    """The signed ``X-Swarm-Auth`` header of one HTTP request.

    ``nonce`` doubles as the stream id: the stream key and every chunk's AAD are bound to it.
    """

    public_key: bytes  # 32 B Ed25519 of the sender
    agreement_key: bytes  # 32 B X25519 of the sender's process
    agreement_signature: bytes  # 64 B: sender's signature binding agreement_key to public_key
    target: bytes  # 32 B PeerID digest of the receiver, or b"" (only /ping and /info accept it)
    timestamp: float  # sender's time.time(); refused outside the replay window
    nonce: bytes  # 16 random bytes, never reused; the stream id
    method: str  # "GET", "POST"
    path: str  # "/ping", "/stream/swarm.state", ...
    cipher: str  # AEAD of the stream body, e.g. "aes-256-gcm"
    signature: bytes = field(repr=False)  # 64 B Ed25519 over the fields above
    swarm_mac: bytes = field(default=b"", repr=False)  # HMAC under the swarm key, b"" when open

    @classmethod
    def create(
        cls,
        identity: Identity,
        membership: Membership,
        *,
        target: bytes,
        method: str,
        path: str,
        cipher: str,
        timestamp: float | None = None,
        nonce: bytes | None = None,
    ) -> RequestAuth:
        fields = dict(
            public_key=identity.public_key,
            agreement_key=identity.agreement_key,
            agreement_signature=identity.agreement_signature,
            target=target,
            timestamp=float(time.time() if timestamp is None else timestamp),
            nonce=os.urandom(NONCE_BYTES) if nonce is None else nonce,
            method=method,
            path=path,
            cipher=cipher,
        )
        message = _REQUEST_CONTEXT + _pack_fields(fields)
        return cls(
            **fields,
            signature=identity.sign(message),
            swarm_mac=membership.mac(_MAC_CONTEXT, message),
        )

    def _fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _SIGNED_FIELDS}

    def encode(self) -> str:
        """The header value: unpadded URL-safe base64 of a msgpack list."""
        raw = msgpack.packb(
            [*self._fields().values(), self.signature, self.swarm_mac], use_bin_type=True
        )
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")

    @classmethod
    def decode(cls, text: str) -> RequestAuth:
        """Parse a header value; every type and size is checked.

        Raises:
            AuthError: missing, too long, not base64, not msgpack, or wrong types/sizes.
        """
        if not isinstance(text, str) or not text:
            raise AuthError(f"missing {AUTH_HEADER} header")
        if len(text) > MAX_AUTH_HEADER_CHARS:
            raise AuthError(f"{AUTH_HEADER} header of {len(text)} chars is too long")
        try:
            raw = base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)
        except (ValueError, binascii.Error) as e:
            raise AuthError(f"malformed {AUTH_HEADER} header ({type(e).__name__})") from e
        values = strict_msgpack.unpack(raw, AuthError, f"{AUTH_HEADER} header")
        if not isinstance(values, list) or len(values) != len(_SIGNED_FIELDS) + 2:
            raise AuthError(f"malformed {AUTH_HEADER} header (wrong shape)")
        fields = dict(zip(_SIGNED_FIELDS, values, strict=False))
        signature, swarm_mac = values[-2:]
        _check_fields(fields)
        if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
            raise AuthError(f"malformed {AUTH_HEADER} header (signature)")
        if not isinstance(swarm_mac, bytes) or len(swarm_mac) > 64:
            raise AuthError(f"malformed {AUTH_HEADER} header (swarm MAC)")
        return cls(**fields, signature=signature, swarm_mac=swarm_mac)

    def verify(self, membership: Membership, *, method: str, path: str) -> None:
        """Check the swarm-key MAC, the signatures, the method and the path.

        The caller then checks the target, the replay window and admission (403 vs 401).

        Raises:
            AuthError: any check fails.
        """
        message = _REQUEST_CONTEXT + _pack_fields(self._fields())
        membership.check_mac(self.swarm_mac, _MAC_CONTEXT, message)
        if not verify_signature(self.public_key, self.signature, message):
            raise AuthError("bad request signature")
        binding = agreement_binding_message(self.public_key, self.agreement_key)
        if not verify_signature(self.public_key, self.agreement_signature, binding):
            raise AuthError("agreement key not signed by the sender")
        if self.method != method or self.path != path:
            raise AuthError(f"request signed for {self.method} {self.path}, not {method} {path}")


_SIGNED_FIELDS = (
    "public_key",
    "agreement_key",
    "agreement_signature",
    "target",
    "timestamp",
    "nonce",
    "method",
    "path",
    "cipher",
)


def _pack_fields(fields: dict[str, Any]) -> bytes:
    return msgpack.packb(list(fields.values()), use_bin_type=True)


def _check_fields(f: dict[str, Any]) -> None:
    sizes = {
        "public_key": (PUBLIC_KEY_BYTES,),
        "agreement_key": (32,),
        "agreement_signature": (SIGNATURE_BYTES,),
        "target": (0, PEER_ID_BYTES),
        "nonce": (NONCE_BYTES,),
    }
    for name, allowed in sizes.items():
        if not isinstance(f[name], bytes) or len(f[name]) not in allowed:
            raise AuthError(f"malformed {AUTH_HEADER} header ({name})")
    ts = f["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        raise AuthError(f"malformed {AUTH_HEADER} header (timestamp)")
    f["timestamp"] = float(ts)
    limits = {"method": 8, "path": _MAX_PATH_CHARS, "cipher": _MAX_NAME_CHARS}
    for name, limit in limits.items():
        if not isinstance(f[name], str) or not 0 < len(f[name]) <= limit:
            raise AuthError(f"malformed {AUTH_HEADER} header ({name})")


def derive_stream_key(
    identity: Identity,
    membership: Membership,
    *,
    peer_public_key: bytes,
    peer_agreement_key: bytes,
    initiator: bool,
    stream_id: bytes,
    cipher: str,
) -> bytes:
    """The 32-byte AEAD key of one stream between this peer and another.

    HKDF-SHA256 over the X25519 secret (plus the swarm key when keyed), salted with both peers'
    Ed25519 and X25519 keys in (initiator, responder) order, with the cipher and the stream id in
    ``info``: each stream gets a fresh key, and only the two peers (and, when keyed, only members)
    can derive it. Both directions use this key; chunk nonces carry the direction.

    Raises:
        AuthError: the peer's agreement key is invalid (e.g. a low-order point).
    """
    mine = identity.public_key + identity.agreement_key
    theirs = peer_public_key + peer_agreement_key
    ordered = mine + theirs if initiator else theirs + mine
    salt = hashlib.sha256(_SALT_CONTEXT + ordered).digest()
    info = _KEY_CONTEXT + cipher.encode() + b"\0" + stream_id
    return derive_pairwise_key(
        identity, membership, peer_agreement_key, salt, info, STREAM_KEY_BYTES
    )


def derive_pairwise_key(
    identity: Identity,
    membership: Membership,
    peer_agreement_key: bytes,
    salt: bytes,
    info: bytes,
    length: int,
) -> bytes:
    """A key only this peer and the owner of ``peer_agreement_key`` can derive.

    HKDF-SHA256 over their X25519 secret, plus the swarm key when keyed (so only members can
    derive it); ``salt`` binds the two identities and ``info`` the key's use. Shared by the HTTP
    streams (:func:`derive_stream_key`) and the DHT datagrams (:mod:`swarm.dht.envelope`).

    Raises:
        AuthError: the peer's agreement key is invalid (e.g. a low-order point).
    """
    try:
        shared = identity.agree(peer_agreement_key)
    except IdentityError as e:
        raise AuthError(str(e)) from e
    hkdf = HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info)
    return hkdf.derive(shared + (membership.swarm_key or b""))
