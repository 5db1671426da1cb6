"""Averages staged compressed until their verdict (swarm.averaging.butterfly.staged)."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.averaging.butterfly.flat import FlatStaging, laid_end_to_end
from swarm.averaging.butterfly.staged import StagedAverages, deviations, stage_decoded
from swarm.compression import decode, get_codec
from swarm.errors import CompressionError

CHUNK = 1000


def own_and_average(numel: int = 4 * CHUNK, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(numel, generator=gen)
    return flat, flat + 0.05 * torch.randn(numel, generator=gen)


def stage_chunks(staged: StagedAverages, part: int, average: torch.Tensor, codec: str) -> None:
    for start in range(0, average.numel(), CHUNK):
        end = min(start + CHUNK, average.numel())
        staged.stage(part, start, end, get_codec(codec).encode(average[start:end]))


@pytest.mark.parametrize("codec", ["none", "int8", "sparse:64:8:2"])
@pytest.mark.parametrize("decoded_on_arrival", [False, True])
def test_staged_chunks_apply_what_they_decode_to_and_hold_their_payloads_only(
    codec, decoded_on_arrival
):
    flat, average = own_and_average()
    decoded = torch.cat(
        [decode(get_codec(codec).encode(average[s : s + CHUNK])) for s in range(0, 4000, CHUNK)]
    )
    into = torch.full_like(flat, math.nan) if decoded_on_arrival else None
    staged = StagedAverages(flat, into=into)
    stage_chunks(staged, 0, average, codec)
    # distances measured on arrival are those of the decoded average
    want, _ = deviations(flat, decoded, {0: (0, 4000)})
    got, inside = staged.deviations([0])
    assert got[0] == pytest.approx(want[0], rel=1e-5) and inside == {}
    if decoded_on_arrival:  # decoded once, into the buffer, and applied from there
        assert torch.equal(into, decoded) and staged.staged_bytes == 4 * average.numel()
    else:
        payload_bytes = sum(len(get_codec(codec).encode(average[s : s + CHUNK])) for s in (0,))
        assert staged.staged_bytes <= 4 * payload_bytes + 64  # the payloads, not a float copy
        if codec != "none":
            assert staged.staged_bytes < 4 * average.numel() // 3
    # one float32 tensor: decoded in place; several of other dtypes: through a scratch row
    single = torch.zeros(4000)
    staged.apply([single], [0])
    assert torch.equal(single, decoded)
    pair = [torch.zeros(1500, dtype=torch.bfloat16), torch.zeros(2500)]
    staged.apply(pair, [0])
    assert torch.equal(pair[0], decoded[:1500].bfloat16()) and torch.equal(pair[1], decoded[1500:])


def test_only_codecs_that_compress_keep_their_payloads():
    assert stage_decoded(get_codec("none"))
    for spec in ("fp16", "bf16", "int8", "topk:0.01", "1bit", "sparse"):
        assert not stage_decoded(get_codec(spec)), spec


@pytest.mark.parametrize("decoded_on_arrival", [False, True])
def test_a_new_attempt_forgets_the_last_and_values_replace_chunks(decoded_on_arrival):
    flat, average = own_and_average()
    staged = StagedAverages(flat, into=torch.empty_like(flat) if decoded_on_arrival else None)
    stage_chunks(staged, 0, average[:2000] + 100, "none")  # an attempt that was retried
    staged.begin_part(0)
    stage_chunks(staged, 0, average[:2000], "none")
    repaired = average[2000:] * 0  # a repair's average of part 1, after chunks of a failed try
    staged.stage(1, 2000, 3000, get_codec("none").encode(average[2000:3000] + 100))
    staged.stage_values(1, 2000, repaired)
    out = flat.clone()
    staged.apply([out], [0, 1])
    assert torch.equal(out[:2000], average[:2000]) and not out[2000:].any()
    dev, _ = staged.deviations([0, 1])
    assert dev[1] == pytest.approx(1.0)  # measured on the repaired values, once
    assert staged.deviations([1])[0][1] == pytest.approx(1.0)


def test_kept_ranges_and_whole_parts_are_measured_as_before():
    flat, average = own_and_average()
    kept = ((500, 1500),)
    staged = StagedAverages(flat, kept, whole={1})
    stage_chunks(staged, 0, average[:2000], "none")
    staged.stage(1, 2000, 3000, get_codec("none").encode(average[2000:3000]))
    ranges = {0: (0, 2000), 1: (2000, 3000)}
    want = deviations(flat, average, ranges, kept, whole={1})
    got = staged.deviations(ranges)
    for a, b in zip(got, want, strict=True):
        assert a.keys() == b.keys() and all(a[j] == pytest.approx(b[j]) for j in a)


def test_a_non_finite_average_is_refused_on_arrival_or_reads_nan():
    flat, average = own_and_average(CHUNK)
    payload = bytearray(get_codec("none").encode(average))
    payload[-4:] = struct.pack("<f", math.nan)  # the owner's own bytes: authenticated, wrong
    staged = StagedAverages(flat)
    with pytest.raises(CompressionError, match="non-finite"):
        staged.stage(0, 0, CHUNK, bytes(payload))
    average[7] = math.inf  # an own part reduced to inf is staged as values: NaN, never applied
    staged.stage_values(0, 0, average)
    assert math.isnan(staged.deviations([0])[0][0])


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x00" * 7,
        b"garbage" * 50,
    ],
)
def test_malformed_averages_are_refused_and_nothing_is_staged(payload):
    flat, _ = own_and_average(CHUNK)
    staged = StagedAverages(flat)
    with pytest.raises(CompressionError):
        staged.stage(0, 0, CHUNK, payload)
    assert staged.staged_bytes == 0 and staged.deviations([0]) == ({}, {})


def test_an_average_of_the_wrong_size_is_refused():
    flat, _ = own_and_average(CHUNK)
    staged = StagedAverages(flat)
    for n in (CHUNK - 1, CHUNK + 1):
        payload = get_codec("int8").encode(torch.ones(n))
        with pytest.raises(CompressionError):
            staged.stage(0, 0, CHUNK, payload)
    assert staged.staged_bytes == 0


@settings(max_examples=150, deadline=None)
@given(
    codec=st.sampled_from(["none", "int8", "sparse:64:8:2", "1bit"]),
    cut=st.integers(min_value=0, max_value=4000),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=4),
)
def test_tampered_averages_are_refused_or_staged_never_crash(codec, cut, flips):
    """Truncated or bit-flipped payloads: a CompressionError, or a staged chunk whose distance
    is a number or NaN (refused later), never another error."""
    flat, average = own_and_average(CHUNK)
    payload = bytearray(get_codec(codec).encode(average))[: max(cut, 1)]
    for at, value in flips:
        if payload:
            payload[at % len(payload)] = value
    staged = StagedAverages(flat)
    try:
        staged.stage(0, 0, CHUNK, bytes(payload))
    except CompressionError:
        assert staged.staged_bytes == 0
        return
    dev = staged.deviations([0])[0][0]
    assert math.isnan(dev) or dev >= 0


def test_tensors_laid_end_to_end_in_one_storage_are_read_in_place():
    buffer = torch.arange(10, dtype=torch.float32)
    views = [buffer[:6].view(2, 3), buffer[6:7].view(()), buffer[7:]]
    flat = laid_end_to_end(views)
    assert flat is not None and flat.data_ptr() == buffer.data_ptr() and torch.equal(flat, buffer)
    assert torch.equal(laid_end_to_end(views[1:]), buffer[6:])
    staging = FlatStaging()
    got, in_place = staging.gather(views, 10)
    assert in_place and got.data_ptr() == buffer.data_ptr() and staging._flat is None
    # what the round writes into the flat vector lands in the views
    StagedAverages(got).apply([got], [])
    got[7:].fill_(-1)
    assert torch.equal(views[2], torch.full((3,), -1.0))


@pytest.mark.parametrize(
    "tensors",
    [
        [torch.zeros(3), torch.zeros(4)],  # two storages
        [torch.zeros(10)[5:], torch.zeros(10)[:5]],  # two storages again
        "out of order",
        "a gap",
        "float64",
        "not contiguous",
    ],
)
def test_other_tensors_are_gathered_into_a_copy(tensors):
    buffer = torch.zeros(12)
    named = {
        "out of order": [buffer[6:], buffer[:6]],
        "a gap": [buffer[:4], buffer[5:]],
        "float64": [torch.zeros(12, dtype=torch.float64)[:6], torch.zeros(6, dtype=torch.float64)],
        "not contiguous": [buffer.view(3, 4).t()],
    }
    tensors = named[tensors] if isinstance(tensors, str) else tensors
    assert laid_end_to_end(tensors) is None
    staging = FlatStaging()
    numel = sum(t.numel() for t in tensors)
    got, in_place = staging.gather(tensors, numel)
    assert not in_place and got.numel() == numel and staging._flat is got
