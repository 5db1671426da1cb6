"""Replies of the public routes (``/ping``, ``/info``) sealed for a keyed swarm.

Streams are sealed under a pairwise key, but a caller of ``/info`` may know only an address (it
asks in order to learn the peer's keys), so no pairwise secret exists yet. In a keyed swarm the
reply is sealed instead under a key derived from the swarm key, the caller's public key and the
request's nonce (HKDF, one key per request): any member could derive it, no outsider can, so an
eavesdropper without the key learns that a reply was sent and its size, never the record.
"""

from __future__ import annotations

import hashlib

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from swarm.auth import Membership
from swarm.errors import AuthError

_SALT_CONTEXT = b"swarm/public-reply-salt/v1"
_KEY_INFO = b"swarm/public-reply-key/v1"
_NONCE = bytes(12)  # the key is used once: a fixed AEAD nonce is safe


def _aead(membership: Membership, caller: bytes, request_nonce: bytes, path: str) -> AESGCM:
    if membership.swarm_key is None:
        raise AuthError("public replies are sealed only in a keyed swarm")
    salt = hashlib.sha256(_SALT_CONTEXT + caller + request_nonce).digest()
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=_KEY_INFO + path.encode())
    return AESGCM(hkdf.derive(membership.swarm_key))


def seal_reply(
    membership: Membership, *, caller: bytes, request_nonce: bytes, path: str, body: bytes
) -> bytes:
    """``body`` as sent to ``caller`` (its Ed25519 key): sealed when keyed, as is when open."""
    if membership.swarm_key is None:
        return body
    return _aead(membership, caller, request_nonce, path).encrypt(_NONCE, body, None)


def open_reply(
    membership: Membership, *, caller: bytes, request_nonce: bytes, path: str, body: bytes
) -> bytes:
    """The inverse of :func:`seal_reply`.

    Raises:
        AuthError: tampered, or sealed under another swarm key.
    """
    if membership.swarm_key is None:
        return body
    try:
        return _aead(membership, caller, request_nonce, path).decrypt(_NONCE, body, None)
    except InvalidTag:
        raise AuthError("sealed reply does not open (tampered, or another swarm key)") from None
