"""Hostile payloads: every malformed input raises CompressionError before any large allocation."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
import tracemalloc

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.compression import Header, decode, decode_into, get_codec, read_header
from swarm.compression.header import CODEC_IDS
from swarm.compression.indices import BITMAP, FIXED, VARINT
from swarm.errors import CompressionError

SPECS = [
    "none",
    "fp16",
    "bf16",
    "int8:64",
    "int8:64:bnb",
    "topk:0.1",
    "topk:0.1:int8",
    "topk:0.6",
    "1bit:64",
    "sparse:64:4:2",
    "sparse:16:3:4",
]
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def valid(spec: str, numel: int = 300, seed: int = 0) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    return get_codec(spec).encode(torch.randn(numel, generator=gen))


def craft(
    codec: str,
    shape: tuple[int, ...],
    sections: list[bytes],
    *,
    block: int = 0,
    param: int = 0,
    flags: int = 0,
    dtype: torch.dtype = torch.float32,
    lengths: tuple[int, ...] | None = None,
) -> bytes:
    header = Header(
        codec,
        dtype,
        shape,
        block,
        param,
        flags,
        lengths if lengths is not None else tuple(len(s) for s in sections),
    )
    return header.serialize() + b"".join(sections)


def patch(payload: bytes, offset: int, fmt: str, value: int) -> bytes:
    data = bytearray(payload)
    struct.pack_into(fmt, data, offset, value)
    return bytes(data)


def test_valid_payloads_decode():
    for spec in SPECS:
        assert decode(valid(spec)).shape == (300,)


@pytest.mark.parametrize("spec", SPECS)
def test_every_truncation_and_extension_is_refused(spec):
    payload = valid(spec, numel=100)
    for cut in range(len(payload)):
        with pytest.raises(CompressionError):
            decode(payload[:cut])
    for extra in (b"\0", b"\x01" * 9):
        with pytest.raises(CompressionError, match="follow the header"):
            decode(payload + extra)


@pytest.mark.parametrize(
    ("offset", "fmt", "value", "match"),
    [
        (0, "<B", ord("X"), "magic"),
        (3, "<B", 3, "version 3"),
        (3, "<B", 1, "version 1"),
        (3, "<B", 0, "version 0"),
        (4, "<B", 7, "unknown codec id"),
        (4, "<B", 255, "unknown codec id"),
        (5, "<B", 9, "dtype code"),
        (6, "<B", 33, "ndim"),
        (7, "<B", 5, "sections"),
        (10, "<H", 1, "reserved"),
    ],
)
def test_header_field_corruption(offset, fmt, value, match):
    with pytest.raises(CompressionError, match=match):
        decode(patch(valid("int8:64"), offset, fmt, value))


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("other", ["none", "int8", "topk", "1bit"])
def test_payload_relabelled_as_another_codec(spec, other):
    # A valid codec id, but not the one that made the payload: its sections cannot fit.
    payload = valid(spec, numel=300)
    if read_header(payload).codec == other:
        return
    with pytest.raises(CompressionError):
        decode(patch(payload, 4, "<B", CODEC_IDS[other]))


@pytest.mark.parametrize("spec", SPECS)
def test_codec_decode_refuses_another_codecs_payload(spec):
    payload = valid(spec)
    codec = get_codec(spec)
    assert torch.equal(codec.decode(payload), decode(payload))
    for name in ("none", "int8", "1bit"):
        if name != codec.name:
            with pytest.raises(CompressionError, match=f"made by codec {codec.name!r}"):
                get_codec(name).decode(payload)


@pytest.mark.parametrize("spec", SPECS)
def test_shape_claiming_2_to_40_elements_is_refused_without_allocating(spec):
    payload = valid(spec, numel=100)
    header = read_header(payload)
    hostile = patch(payload, 24, "<Q", 1 << 40)  # the only dimension
    tracemalloc.start()
    try:
        with pytest.raises(CompressionError, match="max_numel"):
            decode(hostile)
        if not spec.startswith("topk"):  # top-K is sparse: only max_numel bounds its output
            with pytest.raises(CompressionError, match=r"sections|do not fit"):
                decode(hostile, max_numel=1 << 62)  # allowed, but the sections cannot back it
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 64 * 1024
    assert header.numel == 100


# Runs in a child process whose address space is capped a little above what it already maps:
# any allocation of the size a hostile header claims (1 GiB) fails there, touched or not, which
# tracemalloc could not show (it does not see torch's allocator). The child first proves that
# the cap bites and that honest payloads still decode under it.
_ALLOCATION_CHILD = textwrap.dedent(
    """
    import resource, struct, sys
    import torch
    from swarm.compression import Header, decode, get_codec
    from swarm.errors import CompressionError

    CLAIM = 1 << 28  # elements: 1 GiB as fp32, 256 MiB as bytes
    SPECS = sys.argv[1].split(",")

    def relabel(payload, shape, param=None):
        head = Header.parse(payload)[0]
        body = payload[head.size:]
        fields = dict(head.__dict__, shape=shape)
        if param is not None:
            fields["param"] = param
        return Header(**fields).serialize() + body

    hostile = []
    for spec in SPECS:
        small = get_codec(spec).encode(torch.randn(100))
        # A top-K payload with per-index gaps stays valid whatever numel it claims: only
        # max_numel bounds its dense output (documented), so only its other lies are tried.
        sparse = spec.startswith("topk") and Header.parse(small)[0].flags & 0x3 != 2
        if not sparse:
            hostile.append((spec, "claims 2**28", relabel(small, (CLAIM,))))
            hostile.append((spec, "claims 2**14 x 2**14", relabel(small, (1 << 14, 1 << 14))))
        hostile.append((spec, "truncated", relabel(small, (CLAIM,))[:-3]))
        if spec.startswith("topk"):
            hostile.append((spec, "k = numel", relabel(small, (CLAIM,), param=CLAIM)))
            hostile.append((spec, "k = numel / 2", relabel(small, (CLAIM,), param=CLAIM // 2)))
    honest = [get_codec(s).encode(torch.randn(100_000)) for s in SPECS]
    for payload in honest:  # warm up thread pools and lazy imports before the cap
        decode(payload)
    torch.randn(1 << 20).sum()

    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    cap = mapped + (192 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    try:
        torch.empty(CLAIM)
        sys.exit("the address-space cap does not stop a 1 GiB allocation")
    except (RuntimeError, MemoryError):
        pass
    for payload in honest:
        decode(payload, max_numel=CLAIM)
    for spec, what, payload in hostile:
        try:
            decode(payload, max_numel=CLAIM)
        except CompressionError:
            continue
        except (RuntimeError, MemoryError) as exc:
            sys.exit(f"{spec} {what}: allocated before refusing: {exc}")
        sys.exit(f"{spec} {what}: decoded a hostile payload")
    print("ok", len(hostile))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs RLIMIT_AS and /proc")
def test_hostile_headers_allocate_nothing_of_the_claimed_size():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [sys.executable, "-c", _ALLOCATION_CHILD, ",".join(SPECS)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok")


def test_huge_shape_with_consistent_lengths_is_refused_by_max_numel():
    # A top-K payload is small whatever its numel, so only max_numel bounds its dense output.
    payload = craft("topk", (1 << 40,), [b"", b"\0\x3c", b"\x05"], param=1, flags=VARINT)
    with pytest.raises(CompressionError, match="max_numel"):
        decode(payload)
    with pytest.raises(CompressionError, match="max_numel"):
        decode(valid("topk:0.1", numel=1000), max_numel=999)
    out = torch.zeros(6)
    ok = craft("topk", (6,), [b"", b"\0\x3c", b"\x05"], param=1, flags=VARINT)
    assert decode_into(ok, out).tolist() == [0, 0, 0, 0, 0, 1.0]


@pytest.mark.parametrize(
    ("shape", "match"),
    [((2**32, 2**32, 2**32), "max_numel"), ((2**63, 0), "int64"), ((0, 2**64 - 1), "int64")],
)
def test_overflowing_shapes(shape, match):
    with pytest.raises(CompressionError, match=match):
        decode(craft("none", shape, [b""]))
    assert decode(craft("none", (0, 2**40), [b""])).shape == (0, 2**40)  # zero elements


@pytest.mark.parametrize(
    "lengths",
    [(2**64 - 1,), (2**63,), (1200, 2**64 - 1200), (0, 1200)],
)
def test_negative_or_overflowing_section_lengths(lengths):
    # Section lengths are unsigned on the wire: a "negative" one is huge and cannot match.
    payload = craft("none", (300,), [bytes(1200)], lengths=lengths)
    with pytest.raises(CompressionError):
        decode(payload)


def test_section_lengths_must_match_the_codec():
    # Right total, wrong split between scales and codes.
    good = valid("int8:64", numel=300)
    header = read_header(good)
    a, b = header.section_lengths
    body = good[header.size :]
    bad = craft("int8", (300,), [body], block=64, lengths=(a + 4, b - 4))
    with pytest.raises(CompressionError, match="must have sections"):
        decode(bad)


@pytest.mark.parametrize(
    ("codec", "block", "flags", "param"),
    [
        ("int8", 0, 0, 0),
        ("int8", 3, 0, 0),
        ("int8", 2**31, 0, 0),
        ("int8", 100, 1, 0),
        ("int8", 64, 7, 0),
        ("int8", 64, 0, 5),
        ("1bit", 0, 0, 0),
        ("1bit", 64, 1, 0),
        ("none", 4, 0, 0),
        ("fp16", 0, 1, 0),
        ("topk", 0, 0xFF, 1),
        ("topk", 5, 0, 1),
    ],
)
def test_bad_codec_fields(codec, block, flags, param):
    with pytest.raises(CompressionError):
        decode(craft(codec, (64,), [bytes(4), bytes(64)], block=block, flags=flags, param=param))


def _topk(indices: bytes, encoding: int, k: int, numel: int, width_code: int = 0) -> bytes:
    values = struct.pack(f"<{k}e", *([1.0] * k))
    return craft(
        "topk", (numel,), [b"", values, indices], param=k, flags=encoding | (width_code << 2)
    )


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (_topk(bytes([3, 200]), FIXED, 2, 100), "past the end"),  # 3 + 201 > 99
        (_topk(bytes([99]), FIXED, 1, 99), "past the end"),
        (_topk(b"\xff" * 16, FIXED, 2, 100, width_code=3), "63 bits|past the end"),
        (_topk(bytes([1, 2, 3]), FIXED, 2, 100), "fit"),
        (_topk(bytes([0x80, 0x80]), VARINT, 2, 100), "truncated"),
        (_topk(bytes([1, 2, 3]), VARINT, 2, 100), "holds 3 values"),
        (_topk(bytes([0xFF] * 9 + [1]), VARINT, 1, 100), "fit|longer"),
        (_topk(bytes([0x80] * 9 + [1]), VARINT, 2, 100), "holds 1 values|longer"),
        (_topk(bytes([0xFF] * 8 + [0x7F, 0]), VARINT, 2, 100), "past the end"),
        (_topk(bytes([0b1000_0011, 0]), BITMAP, 2, 10), "holds 3"),
        (_topk(bytes([0b11, 0b100]), BITMAP, 2, 10), "past the end"),
        (_topk(bytes([0b11]), BITMAP, 2, 10), "fit"),
        (_topk(bytes([0b11]), 3, 2, 10), "fit"),
        (_topk(bytes([0, 0]), VARINT, 2, 1), "keeps k=2"),
        (_topk(bytes([0, 0]), VARINT, 2, 10, width_code=1), "do not fit"),
    ],
)
def test_topk_index_attacks(payload, match):
    with pytest.raises(CompressionError, match=match):
        decode(payload)


@pytest.mark.parametrize(
    "payload",
    [
        craft("none", (2,), [struct.pack("<2f", 1.0, float("nan"))]),
        craft("fp16", (2,), [struct.pack("<2e", 1.0, float("inf"))]),
        craft("int8", (2,), [struct.pack("<f", float("nan")), b"\1\2"], block=64),
        craft("int8", (2,), [struct.pack("<f", -1.0), b"\1\2"], block=64),
        craft("1bit", (2,), [struct.pack("<f", float("inf")), b"\1"], block=64),
        craft("topk", (4,), [b"", struct.pack("<e", float("nan")), b"\1"], param=1, flags=VARINT),
        craft(
            "topk",
            (4,),
            [struct.pack("<f", float("inf")), b"\1", b"\1"],
            param=1,
            flags=VARINT | (2 << 4),
            block=64,
        ),
    ],
)
def test_non_finite_or_negative_values_in_payloads(payload):
    with pytest.raises(CompressionError, match="non-finite"):
        decode(payload)


def test_not_bytes_and_output_mismatch():
    with pytest.raises(CompressionError):
        decode(12345)
    with pytest.raises(CompressionError, match="elements"):
        decode_into(valid("int8:64", numel=300), torch.zeros(301))
    with pytest.raises(CompressionError, match="float"):
        decode_into(valid("int8:64", numel=300), torch.zeros(300, dtype=torch.long))


@FUZZ
@given(data=st.binary(max_size=400))
def test_random_bytes(data):
    with pytest.raises(CompressionError):
        decode(data, max_numel=10**5)


@FUZZ
@given(data=st.binary(max_size=200))
def test_random_bytes_behind_a_valid_prefix(data):
    with pytest.raises(CompressionError):
        decode(b"SWZ\x02" + data, max_numel=10**5)


@FUZZ
@given(spec=st.sampled_from(SPECS), data=st.data())
def test_mutated_valid_payloads_decode_or_raise_compression_error(spec, data):
    payload = bytearray(valid(spec, numel=data.draw(st.sampled_from([0, 1, 9, 130]))))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(payload) - 1))
        payload[pos] = data.draw(st.integers(0, 255))
    try:
        out = decode(bytes(payload), max_numel=10**5)
    except CompressionError:
        return
    assert out.numel() <= 10**5
    assert bool(torch.isfinite(out).all())


def test_memoryview_and_bytearray_payloads():
    payload = valid("topk:0.1")
    expected = decode(payload)
    assert torch.equal(decode(bytearray(payload)), expected)
    framed = b"xyz" + payload + b"tail"
    assert torch.equal(decode(memoryview(framed)[3 : 3 + len(payload)]), expected)


@pytest.mark.parametrize(
    "spec",
    [
        "none",
        "fp16",
        "bf16",
        "int8",
        "1bit",
        "topk:0.01",
        "topk:0.01:int8",
        "sparse",
        "sparse:64:48:4",
    ],
)
def test_the_nan_faults_crafted_payloads_are_refused_by_every_codec(spec: str) -> None:
    """The ``nan`` and ``nan-owner`` faults write a NaN where the codec reads a float (a scale,
    or a raw value): every codec refuses it, so those faults test a NaN under every codec (they
    wrote into the last 4 bytes before, which under a compressing codec are codes or positions)."""
    from swarm.averaging.faults import with_nan

    payload = get_codec(spec).encode(torch.randn(5000, generator=torch.Generator().manual_seed(0)))
    crafted = with_nan(payload)
    assert len(crafted) == len(payload) and crafted != payload
    with pytest.raises(CompressionError, match=r"non-finite|not finite"):
        decode(crafted)
    assert with_nan(b"") == b"" and with_nan(b"not a payload") == b"not a payload"
