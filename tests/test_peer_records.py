"""Peer addresses and peer records: parsing, signatures, and hostile bytes."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.address import PeerAddress
from swarm.errors import AuthError, ConfigError, TransportError
from swarm.identity import Identity
from swarm.net.record import CONTEXT, PeerRecord

# ---- addresses


@pytest.mark.parametrize(
    "text, host, port",
    [
        ("127.0.0.5:0", "127.0.0.5", 0),
        ("[::1]:7000", "::1", 7000),
        ("example.org:443", "example.org", 443),
    ],
)
def test_address_parse_and_str(text: str, host: str, port: int) -> None:
    address = PeerAddress.parse(text)
    assert (address.host, address.port) == (host, port)
    assert str(address) == text and PeerAddress.parse(str(address)) == address


@pytest.mark.parametrize(
    "junk",
    ["", "host", "::1:7000", "[::1]", "[zz]:1", "a b:1", "h:70000", "h:-1", "h:1e3", ":80", "h:"],
)
def test_address_junk(junk: str) -> None:
    with pytest.raises(ConfigError):
        PeerAddress.parse(junk)


# ---- records


def _record(identity: Identity | None = None, **kw: object) -> PeerRecord:
    args: dict[str, object] = dict(
        address=PeerAddress("127.0.0.9", 7000),
        run_id="run",
        device="cuda:NVIDIA H100",
        bandwidth=12.5e6,
        extra={"coords": [0.5, -1.25, 3.0, 0.1], "step": 1234},
    )
    args.update(kw)
    return PeerRecord.create(identity or Identity.generate(), **args)  # type: ignore[arg-type]


def test_record_round_trip_and_size() -> None:
    record = _record()
    data = record.serialize()
    assert len(data) < 512
    parsed = PeerRecord.parse(data)
    assert parsed == record and parsed.peer_id == record.peer_id
    assert parsed.serialize() == data


def test_record_bytes_parsed_again_are_answered_from_the_checked_ones() -> None:
    record = _record()
    data = record.serialize()
    first = PeerRecord.parse(data)
    assert PeerRecord.parse(data) is first  # no second decode or signature check
    with pytest.raises(TransportError):  # the size limit of each call still holds
        PeerRecord.parse(data, max_bytes=len(data) - 1)
    aged = first.aged(12.5)
    assert aged.age_s == 12.5 and first.age_s == 0.0 and aged == first
    assert PeerRecord.parse(data).age_s == 0.0


def test_record_forged_or_swapped_owner_refused() -> None:
    record, other = _record(), _record()
    body, signature = msgpack.unpackb(record.serialize())
    # parsed (and its signatures verified, then remembered) first: a forgery of it still fails
    assert PeerRecord.parse(record.serialize()) == PeerRecord.parse(record.serialize())
    # another peer's signature over our body
    with pytest.raises(AuthError):
        PeerRecord.parse(msgpack.packb([body, other.signature]))
    # our body with the owner swapped for another public key (signature no longer matches)
    fields = msgpack.unpackb(body)
    fields[1] = other.public_key
    with pytest.raises(AuthError):
        PeerRecord.parse(msgpack.packb([msgpack.packb(fields), signature]))
    # a record re-signed by Mallory, but claiming Alice's agreement key
    mallory = Identity.generate()
    fields = msgpack.unpackb(body)
    fields[1], fields[2] = mallory.public_key, record.agreement_key
    forged_body = msgpack.packb(fields)
    resigned = msgpack.packb([forged_body, mallory.sign(CONTEXT + forged_body)])
    with pytest.raises(AuthError, match="agreement"):
        PeerRecord.parse(resigned)


def _mutations() -> list[bytes]:
    body, sig = msgpack.unpackb(_record().serialize())
    fields = msgpack.unpackb(body)
    out = [
        b"",
        b"\xc1",
        b"\x00" * 3000,
        msgpack.packb([body]),
        msgpack.packb({"a": 1}),
        msgpack.packb([body, sig, b""]),
        msgpack.packb([1, 2]),
        b"\x91" * 1000 + b"\xc0",
    ]
    for index, junk in [
        (0, 2),
        (1, b"x"),
        (4, 5),
        (5, -1),
        (5, 70000),
        (5, True),
        (6, "r" * 100),
        (8, float("nan")),
        (8, -1.0),
        (8, 1),
        (10, [1]),
        (10, {"k": "v" * 900}),
        (11, "now"),
        (3, b"\0" * 63),
        (4, "a b"),
    ]:
        mutated = list(fields)
        mutated[index] = junk
        out.append(msgpack.packb([msgpack.packb(mutated), sig]))
    out.append(msgpack.packb([msgpack.packb([*fields, 1]), sig]))
    # non-canonical: the same float packed as float32
    packer = msgpack.Packer(use_single_float=True)
    out.append(msgpack.packb([packer.pack(fields), sig]))
    return out


MUTATIONS = _mutations()


# ids by position: the records hold a fresh key's signature, and test workers must collect
# the same test ids
@pytest.mark.parametrize("data", MUTATIONS, ids=[f"mutation{i}" for i in range(len(MUTATIONS))])
def test_record_hostile_bytes(data: bytes) -> None:
    with pytest.raises((TransportError, AuthError)):
        PeerRecord.parse(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=3000))
def test_record_fuzz(data: bytes) -> None:
    try:
        PeerRecord.parse(data)
    except (TransportError, AuthError):
        return
    pytest.fail("random bytes parsed as a record")


def test_record_local_validation() -> None:
    with pytest.raises(ConfigError):
        _record(extra={"blob": b"x" * 5000})
    with pytest.raises(ConfigError):
        _record(device="d" * 100)
    with pytest.raises(ConfigError):
        _record(bandwidth=-1)
