"""Strict msgpack decoding of untrusted bytes: one value or the caller's error, nothing else."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm import strict_msgpack
from swarm.errors import AuthError, DHTError, TransportError


def test_one_plain_value_round_trips() -> None:
    value = {"a": [1, 2.5, b"raw", "text", None, True], "b": {}}
    assert strict_msgpack.unpack(msgpack.packb(value), DHTError, "x") == value


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (msgpack.packb(msgpack.ExtType(5, b"boom")), "extension type 5"),
        (msgpack.packb([1, 2]) + b"\x00", "ExtraData"),
        (msgpack.packb([1, 2])[:-1], "malformed msgpack"),
        (msgpack.packb({1: "int key"}), "malformed msgpack"),
        (b"\xa2\xff\xfe", "malformed msgpack"),  # a two-byte string that is not UTF-8
        (b"\xc1", "malformed msgpack"),  # the one byte msgpack never uses
        (b"", "malformed msgpack"),
    ],
)
@pytest.mark.parametrize("error", [AuthError, DHTError, TransportError])
def test_hostile_bytes_raise_the_callers_error(
    data: bytes, reason: str, error: type[Exception]
) -> None:
    with pytest.raises(error, match=reason) as info:
        strict_msgpack.unpack(data, error, "the thing")
    assert str(info.value).startswith("the thing: ")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_any_bytes_decode_or_raise_dhterror(data: bytes) -> None:
    with contextlib.suppress(DHTError):  # anything else escapes and fails the test
        strict_msgpack.unpack(data, DHTError, "fuzz")
