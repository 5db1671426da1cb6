"""Authenticated DHT datagrams (sans-I/O): sealing, parsing and checking one UDP datagram.

Wire form: ``msgpack([signed, tag])`` where ``signed`` is the msgpack list::

    [VERSION, kind, msg_id, public_key, agreement_key, agreement_signature, target, timestamp,
     nonce, body]

- ``kind`` is 0 for a request and 1 for a response; ``msg_id`` (16 B) pairs them.
- ``public_key``/``agreement_key``/``agreement_signature``: the sender's Ed25519 key, its process's
  X25519 key and the signature binding the two (see "Bindings" below).
- ``target``: the receiver's X25519 key when the sender knows it, else empty.
- ``timestamp`` and ``nonce`` (16 B) feed the replay guard: a seen nonce, or a timestamp outside
  the window, is refused.
- ``tag``: with a target, HMAC-SHA256 of ``signed`` under the pairwise key (HKDF over the X25519
  secret of the two peers and, in a keyed swarm, the swarm key). Without one, the sender's Ed25519
  signature of ``signed`` followed by the swarm-key MAC when keyed. Only a ``ping`` may be sent
  without a target (the first contact with a bare ``HOST:PORT``); every other datagram is MAC'd.

In a keyed swarm the whole datagram is then sealed with AES-GCM under a key derived from the swarm
key (a random 12-byte nonce in front), so an eavesdropper without the key reads no field of it:
neither the records nor who is talking; and a datagram from outside is refused after one AEAD.

Why a pairwise MAC and not a signature per datagram: one HMAC costs ~2 us where an Ed25519 sign
plus verify costs ~150 us, and a lookup exchanges dozens of datagrams. The X25519 agreement is
paid once per pair of processes.

Bindings: a valid MAC proves that the sender holds the private half of ``agreement_key``; the
binding signature proves that this key speaks for ``public_key``. That matters only where the
public key is a credential: in an allow-list swarm, where it decides admission, the binding is
checked once per sender (then cached) before its first MAC. In an open or keyed swarm anyone (any
member) can make a key pair, so a borrowed public key buys nothing; the node id hashes both keys,
so it cannot be borrowed either. Checking it there cost an Ed25519 verify (~100 us, three times
the agreement) at both ends of every new pair, the largest CPU cost of a lookup's first contacts.
A signed first-contact ping still has its binding checked.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from swarm import strict_msgpack
from swarm.auth import NONCE_BYTES, Membership, ReplayGuard, derive_pairwise_key
from swarm.errors import AuthError, DHTError
from swarm.identity import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    Identity,
    agreement_binding_message,
    verify_signature,
)
from swarm.lru import LRU

VERSION = 1
REQUEST, RESPONSE = 0, 1
MSG_ID_BYTES = 16
AGREEMENT_KEY_BYTES = 32
MAX_DATAGRAM_BYTES = 65_000  # larger datagrams are dropped unread
MAX_REQUEST_BYTES = 8192  # kademlia's cap on a request; records must fit in one
ENVELOPE_OVERHEAD = 400  # room kept for the envelope around a body, in answers and stores
_MAC_BYTES = 32
_SIG_CONTEXT = b"swarm/dht-datagram/v1"
_SALT_CONTEXT = b"swarm/dht-pair-salt/v1"
_KEY_INFO = b"swarm/dht-pair-key/v1"
_CACHE_SIZE = 8192
_AEAD_KEY_INFO = b"swarm/dht-seal-key/v1"
_AEAD_CONTEXT = b"swarm/dht-seal/v1"
_AEAD_NONCE_BYTES = 12


@dataclass(frozen=True)
class SenderKeys:
    """Who sent a datagram (its binding verified)."""

    public_key: bytes  # 32 B Ed25519
    agreement_key: bytes  # 32 B X25519 of the sender's process
    agreement_signature: bytes  # 64 B


@dataclass(frozen=True)
class Datagram:
    """An opened, authenticated datagram."""

    kind: int  # REQUEST or RESPONSE
    msg_id: bytes  # 16 B, pairs a response with its request
    sender: SenderKeys
    targeted: bool  # True when MAC'd for us; False for a signed first-contact ping
    body: Any  # the decoded msgpack payload


class DatagramAuth:
    """Seals outgoing datagrams and opens incoming ones for one node.

    Args:
        identity: this node's keys.
        membership: open swarm, swarm key or allow-list.
        replay_window_s: accepted clock difference; also how long nonces are remembered.
    """

    def __init__(self, identity: Identity, membership: Membership, replay_window_s: float = 30.0):
        self.identity = identity
        self.membership = membership
        self._replay = ReplayGuard(replay_window_s)
        self._swarm_aead = _swarm_aead(membership)
        # (public, agreement, signature) -> True; (public, agreement) -> 32 B MAC key
        self._bindings: LRU[tuple[bytes, bytes, bytes], bool] = LRU(_CACHE_SIZE)
        self._pair_keys: LRU[tuple[bytes, bytes], bytes] = LRU(_CACHE_SIZE)
        self._bindings_matter = membership.mode == "allowlist"  # see "Bindings" above

    @property
    def keys(self) -> SenderKeys:
        i = self.identity
        return SenderKeys(i.public_key, i.agreement_key, i.agreement_signature)

    def seal(
        self,
        kind: int,
        msg_id: bytes,
        body: Any,
        target: SenderKeys | None,
        *,
        timestamp: float | None = None,
    ) -> bytes:
        """Pack, authenticate and frame one datagram to ``target`` (None: unknown receiver).

        ``timestamp`` is the send time (default: now); tests stamp stale or future times, as a
        hostile sender can."""
        i = self.identity
        signed = msgpack.packb(
            [
                VERSION,
                kind,
                msg_id,
                i.public_key,
                i.agreement_key,
                i.agreement_signature,
                target.agreement_key if target is not None else b"",
                time.time() if timestamp is None else timestamp,
                os.urandom(NONCE_BYTES),
                body,
            ],
            use_bin_type=True,
        )
        if target is not None:
            tag = hmac.digest(self._pair_key(target), signed, "sha256")
        else:
            message = _SIG_CONTEXT + signed
            tag = i.sign(message) + self.membership.mac(_SIG_CONTEXT, signed)
        datagram = msgpack.packb([signed, tag], use_bin_type=True)
        if self._swarm_aead is not None:
            nonce = os.urandom(_AEAD_NONCE_BYTES)
            datagram = nonce + self._swarm_aead.encrypt(nonce, datagram, _AEAD_CONTEXT)
        return datagram

    def open(self, data: bytes, may_verify: Callable[[], bool] | None = None) -> Datagram:
        """Check and decode a datagram.

        Args:
            data: the datagram.
            may_verify: asked before any public-key work (a signature check, or a key agreement
                with a sender not seen before); False refuses the datagram. Cheap checks (sizes,
                the swarm-key MAC, a cached pairwise MAC) come first and are never metered.

        Raises:
            DHTError: malformed (size, msgpack, types).
            AuthError: bad MAC or signature, not admitted, not for us, or replayed.
        """
        if len(data) > MAX_DATAGRAM_BYTES:
            raise DHTError(f"datagram of {len(data)} bytes is too large")
        if self._swarm_aead is not None:  # the cheapest check first, and it hides everything
            if len(data) < _AEAD_NONCE_BYTES + 16:
                raise AuthError("datagram too short to be sealed")
            nonce = data[:_AEAD_NONCE_BYTES]
            try:
                data = self._swarm_aead.decrypt(nonce, data[_AEAD_NONCE_BYTES:], _AEAD_CONTEXT)
            except InvalidTag:
                raise AuthError("datagram does not open (wrong swarm key, or tampered)") from None
        outer = strict_msgpack.unpack(data, DHTError, "datagram")
        if not isinstance(outer, list) or len(outer) != 2:
            raise DHTError("a datagram is [signed, tag]")
        signed, tag = outer
        if not isinstance(signed, bytes) or not isinstance(tag, bytes):
            raise DHTError("a datagram is [signed bytes, tag bytes]")
        fields = strict_msgpack.unpack(signed, DHTError, "datagram header")
        if not isinstance(fields, list) or len(fields) != 10:
            raise DHTError("malformed datagram header")
        version, kind, msg_id, public, agreement, binding, target, ts, nonce, body = fields
        if version != VERSION:
            raise DHTError(f"unsupported datagram version {version!r}")
        if kind not in (REQUEST, RESPONSE) or isinstance(kind, bool):
            raise DHTError("datagram kind must be 0 or 1")
        _check_bytes(msg_id, (MSG_ID_BYTES,), "msg_id")
        _check_bytes(public, (PUBLIC_KEY_BYTES,), "public_key")
        _check_bytes(agreement, (AGREEMENT_KEY_BYTES,), "agreement_key")
        _check_bytes(binding, (SIGNATURE_BYTES,), "agreement_signature")
        _check_bytes(target, (0, AGREEMENT_KEY_BYTES), "target")
        _check_bytes(nonce, (NONCE_BYTES,), "nonce")
        if isinstance(ts, bool) or not isinstance(ts, (int, float)):
            raise DHTError("timestamp must be a number")
        sender = SenderKeys(public, agreement, binding)
        if public == self.identity.public_key and agreement == self.identity.agreement_key:
            raise AuthError("datagram claims to come from this node (reflected)")
        if target:
            if target != self.identity.agreement_key:
                raise AuthError("datagram is addressed to another node")
            if not self._knows(sender) and may_verify is not None and not may_verify():
                raise AuthError("public-key work budget of this source is spent")
            expected = hmac.digest(self._pair_key(sender), signed, "sha256")
            if not hmac.compare_digest(tag, expected):
                raise AuthError("bad datagram MAC (tampered, or wrong swarm key)")
        else:
            signature, mac = tag[:SIGNATURE_BYTES], tag[SIGNATURE_BYTES:]
            self.membership.check_mac(mac, _SIG_CONTEXT, signed)
            if may_verify is not None and not may_verify():
                raise AuthError("public-key work budget of this source is spent")
            if not verify_signature(public, signature, _SIG_CONTEXT + signed):
                raise AuthError("bad datagram signature")
            self._check_binding(sender)
        self.membership.check_admitted(public)
        self._replay.check(float(ts), nonce, sender=public + agreement)
        return Datagram(kind, msg_id, sender, bool(target), body)

    def _knows(self, peer: SenderKeys) -> bool:
        """Whether the pairwise key with ``peer`` is cached (no public-key work to open)."""
        return (peer.public_key, peer.agreement_key) in self._pair_keys

    def binds(self, keys: SenderKeys, may_verify: Callable[[], bool]) -> bool:
        """Whether ``keys.public_key`` signed ``keys.agreement_key``, so that a datagram MAC'd
        under that agreement key was sent by the public key's owner (cached; ``may_verify`` is
        asked before the check). Open swarms skip this on every datagram (see "Bindings"); a
        store that claims to come from an entry's owner needs it."""
        if (keys.public_key, keys.agreement_key, keys.agreement_signature) in self._bindings:
            return True
        if not may_verify():
            return False
        try:
            self._check_binding(keys)
        except AuthError:
            return False
        return True

    def _check_binding(self, keys: SenderKeys) -> None:
        cache_key = (keys.public_key, keys.agreement_key, keys.agreement_signature)
        if cache_key in self._bindings:
            return
        message = agreement_binding_message(keys.public_key, keys.agreement_key)
        if not verify_signature(keys.public_key, keys.agreement_signature, message):
            raise AuthError("agreement key not signed by its owner")
        self._bindings.put(cache_key, True)

    def _pair_key(self, peer: SenderKeys) -> bytes:
        cache_key = (peer.public_key, peer.agreement_key)
        key = self._pair_keys.get(cache_key)
        if key is not None:
            return key
        if self._bindings_matter:
            self._check_binding(peer)
        ours = self.identity.public_key + self.identity.agreement_key
        theirs = peer.public_key + peer.agreement_key
        salt = hashlib.sha256(_SALT_CONTEXT + min(ours, theirs) + max(ours, theirs)).digest()
        key = derive_pairwise_key(
            self.identity, self.membership, peer.agreement_key, salt, _KEY_INFO, _MAC_BYTES
        )
        self._pair_keys.put(cache_key, key)
        return key


def _swarm_aead(membership: Membership) -> AESGCM | None:
    """In a keyed swarm, the AEAD every datagram is sealed with, so that an eavesdropper
    without the key learns addresses and sizes only (who talks, not what is said or stored).
    Inside it, a datagram keeps its pairwise MAC (or signature): the seal keeps outsiders out,
    the MAC says which member sent it."""
    if membership.swarm_key is None:
        return None
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_AEAD_KEY_INFO)
    return AESGCM(hkdf.derive(membership.swarm_key))


def _check_bytes(value: Any, sizes: tuple[int, ...], name: str) -> None:
    if not isinstance(value, bytes) or len(value) not in sizes:
        raise DHTError(f"malformed datagram field {name}")
