"""The chunked sparse codec: exact top-k per chunk, values within the quantization bound,
error feedback with decay, and hostile payloads refused with one clear error."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.compression import ErrorFeedback, decode, decode_into, get_codec, read_header
from swarm.compression.header import Header
from swarm.compression.sparse import SparseCodec
from swarm.errors import CompressionError, ConfigError

PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SETTINGS = st.sampled_from([(4096, 64, 2), (64, 1, 2), (16, 3, 4), (256, 8, 3), (2, 1, 8)])


def _bound(codec: SparseCodec, kept: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """Half a magnitude bin of each kept value's scale block, from the true (unrounded) range,
    widened by the bfloat16 rounding of the range's ends (at most 2^-8 relative)."""
    mags = kept.abs()
    blocks = int(block.max()) + 1 if block.numel() else 0
    lo = torch.full((blocks,), math.inf).scatter_reduce(0, block, mags, "amin")
    hi = torch.zeros(blocks).scatter_reduce(0, block, mags, "amax")
    width = (hi * (1 + 2**-7) - lo * (1 - 2**-7)) / codec.levels
    return (width / 2)[block] + 1e-30


@PROPS
@given(settings_=SETTINGS, numel=st.integers(0, 5000), seed=st.integers(0, 2**31 - 1))
def test_keeps_exactly_the_top_k_of_each_chunk_within_the_bound(settings_, numel, seed):
    chunk, k, bits = settings_
    codec = SparseCodec(chunk, k, bits)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen).exp()
    y = decode(codec.encode(x))
    assert y.shape == x.shape and y.dtype == x.dtype
    full, tail, kept, _ = codec.layout(numel)
    assert int((y != 0).sum()) == kept  # nonzero inputs decode to nonzero values
    block_of = []
    for c in range(full + (1 if tail else 0)):
        start = c * chunk
        xs, ys = x[start : start + chunk], y[start : start + chunk]
        chosen = ys != 0
        # exactly the k largest magnitudes of the chunk (no tie in continuous data)
        top = torch.topk(xs.abs(), min(k, xs.numel())).indices
        assert set(chosen.nonzero().view(-1).tolist()) == set(top.tolist())
        assert torch.equal(torch.sign(ys[chosen]), torch.sign(xs[chosen]))
        block_of += [c // codec.block_chunks] * int(chosen.sum())
    if kept:
        mask = y != 0
        block = torch.tensor(block_of)
        assert bool(((y[mask] - x[mask]).abs() <= _bound(codec, x[mask], block)).all())


@PROPS
@given(
    settings_=SETTINGS,
    numel=st.integers(1, 3000),
    seed=st.integers(0, 2**31 - 1),
    decay=st.sampled_from([1.0, 0.95, 0.5]),
)
def test_error_feedback_residual_plus_decoded_is_the_input(settings_, numel, seed, decay):
    chunk, k, bits = settings_
    codec = SparseCodec(chunk, k, bits, decay)
    feedback = ErrorFeedback(codec)
    gen = torch.Generator().manual_seed(seed)
    old = torch.zeros(numel)
    for _ in range(3):
        x = torch.randn(numel, generator=gen)
        sent = decode(feedback.encode(x))
        # r_new = d * (x + r_old - D(c))
        assert torch.allclose(feedback.residual / decay + sent, x + old, atol=1e-5, rtol=1e-5)
        old = feedback.residual.clone()


def test_spec_strings_and_settings():
    assert get_codec("sparse").spec == "sparse:4096:96:2"
    assert get_codec("sparse:64:1:2").spec == "sparse:64:1:2"
    assert get_codec("sparse").feedback_decay == 0.95
    codec = get_codec("sparse:4096:64:4:1.0")
    assert (codec.chunk, codec.k, codec.bits, codec.feedback_decay) == (4096, 64, 4, 1.0)
    assert codec.sparse and codec.spec == "sparse:4096:64:4:1.0"
    assert get_codec("sparse:4096:64:2:0.95").spec == "sparse:4096:64:2"
    for bad in (
        "sparse:100",
        "sparse:4096:0",
        "sparse:4096:5000",
        "sparse:4096:64:1",
        "sparse:4096:64:9",
        "sparse:4096:64:2:0",
        "sparse:4096:64:2:1.5",
        "sparse:1:1",
        "sparse:131072",
        "sparse:4096:64:2:1:9",
        "sparse:4096:1.5",
    ):
        with pytest.raises(ConfigError):
            get_codec(bad)


def test_bytes_per_round_at_the_default():
    codec = get_codec("sparse")
    payload = codec.encode(torch.randn(1 << 20))
    # 256 chunks of 4096, 96 kept each: a bfloat16 scale pair, a map of 96 + 128 - 1 bits,
    # 5 low bits and 2 bits of code per kept value
    assert len(payload) == read_header(payload).size + 256 * 4 + 256 * 223 // 8 + 256 * 96 * 7 // 8
    assert 4 * (1 << 20) / len(payload) > 140
    # 64 kept: a map of 64 + 64 - 1 bits, 6 low bits and 2 of code; 12-bit positions took 116
    payload = get_codec("sparse:4096:64:2").encode(torch.randn(1 << 20))
    assert len(payload) == read_header(payload).size + 256 * 4 + 256 * 127 // 8 + 256 * 64


def test_decode_into_accumulates_with_a_weight():
    codec = get_codec("sparse:64:4:2")
    x = torch.randn(1000)
    payload = codec.encode(x)
    out = torch.ones(1000)
    decode_into(payload, out, weight=0.5)
    assert torch.allclose(out, 1 + 0.5 * decode(payload))
    decode_into(payload, out, weight=2.0, accumulate=False)
    assert torch.allclose(out, 2 * decode(payload))


def test_half_precision_inputs_and_non_finite_refused():
    codec = get_codec("sparse:64:4:2")
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(300).to(dtype)
        assert decode(codec.encode(x)).dtype == dtype
    x = torch.randn(300)
    x[7] = math.nan
    with pytest.raises(CompressionError, match="non-finite"):
        codec.encode(x)


@PROPS
@given(
    shape=st.sampled_from([(4096, 64), (1024, 16), (256, 4), (64, 1), (16, 3)]),
    rows=st.integers(1, 4),
    spread=st.sampled_from([3, 50, 2**31 - 1]),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_two_pass_top_k_finds_the_top_values_of_each_row_ties_included(
    shape, rows, spread, seed
):
    """The CPU's two-pass selection keeps k distinct positions per row whose values are the
    row's k largest, with ties everywhere (spread 3) or nowhere."""
    from swarm.compression.sparse import _top_k_of_rows

    chunk, k = shape
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, spread, (rows, chunk), generator=gen, dtype=torch.int32)
    got = _top_k_of_rows(values, k)
    assert got.shape == (rows, k)
    assert all(len(set(row.tolist())) == k for row in got)
    kept = torch.sort(torch.gather(values, 1, got), dim=1).values
    assert torch.equal(kept, torch.sort(torch.topk(values, k, dim=1).values, dim=1).values)


def test_non_finite_values_in_long_chunks_are_refused():
    codec = get_codec("sparse")
    for bad in (math.nan, math.inf, -math.inf):
        x = torch.randn(3 * 4096)
        x[5000] = bad
        with pytest.raises(CompressionError, match="non-finite"):
            codec.encode(x)


# ---- hostile payloads


def _parts(payload: bytes) -> tuple[Header, bytes, bytes, bytes]:
    header = read_header(payload)
    body = payload[header.size :]
    a, b, _ = header.section_lengths
    return header, body[:a], body[a : a + b], body[a + b :]


def _craft(header: Header, scales: bytes, positions: bytes, codes: bytes, **fields) -> bytes:
    lengths = (len(scales), len(positions), len(codes))
    h = Header(
        fields.get("codec", header.codec),
        header.dtype,
        fields.get("shape", header.shape),
        fields.get("block", header.block_size),
        fields.get("param", header.param),
        fields.get("flags", header.flags),
        lengths,
    )
    return h.serialize() + scales + positions + codes


def _stream(values: list[int], width: int) -> bytes:
    """``width``-bit values packed LSB first, by hand."""
    bits = 0
    for i, v in enumerate(values):
        bits |= v << (i * width)
    return bits.to_bytes((len(values) * width + 7) // 8, "little")


def _positions(codec: SparseCodec, rows: list[list[int]], tail: list[int] = ()) -> bytes:
    """The positions section for full chunks' ``rows`` (in the order given) and the last
    chunk's ``tail``, built bit by bit from the module docstring's rule."""
    b, marks = codec.low_bits, []
    for row in rows:
        ones = {j + (p >> b) for j, p in enumerate(row)}
        marks += [int(i in ones) for i in range(codec.map_bits)]
    lows = [p & ((1 << b) - 1) for row in rows for p in row]
    return _stream(marks, 1) + _stream(lows, b) + _stream(list(tail), codec.index_bits)


def _unpack_stream(data: bytes, width: int, count: int) -> list[int]:
    bits = int.from_bytes(data, "little")
    return [(bits >> (i * width)) & ((1 << width) - 1) for i in range(count)]


@PROPS
@given(settings_=SETTINGS, numel=st.integers(1, 3000), seed=st.integers(0, 2**31 - 1))
def test_positions_are_laid_out_as_documented(settings_, numel, seed):
    codec = SparseCodec(*settings_)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    payload = codec.encode(x)
    _, _, positions, _ = _parts(payload)
    full, tail, _, _ = codec.layout(numel)
    y = decode(payload)
    chunks = [y[c * codec.chunk : (c + 1) * codec.chunk] for c in range(full)]
    rows = [(c != 0).nonzero().view(-1).tolist() for c in chunks]
    if tail:  # the last chunk's positions in the encoder's order: check them as a set
        last = positions[len(_positions(codec, rows)) :]
        got = [int(v) for v in _unpack_stream(last, codec.index_bits, min(codec.k, tail))]
        assert sorted(got) == (y[full * codec.chunk :] != 0).nonzero().view(-1).tolist()
        assert positions == _positions(codec, rows, got)
    else:
        assert positions == _positions(codec, rows)


def test_repeated_unordered_miscounted_and_out_of_range_positions_are_refused():
    codec = get_codec("sparse:16:3:2")  # 2 low bits, a map of 3 + 4 - 1 bits
    payload = codec.encode(torch.randn(16 + 5))  # one full chunk, a tail of 5
    header, scales, _, codes = _parts(payload)
    ok = _positions(codec, [[0, 5, 15]], [0, 1, 2])
    assert decode(_craft(header, scales, ok, codes)).shape == (21,)
    for rows, tail, match in (
        ([[5, 5, 9]], [0, 1, 2], "repeats a position"),  # same slice, same low bits
        ([[6, 5, 9]], [0, 1, 2], "out of order"),
        ([[0, 5, 15]], [4, 4, 1], "repeats a position"),
        ([[0, 5, 15]], [0, 1, 9], "past its last chunk"),
    ):
        with pytest.raises(CompressionError, match=match):
            decode(_craft(header, scales, _positions(codec, rows, tail), codes))
    lows = _stream([0, 1, 3], 2)
    for marks in ([1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0], [0] * 6):  # 2, 4 and 0 marked
        crafted = _stream(marks, 1) + lows + _stream([0, 1, 2], 4)
        with pytest.raises(CompressionError, match="does not mark 3 positions"):
            decode(_craft(header, scales, crafted, codes))


@pytest.mark.parametrize(
    ("lo", "hi", "match"),
    [
        (math.nan, 1.0, "scales"),
        (0.5, math.inf, "scales"),
        (-1.0, 1.0, "scales"),
        (2.0, 1.0, "scales"),
    ],
)
def test_hostile_scales_are_refused(lo, hi, match):
    codec = get_codec("sparse:64:4:2")
    payload = codec.encode(torch.randn(64))
    header, _, positions, codes = _parts(payload)
    scales = torch.tensor([lo, hi]).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    with pytest.raises(CompressionError, match=match):
        decode(_craft(header, scales, positions, codes))


def test_non_zero_padding_and_wrong_settings_are_refused():
    codec = get_codec("sparse:16:3:2")  # a map of 6 bits, then 3 x 2 low bits: 2 bytes
    payload = codec.encode(torch.randn(16))
    header, scales, positions, codes = _parts(payload)
    for byte in (0, 1):  # the map's padding, the low bits'
        padded = bytearray(positions)
        padded[byte] |= 0x80
        with pytest.raises(CompressionError, match="padding"):
            decode(_craft(header, scales, bytes(padded), codes))
    for fields in ({"block": 12}, {"param": 0}, {"param": 17}, {"flags": 1}, {"flags": 9}):
        with pytest.raises(CompressionError, match="settings"):
            decode(_craft(header, scales, positions, codes, **fields))
    with pytest.raises(CompressionError, match="sections"):  # k=8 needs more bytes
        decode(_craft(header, scales, positions, codes, param=8))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_payloads_decode_or_raise_one_error(data):
    chunk, k, bits = data.draw(SETTINGS)
    numel = data.draw(st.integers(1, 600))
    payload = bytearray(SparseCodec(chunk, k, bits).encode(torch.randn(numel)))
    size = read_header(bytes(payload)).size
    for _ in range(data.draw(st.integers(1, 6))):
        if len(payload) > size:
            i = data.draw(st.integers(size, len(payload) - 1))
            payload[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        payload = payload[: data.draw(st.integers(0, len(payload)))]
    try:
        out = decode(bytes(payload), max_numel=numel)
    except CompressionError:
        return
    assert out.shape == (numel,) and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("width", range(1, 17))
def test_packing_is_the_lsb_first_bit_stream(width):
    """Both packers (int64 words, and numpy bits for widths whose groups pass 64 bits) write
    the same LSB-first stream as a bit-by-bit reference, and unpack back."""
    from swarm.compression.bits import pack_bits
    from swarm.compression.sparse import _pack, _unpack

    gen = torch.Generator().manual_seed(width)
    for count in (0, 1, 3, 7, 8, 9, 1001):
        values = torch.randint(0, 1 << width, (count,), generator=gen)
        bits = (values.unsqueeze(1) >> torch.arange(width)) & 1
        assert torch.equal(_pack(values, width), pack_bits(bits.to(torch.bool).reshape(-1)))
        assert torch.equal(_unpack(_pack(values, width), width, count), values)
