"""A peer's identity: an Ed25519 key pair kept in a key file, and the PeerID derived from it.

The PeerID is the SHA-256 of the raw 32-byte public key. Its text form is lowercase base32 without
padding (52 characters); :attr:`PeerID.short` is the first 10 of them, enough to tell peers apart
in logs and tables.

Besides the long-lived Ed25519 key, each running peer has an X25519 key made at start-up and signed
by its identity (:meth:`Identity.agreement_binding`). Two peers derive their pairwise session key
from their X25519 keys (see :mod:`swarm.auth`), so a restart also changes every session key.
"""

from __future__ import annotations

import base64
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from swarm.errors import IdentityError
from swarm.lru import LRU

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
PEER_ID_BYTES = 32
_AGREEMENT_CONTEXT = b"swarm/x25519-binding/v1"
# digests of signatures that verified lately (32 B each); a hit keeps one, so the records in
# use stay verified through a flood of fresh signatures (anyone can sign with a fresh key)
_VERIFIED: LRU[bytes, bool] = LRU(8192)
# X25519 secrets with the agreement keys of peers met lately: every stream derives its key from
# one (two exchanges per stream, 31 us each here, a third of a stream's crypto beside its
# signature)
_AGREED_CACHE = 4096


@dataclass(frozen=True, order=True)
class PeerID:
    """A peer's identifier: SHA-256 of its Ed25519 public key."""

    digest: bytes  # 32 bytes

    def __post_init__(self) -> None:
        if not isinstance(self.digest, bytes) or len(self.digest) != PEER_ID_BYTES:
            raise IdentityError(f"a PeerID is {PEER_ID_BYTES} bytes")

    @classmethod
    def from_public_key(cls, public_key: bytes) -> PeerID:
        if not isinstance(public_key, bytes) or len(public_key) != PUBLIC_KEY_BYTES:
            raise IdentityError(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} bytes")
        return cls(hashlib.sha256(public_key).digest())

    @classmethod
    def from_string(cls, text: str) -> PeerID:
        try:
            padded = text.upper() + "=" * (-len(text) % 8)
            return cls(base64.b32decode(padded))
        except (ValueError, TypeError) as e:
            raise IdentityError(f"not a PeerID: {text!r}") from e

    def __str__(self) -> str:
        return base64.b32encode(self.digest).decode().rstrip("=").lower()

    def __repr__(self) -> str:
        return f"PeerID({self.short})"

    @property
    def short(self) -> str:
        return str(self)[:10]


def verify_signature(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """True when ``signature`` is a valid Ed25519 signature of ``message`` by ``public_key``.

    Signatures that verified lately are remembered (a digest of all three, never the signature
    alone, which a liar can pair with another message): the same signed bytes come back many
    times (one record from every node that holds it, a peer's key binding in each request), and
    a check costs 50-250 us. A flood of fresh valid signatures only evicts entries; a bad
    signature is checked every time.
    """
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    seen = hashlib.blake2b(public_key + signature + message, digest_size=32).digest()
    if _VERIFIED.get(seen):
        return True
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    _VERIFIED.put(seen, True)
    return True


def agreement_binding_message(public_key: bytes, agreement_key: bytes) -> bytes:
    """The bytes an identity signs to vouch for its X25519 key."""
    return _AGREEMENT_CONTEXT + public_key + agreement_key


class Identity:
    """An Ed25519 key pair plus a per-process X25519 key for pairwise session keys."""

    def __init__(self, private_key: Ed25519PrivateKey):
        self._private_key = private_key
        self.public_key: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id = PeerID.from_public_key(self.public_key)
        self._agreement_private = X25519PrivateKey.generate()
        self.agreement_key: bytes = self._agreement_private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.agreement_signature: bytes = self.sign(
            agreement_binding_message(self.public_key, self.agreement_key)
        )
        self._agreed: LRU[bytes, bytes] = LRU(_AGREED_CACHE)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> Identity:
        """Load the key in ``path``, or create it (mode 0600) when the file does not exist.

        Raises:
            IdentityError: the file exists but is not a valid key; it is never replaced.
        """
        path = Path(path)
        if path.exists():
            return cls.load(path)
        identity = cls.generate()
        identity.save(path)
        return identity

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Identity:
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise IdentityError(f"cannot read key file {path}: {e}") from e
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as e:
            raise IdentityError(
                f"key file {path} is corrupt or not a PEM private key; "
                "restore it or point --identity at a new path"
            ) from e
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError(f"key file {path} holds a {type(key).__name__}, not Ed25519")
        return cls(key)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the private key to a new file readable by its owner only.

        Raises:
            IdentityError: the file exists already, or cannot be written.
        """
        path = Path(path)
        pem = self._private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError as e:
            raise IdentityError(f"key file {path} exists already; not overwriting it") from e
        except OSError as e:
            raise IdentityError(f"cannot create key file {path}: {e}") from e
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        if hasattr(os, "chmod"):  # umask may have widened it on some systems
            os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)

    def sign(self, message: bytes) -> bytes:
        return self._private_key.sign(message)

    def agree(self, peer_agreement_key: bytes) -> bytes:
        """X25519 shared secret with a peer's agreement key (raw 32 bytes), remembered for the
        peers met lately.

        Raises:
            IdentityError: not a valid X25519 key (not bytes, a wrong length, a low-order
                point); such a key is checked again each time.
        """
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

        if not isinstance(peer_agreement_key, bytes):
            raise IdentityError("an X25519 key from a peer must be bytes")
        shared = self._agreed.get(peer_agreement_key)
        if shared is None:
            try:
                peer = X25519PublicKey.from_public_bytes(peer_agreement_key)
                shared = self._agreement_private.exchange(peer)
            except ValueError as e:
                raise IdentityError("invalid X25519 key from peer") from e
            self._agreed.put(peer_agreement_key, shared)
        return shared

    def __repr__(self) -> str:
        return f"Identity({self.peer_id.short})"
