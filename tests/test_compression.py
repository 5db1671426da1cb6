"""Codec properties: round trips, error bounds, exact top-K, 1-bit scales, specs and sizes."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.compression import (
    CODEC_NAMES,
    Codec,
    Header,
    Int8Codec,
    OneBitCodec,
    TopKCodec,
    decode,
    decode_into,
    get_codec,
    read_header,
)
from swarm.compression.indices import (
    BITMAP,
    FIXED,
    VARINT,
    decode_indices,
    encode_indices,
)
from swarm.errors import CompressionError, ConfigError

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DISTS = ["normal", "heavy", "zeros", "tiny", "ties", "mixed_sign_scale"]
# Inputs holding +-inf or NaN at one random position: every codec refuses them (documented).
NON_FINITE = ["with_inf", "with_neg_inf", "with_nan"]
PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

shapes = st.one_of(
    st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple),
    st.sampled_from([(0,), (1,), (7,), (63,), (64,), (65,), (4097,), (3, 1000), (12289,)]),
)


def make(dist: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dist == "normal":
        x = torch.randn(shape, generator=gen)
    elif dist == "heavy":  # Student-t, df=2
        z = torch.randn(shape, generator=gen)
        chi = (-2 * torch.log(torch.rand(shape, generator=gen).clamp_min(1e-12)) / 2).sqrt()
        x = z / chi
    elif dist == "zeros":
        x = torch.zeros(shape)
    elif dist == "tiny":
        x = torch.randn(shape, generator=gen) * 1e-6
    elif dist == "ties":
        x = torch.randint(-2, 3, shape, generator=gen).float()
    elif dist == "mixed_sign_scale":
        x = torch.randn(shape, generator=gen) * torch.exp(4 * torch.randn(shape, generator=gen))
        x = x.clamp(-6e4, 6e4)
    else:  # one of NON_FINITE
        x = torch.randn(shape, generator=gen)
        bad = {"with_inf": math.inf, "with_neg_inf": -math.inf, "with_nan": math.nan}[dist]
        if x.numel():
            x.view(-1)[int(torch.randint(x.numel(), (1,), generator=gen))] = bad
    return x.to(dtype)


def specs_under_test() -> list[str]:
    return [
        "none",
        "fp16",
        "bf16",
        "int8",
        "int8:64",
        "int8:64:bnb",
        "topk:0.01",
        "topk:0.25",
        "topk:3",
        "topk:0.1:int8",
        "topk:0.1:bf16",
        "1bit",
        "1bit:64",
        "sparse",
        "sparse:64:2:2",
        "sparse:16:3:4",
    ]


def payload_parts(payload: bytes) -> tuple[Header, list[torch.Tensor]]:
    return Header.parse(payload)


def topk_indices(payload: bytes) -> torch.Tensor:
    header, sections = payload_parts(payload)
    encoding = header.flags & 0x3
    width = (1, 2, 4, 8)[(header.flags >> 2) & 0x3] if encoding == FIXED else 0
    return decode_indices(encoding, width, sections[2], header.param, header.numel)


@PROPS
@given(
    spec=st.sampled_from(specs_under_test()),
    shape=shapes,
    dist=st.sampled_from(DISTS + NON_FINITE),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31),
)
def test_round_trip_keeps_shape_and_dtype(spec, shape, dist, dtype, seed):
    codec = get_codec(spec)
    x = make(dist, shape, seed, dtype)
    if not bool(torch.isfinite(x).all()):
        # Documented: inf/NaN are refused (a diverged peer must not poison the others).
        with pytest.raises(CompressionError, match="1 non-finite"):
            codec.encode(x)
        return
    payload = codec.encode(x)
    assert torch.equal(codec.decode(payload), decode(payload))
    assert len(payload) <= codec.estimate_size(x.numel(), max(1, x.dim()))
    y = decode(payload)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert bool(torch.isfinite(y).all())
    assert read_header(payload).shape == tuple(x.shape)


@PROPS
@given(
    shape=shapes,
    dist=st.sampled_from(DISTS),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31),
)
def test_none_is_exact(shape, dist, dtype, seed):
    x = make(dist, shape, seed, dtype)
    assert torch.equal(decode(get_codec("none").encode(x)), x)


@PROPS
@given(
    shape=shapes,
    dist=st.sampled_from(DISTS),
    seed=st.integers(0, 2**31),
    block=st.sampled_from([8, 64, 100, 4096]),
)
def test_int8_error_within_block_bound(shape, dist, seed, block):
    x = make(dist, shape, seed, torch.float32)
    y = decode(Int8Codec(block_size=block).encode(x)).view(-1).double()
    flat = x.view(-1).double()
    for start in range(0, flat.numel(), block):
        xb, yb = flat[start : start + block], y[start : start + block]
        # half a level, plus the float32 rounding of the scale and of the decoded value
        bound = xb.abs().max() * (1 / 254 + 2**-21) + 1e-30
        assert float((xb - yb).abs().max()) <= float(bound)


@PROPS
@given(
    shape=shapes,
    dist=st.sampled_from(DISTS),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31),
    block=st.sampled_from([64, 256, 4096]),
)
def test_int8_bnb_error_within_block_bound(shape, dist, dtype, seed, block):
    # bitsandbytes' dynamic map rounds u = x / absmax(block) to one of its 256 codes: the error
    # is at most half the widest gap between neighbouring codes (0.00703, near +-1), times
    # absmax. Its CPU kernel picks a neighbour of the nearest code in rare cases (off by at most
    # 1.5e-5 of absmax, measured), hence the 1% slack; plus rounding to a 16-bit dtype.
    import bitsandbytes.functional as bnbf

    code = bnbf.create_dynamic_map(signed=True)
    half_gap = float((code[1:] - code[:-1]).max()) / 2
    x = make(dist, shape, seed, dtype)
    payload = Int8Codec(block_size=block, method="bnb").encode(x)
    y = decode(payload)
    assert y.shape == x.shape and y.dtype == x.dtype
    flat, y = x.view(-1).double(), y.view(-1).double()
    rounding = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps
    # below the smallest normal, rounding to a 16-bit dtype is absolute: half a subnormal step
    subnormal = 0.0 if dtype == torch.float32 else torch.finfo(dtype).smallest_normal * rounding
    for start in range(0, flat.numel(), block):
        xb, yb = flat[start : start + block], y[start : start + block]
        absmax = float(xb.abs().max())
        bound = absmax * (half_gap * 1.01 + rounding) + subnormal / 2 + 1e-30
        assert float((xb - yb).abs().max()) <= bound


@PROPS
@given(
    shape=shapes,
    dist=st.sampled_from(DISTS),
    seed=st.integers(0, 2**31),
    frac=st.sampled_from([0.001, 0.01, 0.1, 0.5, 1.0]),
)
def test_topk_keeps_exactly_the_k_largest(shape, dist, seed, frac):
    x = make(dist, shape, seed, torch.float32)
    codec = TopKCodec(fraction=frac)
    payload = codec.encode(x)
    flat, y = x.view(-1), decode(payload).view(-1)
    idx = topk_indices(payload)
    k = codec.k_for(flat.numel())
    assert idx.numel() == k == (0 if flat.numel() == 0 else max(1, math.ceil(frac * flat.numel())))
    dropped = torch.ones(flat.numel(), dtype=torch.bool)
    dropped[idx] = False
    if k and dropped.any():
        assert float(flat[idx].abs().min()) >= float(flat[dropped].abs().max())
    assert torch.equal(y[idx], flat[idx].half().float())
    assert bool((y[dropped] == 0).all())


def _assert_exact_topk(x: torch.Tensor, codec: TopKCodec, payload: bytes) -> None:
    flat, y = x.view(-1), decode(payload).view(-1)
    idx = topk_indices(payload)
    assert idx.numel() == codec.k_for(flat.numel())
    assert bool((idx[1:] > idx[:-1]).all())
    dropped = torch.ones(flat.numel(), dtype=torch.bool)
    dropped[idx] = False
    if dropped.any():
        assert float(flat[idx].abs().min()) >= float(flat[dropped].abs().max())
    assert torch.equal(y[idx], flat[idx].half().float())
    assert bool((y[dropped] == 0).all())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    numel=st.integers(65_537, 400_000),
    dist=st.sampled_from([*DISTS, "plateau", "spikes"]),
    seed=st.integers(0, 2**31),
    frac=st.sampled_from([0.0001, 0.001, 0.01, 0.05, 0.125]),
)
def test_topk_sampled_selection_is_exact_on_large_tensors(numel, dist, seed, frac):
    # Above EXACT_BELOW elements the threshold comes from a random sample; the result must
    # still be exactly the k largest magnitudes, whatever the distribution.
    if dist == "plateau":  # a block of ties straddling the k-th magnitude
        x = make("normal", (numel,), seed, torch.float32)
        k = math.ceil(frac * numel)
        x[torch.randperm(numel, generator=torch.Generator().manual_seed(seed))[: 2 * k]] = 10.0
    elif dist == "spikes":  # a few huge values the sample almost surely misses
        x = make("normal", (numel,), seed, torch.float32) * 1e-3
        x[:: numel // 7] = 1e4
    else:
        x = make(dist, (numel,), seed, torch.float32)
    codec = TopKCodec(fraction=frac)
    _assert_exact_topk(x, codec, codec.encode(x))


def test_topk_exact_fallback_when_the_sample_misleads(caplog):
    # Only ties: the threshold keeps everything, so the codec falls back to an exact selection.
    codec = TopKCodec(fraction=0.01)
    with caplog.at_level(logging.DEBUG, logger="swarm.compression.topk"):
        x = make("normal", (300_001,), 3, torch.float32)
        _assert_exact_topk(x, codec, codec.encode(x))
        assert "exact selection" not in caplog.text  # the fast path served normal data
        ties = torch.ones(300_001)
        _assert_exact_topk(ties, codec, codec.encode(ties))
        assert "exact selection" in caplog.text


@PROPS
@given(
    shape=shapes,
    dist=st.sampled_from(DISTS),
    seed=st.integers(0, 2**31),
    block=st.sampled_from([8, 64, 100, 4096]),
)
def test_1bit_decodes_to_sign_times_block_mean(shape, dist, seed, block):
    x = make(dist, shape, seed, torch.float32)
    y = decode(OneBitCodec(block_size=block).encode(x)).view(-1).double()
    flat = x.view(-1).double()
    sign = torch.where(flat >= 0, 1.0, -1.0).double()
    for start in range(0, flat.numel(), block):
        xb = flat[start : start + block]
        expected = sign[start : start + block] * xb.abs().mean()
        assert torch.allclose(y[start : start + block], expected, rtol=1e-5, atol=1e-30)


@PROPS
@given(
    spec=st.sampled_from(specs_under_test()),
    shape=shapes,
    dist=st.sampled_from(DISTS),
    seed=st.integers(0, 2**31),
    weight=st.sampled_from([1.0, -1.0, 0.25]),
)
def test_decode_into_accumulates_or_overwrites(spec, shape, dist, seed, weight):
    x = make(dist, shape, seed, torch.float32)
    payload = get_codec(spec).encode(x)
    base = make("normal", (x.numel(),), seed + 1, torch.float32)
    out = base.clone()
    assert decode_into(payload, out, weight) is out
    assert torch.allclose(out, base + weight * decode(payload).view(-1), rtol=1e-5, atol=1e-5)
    out = base.clone()  # overwriting: nothing of what the buffer held survives
    assert decode_into(payload, out, weight, accumulate=False) is out
    assert torch.allclose(out, weight * decode(payload).view(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", specs_under_test())
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_input_is_refused_with_count(spec, dtype):
    x = torch.randn(1000).to(dtype)
    x[3], x[500], x[999] = float("inf"), float("nan"), float("-inf")
    with pytest.raises(CompressionError, match="3 non-finite"):
        get_codec(spec).encode(x)


def test_fp16_saturates_instead_of_overflowing():
    x = torch.tensor([1e6, -1e6, 1.0])
    assert decode(get_codec("fp16").encode(x)).tolist() == [65504.0, -65504.0, 1.0]
    y = decode(get_codec("topk:2").encode(x))
    assert y.tolist() == [65504.0, -65504.0, 0.0]


def test_ratios_at_scale():
    x = torch.randn(1 << 20)
    ratio = {s: x.numel() * 4 / len(get_codec(s).encode(x)) for s in ("int8", "topk:0.01", "1bit")}
    assert ratio["int8"] >= 3.9 and ratio["topk:0.01"] >= 60 and ratio["1bit"] >= 30


def test_unsupported_dtype_and_type():
    with pytest.raises(CompressionError, match="dtype"):
        get_codec("int8").encode(torch.arange(10))
    with pytest.raises(CompressionError):
        get_codec("int8").encode([1.0, 2.0])


def test_non_contiguous_input():
    x = torch.randn(20, 30).t()
    assert torch.equal(decode(get_codec("none").encode(x)), x)


@pytest.mark.parametrize(
    ("spec", "cls", "attrs"),
    [
        ("int8", Int8Codec, {"block_size": 4096, "method": "absmax"}),
        ("int8:1024", Int8Codec, {"block_size": 1024}),
        ("int8:256:bnb", Int8Codec, {"block_size": 256, "method": "bnb"}),
        ("topk:0.01", TopKCodec, {"fraction": 0.01, "count": None}),
        ("topk:1000", TopKCodec, {"count": 1000, "fraction": None}),
        ("topk:0.05:int8", TopKCodec, {"fraction": 0.05, "values": "int8"}),
        ("1bit", OneBitCodec, {"block_size": 4096}),
        ("1bit:512", OneBitCodec, {"block_size": 512}),
        ("TopK:0.5", TopKCodec, {"fraction": 0.5}),
    ],
)
def test_spec_strings(spec, cls, attrs):
    codec = get_codec(spec)
    assert isinstance(codec, cls)
    for key, value in attrs.items():
        assert getattr(codec, key) == value
    again = get_codec(codec.spec)
    assert type(again) is cls and again.spec == codec.spec


def test_keyword_options_and_names():
    assert set(CODEC_NAMES) == {"none", "fp16", "bf16", "int8", "topk", "1bit", "sparse"}
    assert get_codec("int8", block_size=512).block_size == 512
    assert get_codec("topk", count=7).k_for(100) == 7
    assert get_codec("topk:0.5", fraction=0.1).fraction == 0.1
    assert get_codec("topk").fraction == 0.01
    assert get_codec("1bit", block_size=64).block_size == 64
    assert isinstance(get_codec("none"), Codec)


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "zstd",
        "int8:abc",
        "int8:4:bnb",
        "int8:100:bnb",
        "int8:64:foo",
        "topk:0",
        "topk:1.5",
        "topk:-3",
        "topk:0.1:fp8",
        "1bit:3",
        "fp16:2",
        "int8:1:2:3",
        "topk:0.1:fp16:x",
    ],
)
def test_bad_specs_raise_config_error(spec):
    with pytest.raises(ConfigError):
        get_codec(spec)


def test_bad_keyword_raises_config_error():
    with pytest.raises(ConfigError):
        get_codec("int8", nonsense=1)
    with pytest.raises(ConfigError):
        TopKCodec(fraction=0.1, count=3)


@settings(max_examples=60, deadline=None)
@given(numel=st.integers(1, 5000), data=st.data())
def test_index_encodings_round_trip_and_pick_smallest(numel, data):
    k = data.draw(st.integers(0, numel))
    chosen = data.draw(st.sets(st.integers(0, numel - 1), min_size=k, max_size=k))
    idx = torch.tensor(sorted(chosen), dtype=torch.int64)
    encoding, width, raw = encode_indices(idx, numel)
    assert torch.equal(decode_indices(encoding, width, raw, idx.numel(), numel), idx)
    for other in (FIXED, VARINT, BITMAP):
        if other != encoding:
            # the chosen encoding is never larger than the alternatives
            assert raw.numel() <= _size_of(other, idx, numel)


def _size_of(encoding: int, idx: torch.Tensor, numel: int) -> int:
    if encoding == BITMAP:
        return (numel + 7) // 8
    gaps = torch.diff(idx, prepend=torch.tensor([-1])) - 1
    if encoding == FIXED:
        top = int(gaps.max()) if gaps.numel() else 0
        return idx.numel() * next(w for w in (1, 2, 4, 8) if top < 1 << (8 * w))
    return sum(max(1, math.ceil(int(g).bit_length() / 7)) for g in gaps)


@pytest.mark.parametrize(
    ("idx", "numel", "expected"),
    [
        (list(range(0, 100_000, 100)), 100_000, FIXED),  # uniform gaps of 99: one byte each
        ([*range(50), 90_000], 100_000, VARINT),  # clustered plus one long jump
        (list(range(0, 1000, 2)), 1000, BITMAP),  # dense
    ],
)
def test_each_index_encoding_is_used(idx, numel, expected):
    encoding, _, _ = encode_indices(torch.tensor(idx), numel)
    assert encoding == expected


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16"])
def test_finite_values_whose_sum_overflows_are_not_called_non_finite(spec):
    """The cast codecs check finiteness through one reduction of the values, which finite
    values near the float32 limit overflow: they are recounted, not refused (fp16 saturates)."""
    codec = get_codec(spec)
    x = torch.full((1000,), 3e38)
    x[::2] = -3e38
    x[:4] = 3e38  # the partial sums overflow: inf - inf on the way
    assert not bool(torch.isfinite(x.sum()))
    y = codec.decode(codec.encode(x))
    assert bool(torch.isfinite(y).all())
    if spec == "none":
        assert torch.equal(y, x)
    for bad in (math.inf, math.nan):
        x[7] = bad
        with pytest.raises(CompressionError, match="1 non-finite"):
            codec.encode(x)
