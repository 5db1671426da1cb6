"""Membership, replay window, request auth headers, stream keys and sealed frames (no sockets)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import os
import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.auth import (
    Membership,
    ReplayGuard,
    RequestAuth,
    derive_stream_key,
)
from swarm.errors import AuthError, ConfigError, ReplayError, TransportError
from swarm.identity import Identity
from swarm.net.frames import (
    CIPHERS,
    DATA,
    END,
    HEADER,
    TO_CLIENT,
    TO_SERVER,
    Opener,
    Sealer,
    make_aead,
)

KEY = Membership.with_key("correct horse battery staple")
ALICE, BOB = Identity.generate(), Identity.generate()


def _auth(membership: Membership = KEY, **overrides: object) -> RequestAuth:
    args = dict(target=BOB.peer_id.digest, method="POST", path="/stream/x", cipher="aes-256-gcm")
    args.update(overrides)
    return RequestAuth.create(ALICE, membership, **args)  # type: ignore[arg-type]


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


# ---- membership and replay


def test_membership_modes() -> None:
    assert Membership.open().admits(ALICE.public_key)
    allow = Membership.allow_list([ALICE.public_key])
    assert allow.admits(ALICE.public_key) and not allow.admits(BOB.public_key)
    with pytest.raises(ConfigError):
        Membership.with_key("short")
    with pytest.raises(ConfigError):
        Membership("allowlist")


def test_replay_guard_refuses_seen_nonce_and_old_timestamp() -> None:
    guard = ReplayGuard(window_s=30)
    nonce = os.urandom(16)
    guard.check(1000.0, nonce, now=1000.0)
    with pytest.raises(ReplayError):
        guard.check(1000.0, nonce, now=1001.0)
    with pytest.raises(ReplayError):
        guard.check(900.0, os.urandom(16), now=1000.0)
    with pytest.raises(AuthError):
        guard.check(1000.0, b"short", now=1000.0)


# ---- request auth header


def test_request_auth_round_trip_and_verify() -> None:
    auth = _auth()
    decoded = RequestAuth.decode(auth.encode())
    assert decoded == auth
    decoded.verify(KEY, method="POST", path="/stream/x")
    assert len(auth.encode()) < 600


def test_request_auth_wrong_swarm_key_or_route_refused() -> None:
    auth = RequestAuth.decode(_auth().encode())
    with pytest.raises(AuthError, match="swarm key"):
        auth.verify(Membership.with_key("another swarm key, 16+"), method="POST", path="/stream/x")
    with pytest.raises(AuthError, match="swarm key"):
        _auth(Membership.open()).verify(KEY, method="POST", path="/stream/x")
    with pytest.raises(AuthError, match="signed for"):
        auth.verify(KEY, method="POST", path="/stream/y")


CHANGED_FIELDS = [
    ("target", os.urandom(32)),
    ("timestamp", 1.0),
    ("nonce", os.urandom(16)),
    ("path", "/stream/other"),
    ("cipher", "chacha20-poly1305"),
    ("public_key", BOB.public_key),
    ("agreement_key", BOB.agreement_key),
]


# named by field: the values are random bytes, which would name the cases differently in
# every collection of the suite
@pytest.mark.parametrize("field, value", CHANGED_FIELDS, ids=[f for f, _ in CHANGED_FIELDS])
def test_request_auth_any_changed_field_breaks_it(field: str, value: object) -> None:
    tampered = dataclasses.replace(_auth(Membership.open()), **{field: value})
    tampered = RequestAuth.decode(tampered.encode())
    with pytest.raises(AuthError):
        tampered.verify(Membership.open(), method="POST", path=tampered.path)


def test_request_auth_agreement_key_must_be_bound() -> None:
    """Mallory signs a request presenting an X25519 key her identity never bound."""
    from swarm import auth as auth_module

    mallory = Identity.generate()
    genuine = RequestAuth.create(
        mallory, Membership.open(), target=b"", method="GET", path="/ping", cipher="aes-256-gcm"
    )
    fields = {f.name: getattr(genuine, f.name) for f in dataclasses.fields(genuine)}
    del fields["signature"], fields["swarm_mac"]
    fields["agreement_key"] = ALICE.agreement_key
    message = auth_module._REQUEST_CONTEXT + auth_module._pack_fields(fields)
    forged = RequestAuth(**fields, signature=mallory.sign(message))
    with pytest.raises(AuthError, match="agreement"):
        RequestAuth.decode(forged.encode()).verify(Membership.open(), method="GET", path="/ping")


HOSTILE_HEADERS = [
    "",
    "!!!not base64!!!",
    "A" * 5000,
    _b64(b"\xc1"),  # msgpack never-used byte
    _b64(msgpack.packb(1)),
    _b64(msgpack.packb([1, 2, 3])),
    _b64(msgpack.packb([b"x"] * 11)),
    _b64(msgpack.packb([0] * 11)),
    _b64(msgpack.packb({"a": 1})),
    _b64(
        msgpack.packb(
            [
                b"\0" * 32,
                b"\0" * 32,
                b"\0" * 64,
                b"",
                float("nan"),
                b"\0" * 16,
                "GET",
                "/ping",
                "aes-256-gcm",
                b"\0" * 64,
                b"",
            ]
        )
    ),
    _b64(
        msgpack.packb(
            [
                b"\0" * 32,
                b"\0" * 32,
                b"\0" * 64,
                b"",
                1.0,
                b"\0" * 16,
                "GET",
                "x" * 1000,
                "aes-256-gcm",
                b"\0" * 64,
                b"",
            ]
        )
    ),
    _b64(msgpack.packb(msgpack.ExtType(1, b"x"))),
    _b64(b"\x91" * 300 + b"\xc0"),
]


@pytest.mark.parametrize("text", HOSTILE_HEADERS)
def test_request_auth_hostile_headers(text: str) -> None:
    with pytest.raises(AuthError):
        RequestAuth.decode(text).verify(Membership.open(), method="GET", path="/ping")


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=1200), st.binary(max_size=900).map(_b64)))
def test_request_auth_fuzz(text: str) -> None:
    try:
        RequestAuth.decode(text).verify(Membership.open(), method="GET", path="/ping")
    except AuthError:
        pass
    else:  # pragma: no cover - would need a forged signature
        pytest.fail("junk header accepted")


# ---- stream keys


def _keys(membership: Membership = KEY, stream_id: bytes = b"s" * 16) -> tuple[bytes, bytes]:
    a = derive_stream_key(
        ALICE,
        membership,
        peer_public_key=BOB.public_key,
        peer_agreement_key=BOB.agreement_key,
        initiator=True,
        stream_id=stream_id,
        cipher="aes-256-gcm",
    )
    b = derive_stream_key(
        BOB,
        membership,
        peer_public_key=ALICE.public_key,
        peer_agreement_key=ALICE.agreement_key,
        initiator=False,
        stream_id=stream_id,
        cipher="aes-256-gcm",
    )
    return a, b


def test_stream_key_agreed_and_bound() -> None:
    a, b = _keys()
    assert a == b and len(a) == 32
    assert _keys(Membership.open())[0] != a
    assert _keys(Membership.with_key("some other swarm key"))[0] != a
    assert _keys(stream_id=b"t" * 16)[0] != a
    with pytest.raises(AuthError):
        derive_stream_key(
            ALICE,
            KEY,
            peer_public_key=BOB.public_key,
            peer_agreement_key=bytes(32),
            initiator=True,
            stream_id=b"s" * 16,
            cipher="aes-256-gcm",
        )


# ---- sealed frames


def _pair(cipher: str = "aes-256-gcm", sid: bytes = b"i" * 16, max_frame: int = 1024):
    aead = make_aead(cipher, b"k" * 32)
    return Sealer(aead, sid, TO_SERVER), Opener(aead, sid, TO_SERVER, max_frame_bytes=max_frame)


def _deliver(opener: Opener, prefix: bytes, sealed: bytes) -> bytes:
    length, kind = opener.parse_prefix(prefix)
    assert length == len(sealed)
    return opener.open(kind, sealed)


@pytest.mark.parametrize("cipher", sorted(CIPHERS))
def test_frames_round_trip(cipher: str) -> None:
    sealer, opener = _pair(cipher)
    msgs = [(HEADER, b"{}"), (DATA, b"a" * 1000), (DATA, b"b"), (END, b"")]
    for kind, data in msgs:
        assert _deliver(opener, *sealer.seal(kind, data)) == data
    assert opener.ended and sealer.closed
    with pytest.raises(TransportError):
        sealer.seal(DATA, b"late")
    with pytest.raises(TransportError):
        opener.parse_prefix(struct.pack(">IB", 20, DATA))


def test_frames_detect_tamper_reorder_drop_splice_and_kind_flip() -> None:
    sealer, _ = _pair()
    frames = [sealer.seal(HEADER, b"h"), sealer.seal(DATA, b"one"), sealer.seal(DATA, b"two")]
    frames.append(sealer.seal(END, b""))

    _, opener = _pair()
    _deliver(opener, *frames[0])
    prefix, sealed = frames[1]
    flipped = bytes([sealed[0] ^ 1]) + sealed[1:]
    with pytest.raises(AuthError):
        _deliver(opener, prefix, flipped)

    _, opener = _pair()
    _deliver(opener, *frames[0])
    with pytest.raises(AuthError):  # reordered / dropped
        _deliver(opener, *frames[2])

    _, opener = _pair()
    _deliver(opener, *frames[0])
    _deliver(opener, *frames[1])
    with pytest.raises(AuthError):  # a DATA frame relabelled END (truncation attempt)
        opener.open(END, frames[2][1])

    other_sealer, _ = _pair(sid=b"j" * 16)
    other = [other_sealer.seal(HEADER, b"h"), other_sealer.seal(DATA, b"one")]
    _, opener = _pair()
    _deliver(opener, *frames[0])
    with pytest.raises(AuthError):  # spliced from another stream
        _deliver(opener, *other[1])

    aead = make_aead("aes-256-gcm", b"k" * 32)
    reflected = Opener(aead, b"i" * 16, TO_CLIENT, max_frame_bytes=1024)
    with pytest.raises(AuthError):  # reflected back in the other direction
        _deliver(reflected, *frames[0])


def test_frames_oversize_and_bad_prefix_refused_before_reading() -> None:
    _, opener = _pair(max_frame=1024)
    with pytest.raises(TransportError, match="exceeds"):
        opener.parse_prefix(struct.pack(">IB", 1024 + 17, HEADER))
    with pytest.raises(TransportError, match="kind"):
        opener.parse_prefix(struct.pack(">IB", 100, 99))
    with pytest.raises(TransportError, match="shorter"):
        opener.parse_prefix(struct.pack(">IB", 3, HEADER))
    with pytest.raises(TransportError, match="data frame at index 0"):
        opener.parse_prefix(struct.pack(">IB", 100, DATA))


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=5, max_size=2000))
def test_frames_fuzz(blob: bytes) -> None:
    _, opener = _pair()
    try:
        length, kind = opener.parse_prefix(blob[:5])
        opener.open(kind, blob[5 : 5 + length])
    except (AuthError, TransportError):
        return
    pytest.fail("random bytes opened as a frame")


def test_frame_reader_detects_truncation() -> None:
    """A body that ends before its END frame raises AuthError, after the valid chunks."""
    import aiohttp
    from aiohttp.base_protocol import BaseProtocol

    from swarm.net.streams import FrameReader

    async def run() -> None:
        loop = asyncio.get_running_loop()
        content = aiohttp.StreamReader(BaseProtocol(loop), 2**16, loop=loop)
        sealer, opener = _pair()
        for kind, data in ((HEADER, b"\x80"), (DATA, b"abc")):
            prefix, sealed = sealer.seal(kind, data)
            content.feed_data(prefix + sealed)
        content.feed_eof()
        reader = FrameReader(content, opener, max_stream_bytes=100, peer="test")
        assert await reader.read_header() == {}
        assert await reader.read_chunk() == b"abc"
        with pytest.raises(AuthError, match="truncated"):
            await reader.read_chunk()

    asyncio.run(run())


def test_replay_guard_flood_of_future_nonces_locks_out_only_its_sender() -> None:
    guard = ReplayGuard(window_s=30, max_entries=10_000, max_per_sender=1000)
    attacker, honest = b"a" * 32, b"h" * 32
    refused = 0
    for i in range(20_000):
        try:
            guard.check(1029.0 - i * 1e-4, os.urandom(16), sender=attacker, now=1000.0)
        except ReplayError:
            refused += 1
    assert len(guard) <= 1000 and refused >= 18_990
    for i in range(100):  # other senders are not refused, before or after the flood's stamps
        guard.check(1000.0 + i * 0.1, os.urandom(16), sender=honest, now=1000.0 + i * 0.1)
    with pytest.raises(ReplayError):  # the attacker's own forgotten range is refused
        guard.check(1027.0, os.urandom(16), sender=attacker, now=1000.0)


def test_replay_guard_bounded_across_many_senders_and_forgotten_ones_stay_guarded() -> None:
    guard = ReplayGuard(window_s=30, max_entries=500, max_per_sender=100)
    first, nonce = os.urandom(32), os.urandom(16)
    guard.check(1000.0, nonce, sender=first, now=1000.0)
    for i in range(5000):
        guard.check(1000.0, os.urandom(16), sender=i.to_bytes(4, "big"), now=1000.0)
    assert len(guard) <= 500
    with pytest.raises(ReplayError):  # forgotten, yet its old message is still refused
        guard.check(1000.0, nonce, sender=first, now=1001.0)
    guard.check(1001.0, os.urandom(16), sender=first, now=1001.0)  # newer ones pass


def test_replay_guard_forgets_senders_whose_messages_all_left_the_window() -> None:
    """Senders that stopped (departed peers) held their last window of nonces until the guard
    was full; once their newest message is older than the window, the window alone refuses
    every replay of theirs, and they are dropped."""
    guard = ReplayGuard(window_s=30)
    old = [(os.urandom(32), os.urandom(16)) for _ in range(300)]
    for sender, nonce in old:
        guard.check(1000.0, nonce, sender=sender, now=1000.0)
    future = os.urandom(32)  # a sender whose clock runs ahead stays guarded while it must be
    guard.check(1020.0, os.urandom(16), sender=future, now=1000.0)
    assert len(guard) == 301
    guard.check(1031.0, os.urandom(16), sender=b"n" * 32, now=1031.0)
    assert len(guard) == 2
    for sender, nonce in old[:5]:
        with pytest.raises(ReplayError):
            guard.check(1000.0, nonce, sender=sender, now=1031.0)
