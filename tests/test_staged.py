"""Averages staged compressed until their verdict (swarm.averaging.butterfly.staged)."""

from __future__ import annotations

import math
import struct
from collections.abc import Collection

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.averaging.butterfly.flat import FlatStaging, laid_end_to_end
from swarm.averaging.butterfly.staged import Range, StagedAverages, stage_decoded
from swarm.compression import decode, get_codec
from swarm.errors import CompressionError

CHUNK = 1000


def own_and_average(numel: int = 4 * CHUNK, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(numel, generator=gen)
    return flat, flat + 0.05 * torch.randn(numel, generator=gen)


def deviations(
    flat: torch.Tensor,
    result: torch.Tensor,
    ranges: dict[int, Range],
    kept: tuple[Range, ...] = (),
    whole: Collection[int] = (),
) -> tuple[dict[int, float], dict[int, float]]:
    """The distances of parts whose averages ``result`` holds (a float32 vector like ``flat``),
    as a round measures them."""
    staged = StagedAverages(flat, kept, whole)
    for part, (start, end) in ranges.items():
        staged.stage_values(part, start, result[start:end])
    return staged.deviations(ranges)


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


def test_an_average_in_another_codec_than_the_rounds_is_refused():
    """An owner that answers a sparse round in float32 would make the member hold four bytes a
    value: only the round's codec is staged (honest owners encode in it)."""
    flat, average = own_and_average(CHUNK)
    staged = StagedAverages(flat, codec="sparse")
    with pytest.raises(CompressionError, match="round's codec is sparse"):
        staged.stage(0, 0, CHUNK, get_codec("none").encode(average))
    assert staged.staged_bytes == 0
    staged.stage(0, 0, CHUNK, get_codec("sparse:64:8:2").encode(average))  # its own parameters
    assert 0 < staged.staged_bytes < CHUNK


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


def test_deviation_of_a_non_finite_average_is_nan_and_never_applied():
    from swarm.averaging.butterfly.checks import not_finite

    flat = torch.ones(6)
    result = torch.tensor([1.0, 1.1, float("inf"), 1.0, float("nan"), 1.0])
    dev, inside = deviations(flat, result, {0: (0, 2), 1: (2, 4), 2: (4, 6)})
    assert dev[0] < 0.1 and math.isnan(dev[1]) and math.isnan(dev[2]) and inside == {}
    assert set(not_finite(dev)) == {1, 2}
    # finite values whose float32 norms overflow: measured in float64, not taken for NaN
    huge, _ = deviations(torch.ones(2), torch.full((2,), 3e38), {0: (0, 2)})
    assert 1e37 < huge[0] < float("inf")
    own_huge, _ = deviations(torch.full((4,), 1e30), torch.ones(4), {0: (0, 4)})
    assert own_huge[0] == pytest.approx(1.0)
    # a non-finite value inside the kept ranges is found there
    dev, inside = deviations(flat, result, {0: (0, 4)}, ((1, 3),))
    assert dev[0] < 0.1 and math.isnan(inside[0]) and set(not_finite(dev, inside)) == {0}


def test_deviations_of_parts_longer_than_a_span_are_measured_whole():
    """Parts are measured a span at a time (no part-sized temporary); the figure is the whole
    part's, non-finite values in a later span included."""
    from swarm.averaging.butterfly.staged import _SPAN

    gen = torch.Generator().manual_seed(3)
    flat = torch.randn(2 * _SPAN + 5, generator=gen)
    result = flat + 0.01 * torch.randn(flat.numel(), generator=gen)
    result[_SPAN + 7 :] += 0.5  # most of the deviation lies past the first span
    dev, _ = deviations(flat, result, {0: (3, flat.numel())})
    want = float((result[3:] - flat[3:]).double().norm() / flat[3:].double().norm())
    assert dev[0] == pytest.approx(want, rel=1e-4)  # float32 sums
    result[-1] = float("nan")
    assert math.isnan(deviations(flat, result, {0: (3, flat.numel())})[0][0])


def test_an_owner_accused_before_gets_no_leniency_in_kept_ranges():
    """A liar refused once leaves the member with its own values of its part: the next round of
    values must not hold that owner to the looser bound there."""
    from swarm.averaging.butterfly.checks import implausible_parts

    flat = torch.ones(400)
    result = flat.clone()
    result[:300] += 0.005  # the honest spread
    result[300:] += 0.3  # part 3, wholly kept lately: 0.3 from the own values
    ranges = {0: (0, 100), 1: (100, 200), 2: (200, 300), 3: (300, 400)}
    dev, inside = deviations(flat, result, ranges, ((300, 400),))
    assert set(dev) == {0, 1, 2} and inside[3] == pytest.approx(0.3)
    assert implausible_parts(dev, lenient=inside) == {}  # an honest owner there: not accused
    dev, inside = deviations(flat, result, ranges, ((300, 400),), whole={3})
    assert inside == {} and dev[3] == pytest.approx(0.3)
    assert set(implausible_parts(dev, lenient=inside)) == {3}


def test_a_slice_left_between_kept_ranges_is_measured_against_its_whole_part():
    """Measured in 8-peer runs where colluders refused one member: the rest of a part outside
    its kept ranges was a bias near 0, whose honest average read 0.38-0.98 from those small
    values where the other parts read 0.01-0.05, and the member accused honest owners. Relative
    to the whole part the same average reads as the others do; a lie in the slice, as large
    as the part's values, still reads far."""
    from swarm.averaging.butterfly.checks import implausible_parts

    gen = torch.Generator().manual_seed(3)
    flat = torch.randn(4000, generator=gen)
    flat[1900:2000] *= 0.01  # a bias near 0, outside the kept range
    average = flat + 0.01 * torch.randn(4000, generator=gen)
    average[1900:2000] = flat[1900:2000] + 0.005 * torch.randn(100, generator=gen)
    ranges = {0: (0, 2000), 1: (2000, 3000), 2: (3000, 4000)}
    kept = ((0, 1900),)
    outside, inside = deviations(flat, average, ranges, kept)
    assert outside[0] < 2 * outside[1] and implausible_parts(outside, lenient=inside) == {}
    lie = average.clone()
    lie[1900:2000] = 5.0 * torch.randn(100, generator=gen)
    outside, inside = deviations(flat, lie, ranges, kept)
    assert set(implausible_parts(outside, lenient=inside)) == {0}
    # a part wholly kept has no rest to measure
    assert 0 not in deviations(flat, average, ranges, ((0, 2000),))[0]


@pytest.mark.parametrize("codec", ["none", "int8", "sparse:64:8:2"])
@pytest.mark.parametrize("decoded_on_arrival", [False, True])
def test_an_owners_own_chunks_apply_the_bits_its_members_apply(codec, decoded_on_arrival):
    """The owner stages its own part from the payloads it sends and what they decode to, in a
    chunk-sized row it reuses at once: the values it applies are the members' to the bit, it
    holds what a member holds (payloads, or the decoded buffer), and its distances are theirs."""
    from swarm.compression.feedback import encode_keeping_error

    flat, average = own_and_average()
    into = (lambda: torch.full_like(flat, math.nan)) if decoded_on_arrival else (lambda: None)
    owner, member = StagedAverages(flat, into=into()), StagedAverages(flat, into=into())
    row = torch.empty(CHUNK)
    for start in range(0, average.numel(), CHUNK):
        row.copy_(average[start : start + CHUNK])
        payload = encode_keeping_error(get_codec(codec), row.clone(), decoded=row)
        owner.stage_own(2, start, payload, row)
        member.stage(2, start, start + CHUNK, payload)
        row.fill_(math.nan)  # the owner's rows go back to its pool
    applied = [torch.full_like(flat, math.nan) for _ in range(2)]
    owner.apply([applied[0]], [2])
    member.apply([applied[1]], [2])
    assert torch.equal(applied[0], applied[1]) and not applied[0].isnan().any()
    assert owner.staged_bytes == member.staged_bytes
    assert owner.deviations([2]) == member.deviations([2])


def test_a_kept_sliver_is_measured_against_its_parts_size_over_as_many_values():
    """Plans cut the vector a little differently from round to round, so a range kept in one
    round may overlap the next round's part by one value. Alone, that value's honest average
    lay 2.7-4.0 times its own small size from it (8 peers, colluders refusing one member), and
    the member accused honest owners. Against the part's size over one value it reads 0.06-0.17;
    a huge value there still reads far."""
    from swarm.averaging.butterfly.checks import implausible_parts

    gen = torch.Generator().manual_seed(5)
    flat = torch.randn(4 * 691, generator=gen)
    average = flat + 0.02 * torch.randn(flat.numel(), generator=gen)
    flat[690] = 0.002  # the sliver: one small value kept lately, at the end of part 0
    average[690] = 0.011  # the others' average there: 4.5 times its size away
    ranges = {p: (691 * p, 691 * (p + 1)) for p in range(4)}
    kept = ((690, 691),)
    outside, inside = deviations(flat, average, ranges, kept)
    # (against its own size alone, the sliver reads 4.5: refused as an outright lie)
    assert inside[0] < 0.05 and implausible_parts(outside, lenient=inside) == {}
    lie = average.clone()
    lie[690] = 500.0
    outside, inside = deviations(flat, lie, ranges, kept)
    assert set(implausible_parts(outside, lenient=inside)) == {0}
    # a range as large as its part is measured against its own values, as before
    shifted = average + 0.3
    outside, inside = deviations(flat, shifted, ranges, ((0, 691),))
    want = (shifted[:691] - flat[:691]).double().norm() / flat[:691].double().norm()
    assert 0 not in outside and inside[0] == pytest.approx(float(want), rel=1e-4)
