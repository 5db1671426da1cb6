import os
import stat
import sys

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from swarm import identity
from swarm.errors import IdentityError
from swarm.identity import Identity, PeerID, verify_signature
from swarm.lru import LRU


def test_key_file_created_private_and_reused(tmp_path):
    path = tmp_path / "keys" / "peer.key"
    first = Identity.load_or_create(path)
    if sys.platform != "win32":
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = Identity.load_or_create(path)
    assert again.peer_id == first.peer_id
    assert again.public_key == first.public_key


@pytest.mark.parametrize(
    "content", [b"", b"garbage", b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"]
)
def test_corrupt_key_file_is_an_error_and_is_kept(tmp_path, content):
    path = tmp_path / "peer.key"
    path.write_bytes(content)
    with pytest.raises(IdentityError, match="corrupt"):
        Identity.load_or_create(path)
    assert path.read_bytes() == content


def test_key_of_another_type_is_refused(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    path = tmp_path / "peer.key"
    key = ec.generate_private_key(ec.SECP256R1())
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    with pytest.raises(IdentityError, match="not Ed25519"):
        Identity.load(path)


def test_save_never_overwrites(tmp_path):
    path = tmp_path / "peer.key"
    Identity.generate().save(path)
    with pytest.raises(IdentityError, match="exists"):
        Identity.generate().save(path)


def test_peer_id_text_round_trip_and_short_form():
    identity = Identity.generate()
    text = str(identity.peer_id)
    assert len(text) == 52 and text == text.lower()
    assert PeerID.from_string(text) == identity.peer_id
    assert identity.peer_id.short == text[:10]
    with pytest.raises(IdentityError):
        PeerID.from_string("not a peer id!")
    with pytest.raises(IdentityError):
        PeerID(b"short")


def test_signatures_and_agreement():
    a, b = Identity.generate(), Identity.generate()
    sig = a.sign(b"hello")
    assert verify_signature(a.public_key, sig, b"hello")
    assert not verify_signature(b.public_key, sig, b"hello")
    assert not verify_signature(a.public_key, sig, b"hellO")
    assert not verify_signature(a.public_key, sig[:10], b"hello")
    assert a.agree(b.agreement_key) == b.agree(a.agreement_key)


def test_remembered_signatures_still_bind_their_key_and_message():
    """A signature that verified is remembered, but only with its own key and message: paired
    with another message or key, or flipped, it is checked again and refused, every time."""
    a, b = Identity.generate(), Identity.generate()
    sig = a.sign(b"record v1")
    for _ in range(2):  # the second pass answers from what the first remembered
        assert verify_signature(a.public_key, sig, b"record v1")
        assert not verify_signature(a.public_key, sig, b"record v2")
        assert not verify_signature(b.public_key, sig, b"record v1")
        assert not verify_signature(a.public_key, bytes([sig[0] ^ 1]) + sig[1:], b"record v1")


def test_remembered_signatures_are_bounded_and_those_in_use_stay(monkeypatch):
    """A flood of fresh signatures only evicts, and a signature checked again meanwhile (a
    record read every round) outlives it."""
    monkeypatch.setattr(identity, "_VERIFIED", LRU(4))
    a = Identity.generate()
    hot = (a.sign(b"hot"), b"hot")
    signed = [(a.sign(m), m) for m in (b"%d" % i for i in range(10))]
    assert verify_signature(a.public_key, *hot)
    for sig, m in signed:
        assert verify_signature(a.public_key, sig, m)
        assert verify_signature(a.public_key, *hot)  # used again: kept
    assert len(identity._VERIFIED) == 4
    checked = []
    monkeypatch.setattr(Ed25519PublicKey, "from_public_bytes", _counting(checked))
    assert verify_signature(a.public_key, *hot) and not checked  # answered from memory
    assert all(verify_signature(a.public_key, sig, m) for sig, m in reversed(signed))
    assert len(checked) == 7  # the 3 latest of the flood were remembered, the rest checked


def _counting(calls: list[bytes]):
    real = Ed25519PublicKey.from_public_bytes

    def from_public_bytes(data: bytes) -> Ed25519PublicKey:
        calls.append(data)
        return real(data)

    return from_public_bytes


def test_remembered_agreements_are_bounded_and_never_remember_a_bad_key(monkeypatch):
    """Secrets with peers met lately are remembered (a stream derives its key from one), each
    the exchange's own; a bad key is refused every time, and a flood of keys only evicts."""
    monkeypatch.setattr(identity, "_AGREED_CACHE", 3)
    me, peers = Identity.generate(), [Identity.generate() for _ in range(5)]
    exchanges = _CountedExchanges(me._agreement_private)
    me._agreement_private = exchanges
    for _ in range(2):  # the second pass answers from what the first remembered
        for p in peers[:3]:
            assert me.agree(p.agreement_key) == p.agree(me.agreement_key)
    assert exchanges.count == 3
    for p in peers:  # three hits, and two more peers evict the two least recently used
        assert me.agree(p.agreement_key) == p.agree(me.agreement_key)
    assert len(me._agreed) == 3 and exchanges.count == 5
    assert me.agree(peers[0].agreement_key) == peers[0].agree(me.agreement_key)
    assert exchanges.count == 6  # forgotten: exchanged again
    for bad in (bytes(32), b"short", bytearray(peers[0].agreement_key), 7):
        for _ in range(2):
            with pytest.raises(IdentityError):
                me.agree(bad)  # type: ignore[arg-type]
    assert len(me._agreed) == 3 and bytes(32) not in me._agreed


class _CountedExchanges:
    """An X25519 private key that counts its exchanges."""

    def __init__(self, key):
        self.key, self.count = key, 0

    def exchange(self, peer):
        self.count += 1
        return self.key.exchange(peer)


def test_a_bounded_cache_forgets_the_least_recently_used_entry():
    cache: LRU[str, int] = LRU(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # a hit: "b" is now the oldest
    cache.put("c", 3)
    assert "a" in cache and "c" in cache and "b" not in cache and len(cache) == 2
    assert cache.get("b") is None
    assert "a" in cache and cache.put("d", 4) is None and "a" not in cache  # a test is no hit
    with pytest.raises(ValueError):
        cache.put("e", None)  # type: ignore[arg-type]
