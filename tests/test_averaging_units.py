"""Sans-I/O parts of averaging: part plan, leader rule, group records, reducer, error feedback."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import random
import time
import types

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.address import PeerAddress
from swarm.averaging.butterfly.context import RoundContext
from swarm.averaging.butterfly.intake import PartIntake
from swarm.averaging.butterfly.parts import (
    CHUNK_ALIGN,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    PartPlan,
    chunk_bytes_for,
    chunk_elems_for,
    schema_hash,
    split_parts,
)
from swarm.averaging.butterfly.reducer import PartReducer, SenderState, check_weight
from swarm.averaging.butterfly.repair import Repair
from swarm.averaging.butterfly.residuals import RESIDUAL_DTYPE, FlatFeedback
from swarm.averaging.butterfly.robust import TRIO_RADIUS
from swarm.averaging.butterfly.stall import StallPolicy
from swarm.averaging.butterfly.workers import Workers
from swarm.averaging.faults import Fault, FaultInjector
from swarm.averaging.groups.group import Declaration, GroupInfo, choose_leader, matchmaking_key
from swarm.averaging.result import RoundResult
from swarm.compression import decode, get_codec
from swarm.errors import AveragingError, CompressionError, TransportError
from swarm.identity import Identity, PeerID
from swarm.net.record import PeerRecord

bandwidths = st.lists(
    st.one_of(st.just(0.0), st.floats(min_value=1e-3, max_value=1e12)), min_size=1, max_size=12
)


@given(numel=st.integers(0, 10**9), bws=bandwidths)
@settings(deadline=None)
def test_split_parts_covers_exactly_in_proportion(numel, bws):
    ranges = split_parts(numel, bws)
    assert len(ranges) == len(bws)
    assert ranges[0][0] == 0 and ranges[-1][1] == numel
    for (s0, e0), (s1, _) in itertools.pairwise(ranges):
        assert s0 <= e0 == s1
    total = sum(bws)
    for (s, e), b in zip(ranges, bws, strict=True):
        if total > 0:
            assert abs((e - s) - numel * b / total) < 1 + 1e-6 * numel
            if b == 0:
                assert e == s  # bandwidth 0 owns nothing
        else:
            assert abs((e - s) - numel / len(bws)) < 1


@given(numel=st.integers(0, 10**9), bws=bandwidths, first=st.integers(0, 11))
@settings(deadline=None)
def test_a_turned_layout_gives_every_member_the_same_size_from_member_first_on(numel, bws, first):
    first %= len(bws)
    plain, turned = split_parts(numel, bws), split_parts(numel, bws, first)
    assert [e - s for s, e in turned] == [e - s for s, e in plain]
    order = [(first + k) % len(bws) for k in range(len(bws))]
    assert turned[order[0]][0] == 0 and turned[order[-1]][1] == numel
    for a, b in itertools.pairwise(order):
        assert turned[a][1] == turned[b][0]


def test_split_parts_rejects_junk():
    for bad in ([], [-1.0], [float("nan")], [float("inf")]):
        with pytest.raises(AveragingError):
            split_parts(10, bad)
    with pytest.raises(AveragingError):
        split_parts(-1, [1.0])


@given(numel=st.integers(0, 10**6), bws=bandwidths, chunk=st.integers(100, 10**6))
@settings(deadline=None)
def test_part_plan_chunks_tile_each_part(numel, bws, chunk):
    plan = PartPlan.create(numel, bws, chunk)
    for j in range(len(plan)):
        chunks = plan.chunks(j)
        assert len(chunks) == plan.num_chunks(j)
        start, end = plan.ranges[j]
        if chunks:
            assert chunks[0][0] == start and chunks[-1][1] == end
            assert all(0 < e - s <= chunk for s, e in chunks)
        else:
            assert start == end
    assert set(plan.owned()) == {j for j in range(len(plan)) if plan.size(j) > 0}


@pytest.mark.parametrize("max_bytes", [MAX_CHUNK_BYTES, MIN_CHUNK_BYTES])
@pytest.mark.parametrize("spec", ["none", "fp16", "bf16", "int8", "topk:0.01", "1bit"])
def test_chunks_fit_one_frame(spec, max_bytes):
    codec = get_codec(spec)
    n = chunk_elems_for(codec, max_bytes)
    assert n % CHUNK_ALIGN == 0
    assert codec.estimate_size(n) <= max_bytes
    assert len(codec.encode(torch.randn(n))) <= max_bytes


def test_chunks_shrink_to_what_the_slowest_measured_link_moves():
    mbit = 1e6 / 8
    assert chunk_bytes_for((), 4) == MAX_CHUNK_BYTES  # nobody measured yet
    assert chunk_bytes_for((0.0, 0.0), 2) == MAX_CHUNK_BYTES
    assert chunk_bytes_for((100 * mbit,) * 4, 4) == 256 << 10  # 6 streams at 100 Mbit/s
    assert chunk_bytes_for((1000 * mbit,) * 4, 4) == MAX_CHUNK_BYTES  # fast links: the maximum
    # the slowest measured member decides; unmeasured ones (0) do not count
    assert chunk_bytes_for((1000 * mbit, 0.0, 100 * mbit, 1000 * mbit), 4) == 256 << 10
    # a leader's tiny or absurd figures cost at most the smallest chunk, never less
    assert chunk_bytes_for((1e-300, 1e300), 2) == MIN_CHUNK_BYTES
    assert chunk_bytes_for((1e300,), 2) == MAX_CHUNK_BYTES
    assert chunk_bytes_for((100 * mbit,), 1) == MAX_CHUNK_BYTES  # a lone member streams nothing
    for rate in (1e5, 3e6, 12.5e6, 40e6, 1e9):
        size = chunk_bytes_for((rate, 2 * rate), 3)
        assert size % MIN_CHUNK_BYTES == 0 and MIN_CHUNK_BYTES <= size <= MAX_CHUNK_BYTES


def test_schema_hash_separates_shapes_dtypes_and_codecs():
    a = [torch.zeros(3, 4), torch.zeros(5)]
    assert schema_hash(a, "none") == schema_hash([torch.ones(3, 4), torch.ones(5)], "none")
    assert schema_hash(a, "none") != schema_hash([torch.zeros(4, 3), torch.zeros(5)], "none")
    assert schema_hash(a, "none") != schema_hash([torch.zeros(3, 4).half(), torch.zeros(5)], "none")
    assert schema_hash(a, "none") != schema_hash(a, "int8")
    assert matchmaking_key("run", "g", "abc") == "run/mm/g/abc"


def _pid(i: int) -> PeerID:
    return PeerID(i.to_bytes(32, "big"))


@given(
    ids=st.sets(st.integers(0, 1000), min_size=1, max_size=20),
    data=st.data(),
)
@settings(deadline=None)
def test_choose_leader_rule(ids, data):
    peers = [_pid(i) for i in ids]
    leading = data.draw(st.lists(st.sampled_from(peers), max_size=3))
    exclude = data.draw(st.lists(st.sampled_from(peers), max_size=3))
    got = choose_leader(peers, leading, exclude)
    left = [p for p in leading if p not in exclude] or [p for p in peers if p not in exclude]
    if not left:
        assert got is None
    else:
        assert got == min(left, key=lambda p: p.digest)


def test_two_stale_views_agree_on_one_leader():
    # both see the same smallest candidate even when each misses some others
    a, b, c, d = (_pid(i) for i in (1, 2, 3, 4))
    assert choose_leader([b, c, a]) == choose_leader([a, d, c]) == a
    # a leader with followers attracts even smaller candidates
    assert choose_leader([a, c, d], leading=[c]) == c


@pytest.fixture(scope="module")
def records():
    out = []
    for i in range(4):
        ident = Identity.generate()
        out.append(
            PeerRecord.create(
                ident,
                address=PeerAddress("127.0.0.1", 4000 + i),
                run_id="run",
                bandwidth=float(i),
            )
        )
    return out


def test_declaration_round_trip_and_owner_check(records):
    decl = Declaration(records[0], time.time() + 5, busy=False, leading=True, size=3)
    back = Declaration.parse(decl.serialize(), records[0].peer_id)
    assert back == decl
    with pytest.raises(AveragingError):
        Declaration.parse(decl.serialize(), records[1].peer_id)


@pytest.mark.parametrize(
    "junk",
    [
        b"",
        b"\xff" * 40,
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"r": b"x", "d": 1.0}),
        msgpack.packb({"r": 5, "d": 1.0}),
        msgpack.packb({"d": float("nan")}),
        b"\x00" * 5000,
        12,
        None,
    ],
)
def test_declaration_rejects_hostile_values(junk, records):
    with pytest.raises(AveragingError):
        Declaration.parse(junk, records[0].peer_id)


@pytest.mark.parametrize("size", [0, -1, 10**6, "3", 2.0, True, None])
def test_declaration_rejects_a_bad_group_size(size, records):
    good = {"r": records[0].serialize(), "d": time.time() + 5.0, "b": False, "l": True}
    assert Declaration.parse(msgpack.packb({**good, "n": 2}), records[0].peer_id).size == 2
    with pytest.raises(AveragingError):
        Declaration.parse(msgpack.packb({**good, "n": size}), records[0].peer_id)


@given(data=st.binary(max_size=300))
@settings(max_examples=200, deadline=None)
def test_declaration_fuzz_never_crashes(data):
    with pytest.raises(AveragingError):
        Declaration.parse(data, _pid(1))


def test_group_info_round_trip_and_validation(records):
    group = GroupInfo.create(records)
    assert [r.peer_id.digest for r in group.members] == sorted(r.peer_id.digest for r in records)
    me, leader = records[2].peer_id, records[0].peer_id
    back = GroupInfo.from_wire(
        msgpack.unpackb(msgpack.packb(group.to_wire())), me=me, leader=leader
    )
    assert back == group
    assert back.index_of(me) == list(back.peer_ids).index(me)
    wire = group.to_wire()
    legacy = {"g": wire["g"], "m": wire["m"]}  # not known to agree: False
    assert not GroupInfo.from_wire(legacy, me=me, leader=leader).agreed
    agreed = GroupInfo.create(records, agreed=True).to_wire()
    assert GroupInfo.from_wire(agreed, me=me, leader=leader).agreed
    bad = [
        None,
        *({**wire, "a": junk} for junk in (1, "yes", None, b"\x01")),
        {"g": b"short", "m": wire["m"]},
        {"g": wire["g"], "m": wire["m"][:1]},
        {"g": wire["g"], "m": [*wire["m"], wire["m"][0]]},
        {"g": wire["g"], "m": [*wire["m"][:3], b"junk"]},
        {"g": wire["g"], "m": [*wire["m"][:3], 7]},
    ]
    for obj in bad:
        with pytest.raises(AveragingError):
            GroupInfo.from_wire(obj, me=me, leader=leader)
    other = Identity.generate().peer_id
    with pytest.raises(AveragingError):
        GroupInfo.from_wire(wire, me=other, leader=leader)
    with pytest.raises(AveragingError):
        group.index_of(other)


def test_check_weight():
    assert check_weight(3) == 3.0
    for bad in (-1, float("nan"), float("inf"), "1", True, None, 1e40):
        with pytest.raises(AveragingError):
            check_weight(bad)


def _chunks(n: int, size: int) -> tuple[tuple[int, int], ...]:
    return tuple((s, min(s + size, n)) for s in range(0, n, size))


@given(
    n=st.integers(1, 3000),
    pieces=st.integers(1, 48),
    weights=st.lists(st.floats(0.1, 10), min_size=2, max_size=6),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=60, deadline=None)
def test_reducer_weighted_mean_in_any_arrival_order(n, pieces, weights, seed):
    # up to 48 chunks of any size: 3000 one-value chunks from 5 senders took a quarter minute
    # of encodes and orders nothing more than 48 chunks do
    chunk = -(-n // pieces)
    rng = random.Random(seed)
    codec = get_codec("none")
    values = [
        torch.randn(n, generator=torch.Generator().manual_seed(seed + i))
        for i in range(len(weights))
    ]
    acc = torch.empty(n)
    chunks = _chunks(n, chunk)
    senders = list(range(1, len(weights)))
    r = PartReducer(chunks, senders, "mean")
    r.begin(values[0], weights[0])
    for s in senders:
        r.accept(s, weights[s])
    queue = [(s, i) for s in senders for i in range(len(chunks))]
    # interleave senders at random but keep each sender's chunks in order
    order: list[tuple[int, int]] = []
    progress = dict.fromkeys(senders, 0)
    while len(order) < len(queue):
        s = rng.choice([x for x in senders if progress[x] < len(chunks)])
        order.append((s, progress[s]))
        progress[s] += 1
    for s, i in order:
        assert r.next_index(s) == i
        a, b = chunks[i]
        r.add_chunk(s, i, codec.encode(values[s][a:b]))
        r.chunk_added(s)
    for s in senders:
        r.complete(s)
    assert r.settled()
    assert finish(r, acc) == tuple(senders)
    expected = sum(w * v for w, v in zip(weights, values, strict=True)) / sum(weights)
    torch.testing.assert_close(acc, expected, rtol=1e-5, atol=1e-5)


@given(
    n=st.integers(1, 200),
    chunk=st.integers(1, 64),
    senders=st.integers(2, 5),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=40, deadline=None)
def test_reducer_centered_clip_chunk_by_chunk_in_any_arrival_order(n, chunk, senders, seed):
    """Each chunk is CenteredClip of its own rows, whatever order chunks arrive and finish in
    (chunks are reduced as soon as ready, so row buffers are reused while others are in flight),
    also after a sender broke off and the part restarted without it."""
    from swarm.averaging.butterfly.robust import centered_clip

    rng = random.Random(seed)
    codec = get_codec("none")
    values = [torch.randn(n, generator=torch.Generator().manual_seed(seed + i)) for i in range(6)]
    values[1] *= 50.0  # an outlier, so that clipping really happens
    acc = torch.empty(n)
    chunks = _chunks(n, chunk)
    expected = list(range(1, senders + 1))
    r = PartReducer(chunks, expected)
    r.begin(values[0], 1.0)
    quitter = expected[-1] if len(chunks) > 1 else None
    for attempt in range(2):
        for s in r.expected:
            r.accept(s, 1.0)
        progress = dict.fromkeys(r.expected, 0)
        finished = 0
        while not r.settled() or (finished < len(chunks) and not r.tainted):
            open_ = [
                s for s in r.expected if r.state(s) in (SenderState.PENDING, SenderState.STREAMING)
            ]
            if open_:
                s = rng.choice(open_)
                i = r.next_index(s)
                a, b = chunks[i]
                r.add_chunk(s, i, codec.encode(values[s][a:b]))
                r.chunk_added(s)
                progress[s] += 1
                if attempt == 0 and s == quitter and progress[s] == 1:
                    r.fail(s)  # breaks off after one chunk: taints the part
                elif progress[s] == len(chunks):
                    r.complete(s)
            if not r.tainted and finished < len(chunks) and r.chunk_ready(finished):
                a, b = chunks[finished]  # as the owner: at once
                acc[a:b] = r.finish_chunk(finished, r.chunk_total(finished))
                r.release(finished)
                finished += 1
        if not r.tainted:
            break
        assert r.restart() == tuple(e for e in expected if e != quitter)
    live = [0, *r.contributors()]
    for a, b in chunks:
        rows = torch.stack([values[m][a:b] for m in live])
        want = centered_clip(rows, [1.0] * len(live)).center
        torch.testing.assert_close(acc[a:b], want.float(), rtol=1e-5, atol=1e-5)


def finish(r: PartReducer, acc: torch.Tensor) -> tuple[int, ...]:
    """Average every chunk into ``acc``, as the owner does once each is ready; returns the
    contributors."""
    for index in range(len(r.chunks)):
        assert r.chunk_ready(index)
        start, end = r.chunks[index]
        acc[start:end] = r.finish_chunk(index, r.chunk_total(index))
        r.release(index)
    return r.contributors()


def test_reducer_chunks_are_ready_in_order_as_every_sender_delivers_them():
    codec = get_codec("none")
    n, chunks = 90, _chunks(90, 30)
    own, a, b = torch.full((n,), 1.0), torch.full((n,), 4.0), torch.full((n,), 10.0)
    r = PartReducer(chunks, [1, 2, 3], "mean")
    r.begin(own, 1.0)
    r.accept(1, 1.0)
    r.accept(2, 2.0)
    assert not r.chunk_ready(0)  # sender 3 has not even started
    r.fail(3)  # never started: does not taint
    for i, (s, e) in enumerate(chunks[:2]):
        r.add_chunk(1, i, codec.encode(a[s:e]))
        r.chunk_added(1)
    r.add_chunk(2, 0, codec.encode(b[0:30]))
    r.chunk_added(2)
    assert r.chunk_ready(0) and not r.chunk_ready(1) and not r.chunk_ready(2)
    assert r.chunk_total(0) == 4.0
    torch.testing.assert_close(r.finish_chunk(0, r.chunk_total(0)), torch.full((30,), 6.25))
    assert not r.tainted and not r.settled()


def test_reducer_taint_and_restart_excludes_partial_sender():
    codec = get_codec("none")
    n, chunks = 100, _chunks(100, 30)
    own, a, b = torch.full((n,), 1.0), torch.full((n,), 3.0), torch.full((n,), 100.0)
    acc = torch.empty(n)
    r = PartReducer(chunks, [1, 2], "mean")
    r.begin(own, 1.0)
    r.accept(1, 1.0)
    r.accept(2, 1.0)
    for i, (s, e) in enumerate(chunks):
        r.add_chunk(1, i, codec.encode(a[s:e]))
        r.chunk_added(1)
    r.complete(1)
    r.add_chunk(2, 0, codec.encode(b[0:30]))  # sender 2 dies after one chunk
    r.chunk_added(2)
    r.fail(2)
    assert r.settled() and r.tainted
    assert r.restart() == (1,)
    assert r.attempt == 1 and not r.settled()
    r.accept(1, 1.0)
    for i, (s, e) in enumerate(chunks):
        r.add_chunk(1, i, codec.encode(a[s:e]))
        r.chunk_added(1)
    r.complete(1)
    assert finish(r, acc) == (1,)
    torch.testing.assert_close(acc, torch.full((n,), 2.0))


def test_reducer_refuses_protocol_violations():
    codec = get_codec("none")
    r = PartReducer(_chunks(10, 5), [1, 2])
    r.begin(torch.zeros(10), 1.0)
    with pytest.raises(AveragingError):
        r.accept(3, 1.0)  # not expected
    r.accept(1, 1.0)
    with pytest.raises(AveragingError):
        r.accept(1, 1.0)  # second stream
    with pytest.raises(CompressionError):
        r.add_chunk(1, 0, codec.encode(torch.zeros(4)))  # wrong size
    with pytest.raises(CompressionError):
        r.add_chunk(1, 0, b"\x00junk")
    r.add_chunk(1, 0, codec.encode(torch.zeros(5)))
    r.chunk_added(1)
    with pytest.raises(AveragingError):
        r.complete(1)  # ended early
    r.fail(1)
    assert r.state(1) is SenderState.FAILED and r.tainted
    with pytest.raises(AveragingError):
        r.next_index(1)
    r.fail(2)  # never started: does not taint more
    assert r.settled() and r.contributors() == ()


def _reduce_pair(
    r: PartReducer, own: torch.Tensor, own_weight: float, theirs: torch.Tensor, weight: float
) -> torch.Tensor:
    """``r``'s average of the owner's ``own`` and sender 1's ``theirs``, in one chunk."""
    acc = torch.empty_like(own)
    r.begin(own, own_weight)
    r.accept(1, weight)
    r.add_chunk(1, 0, get_codec("none").encode(theirs))
    r.chunk_added(1)
    r.complete(1)
    finish(r, acc)
    return acc


def test_reducer_zero_total_weight_keeps_own_values():
    own = torch.arange(4.0)
    r = PartReducer(_chunks(4, 4), [1])
    torch.testing.assert_close(_reduce_pair(r, own, 0.0, torch.ones(4), 0.0), own)


@pytest.mark.parametrize(("cap", "expected"), [(2.0, 0.6 / 3), (4.0, 0.9 / 4)])
def test_reducer_caps_weights_at_the_configured_multiple_of_the_median(cap, expected):
    # the sender claims 3 times the owner's weight: the configured cap (2 by default) decides
    # how much counts (two rows: their capped weighted mean, no clip)
    r = PartReducer(_chunks(4, 4), [1], weight_cap=cap)
    got = _reduce_pair(r, torch.zeros(4), 1.0, torch.full((4,), 0.3), 3.0)
    torch.testing.assert_close(got, torch.full((4,), expected))
    assert (1 in r.capped) == (cap < 3)


@pytest.mark.parametrize("spec", ["int8", "topk:0.1", "1bit", "fp16"])
def test_flat_feedback_conserves_mass(spec):
    # sum of what was sent == sum of inputs - final residual, chunk by chunk, up to the
    # rounding of the residual to bfloat16 once per round (at most 2^-8 of its size)
    codec = get_codec(spec)
    fb = FlatFeedback(codec, 8192)
    gen = torch.Generator().manual_seed(0)
    sent, total = torch.zeros(4096), torch.zeros(4096)
    rounding = torch.zeros(4096)
    for _ in range(5):
        x = torch.randn(4096, generator=gen)
        total += x
        payload = fb.encode(x, 4096)
        sent += decode(payload)
        rounding += fb.state_dict()["sender"][4096:].float().abs() * 2**-8
    residual = fb.state_dict()["sender"][4096:]
    assert residual.dtype == RESIDUAL_DTYPE
    assert ((sent + residual - total).abs() <= rounding + 1e-5).all()
    assert fb.state_dict()["sender"][:4096].abs().max() == 0  # other slices untouched


def test_first_chunks_encoded_at_once_share_one_sender_residual():
    """The first chunks of several parts encode in worker threads at the same moment: every
    one's error lands in the one residual (each thread made its own before, the losers' lost)."""
    import concurrent.futures
    import threading

    codec, half = get_codec("int8"), 1 << 21
    x = torch.randn(2 * half, generator=torch.Generator().manual_seed(5))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for _ in range(8):
            fb, start = FlatFeedback(codec, 2 * half), threading.Barrier(2)

            def first_chunk(at: int, fb: FlatFeedback = fb, start=start) -> bytes:
                start.wait()
                return fb.encode(x[at : at + half], at)

            payloads = list(pool.map(first_chunk, (0, half)))
            residual = fb.state_dict()["sender"]
            for at, payload in zip((0, half), payloads, strict=True):
                torch.testing.assert_close(
                    residual[at : at + half].float(),
                    x[at : at + half] - decode(payload),
                    rtol=2**-8,
                    atol=1e-6,
                )


@pytest.mark.parametrize("spec", ["none", "int8", "topk:0.1"])
def test_flat_feedback_owner_applies_what_it_sends(spec):
    fb = FlatFeedback(get_codec(spec), 1000)
    fb.prepare_owner(100, 600)
    avg = torch.randn(500)
    values = avg[200:400].clone()
    payload = fb.encode_owned(values, 200)
    torch.testing.assert_close(values, decode(payload))


def test_an_owner_residual_keeps_its_overlap_when_the_owned_range_moves() -> None:
    """Part sizes follow measured bandwidth, so an owner's range moves a little from round to
    round: what it left out where the old and new ranges overlap is sent the next time (it was
    all dropped before), and nothing comes from the range it did not own."""
    codec, x = get_codec("int8"), torch.randn(1000, generator=torch.Generator().manual_seed(4))
    fb = FlatFeedback(codec, 1000)
    fb.prepare_owner(0, 500)
    first = x[:500].clone()
    fb.encode_owned(first, 0)
    fb.prepare_owner(100, 600)
    second = torch.zeros(500)
    fb.encode_owned(second, 0)
    error_before = (first[100:] - x[100:500]).abs().max()
    assert (first[100:] + second[:400] - x[100:500]).abs().max() < error_before / 10
    assert second[400:].abs().max() == 0
    fb.forget_owned(0, 500)  # the part was retried: its receivers discarded it
    third = torch.zeros(500)
    fb.encode_owned(third, 0)
    assert third.abs().max() == 0


def test_rounds_of_values_keep_no_residual() -> None:
    """Rounds of values replace the values: 3 members that averaged once hold the same values,
    and every later round gives them back unchanged. With residuals a part moved again by a
    rounding's size (0.26% of its norm here; in other data every round) while the others
    stayed, which the owner check reads as a lie."""
    codec, k, n = get_codec("int8"), 3, 2762
    cuts = [0, 921, 1842, n]
    g = torch.Generator().manual_seed(0)
    start = torch.randn(n, generator=g) * 0.1
    for keep in (False, True):
        values = [start + 0.005 * torch.randn(n, generator=g) for _ in range(k)]
        fbs = [FlatFeedback(codec, n, keep=keep) for _ in range(k)]
        moved = []
        for _ in range(5):
            parts = []
            for j, (a, b) in enumerate(itertools.pairwise(cuts)):
                got = [
                    v[a:b] if i == j else decode(fbs[i].encode(v[a:b], a))
                    for i, v in enumerate(values)
                ]
                average = sum(got) / k
                fbs[j].prepare_owner(a, b)
                fbs[j].encode_owned(average, 0)  # average <- what every member applies
                parts.append(average)
            new = torch.cat(parts)
            moved.append(
                max(
                    float((new[a:b] - values[0][a:b]).norm() / new[a:b].norm())
                    for a, b in itertools.pairwise(cuts)
                )
            )
            values = [new.clone() for _ in range(k)]
        if keep:
            assert max(moved[1:]) > 1e-3, moved
        else:
            assert max(moved[1:]) == 0.0, moved


def test_a_turning_layouts_owner_residual_waits_for_its_range() -> None:
    """Owning [0, 500) then [500, 1000) then [0, 500) again: with ``turning`` what the first
    round left out of [0, 500) is sent the third time; without, it is lost on the move."""
    codec, x = get_codec("int8"), torch.randn(1000, generator=torch.Generator().manual_seed(3))
    for turning in (True, False):
        fb, sent = FlatFeedback(codec, 1000, turning=turning), torch.zeros(500)
        for start in (0, 500, 0):
            fb.prepare_owner(start, start + 500)
            values = x[start : start + 500].clone()
            fb.encode_owned(values, 0)
            if start == 0:
                sent += values
        left = (2 * x[:500] - sent).abs().max()
        assert (left < 0.02) if turning else (left > 0.02), (turning, left)


def test_round_result_text():
    r = RoundResult(False, "alone", matchmaking_s=1.0)
    assert "alone" in str(r) and r.group_size == 0
    ok = RoundResult(True, members=(_pid(1), _pid(2)), parts={0: (_pid(1), _pid(2))})
    assert "group of 2" in str(ok)


# ---- stall policy and averaging config


def test_stall_policy_limits_follow_the_measured_rate():
    from swarm.averaging.butterfly.stall import PartTiming, StallPolicy

    policy = StallPolicy(floor_s=1.0, factor=8.0)
    timing = PartTiming(start=0.0)
    # nothing received: only the deadline applies to senders that never started
    assert policy.stalled(100.0, timing, {}, [1, 2]) == []
    for t in range(1, 11):  # 10 chunks of 1 MB at 1 MB/s in total over two senders
        timing.received(float(t), 1 << 20)
    limit = policy.silence_limit(timing, active=2)
    assert limit == pytest.approx(8.0 * (1 << 20) / ((10 << 20) / 9.0 / 2))
    limit = policy.silence_limit(timing, active=1)  # alone on the link: half the limit
    assert policy.stalled(10.0 + limit - 0.1, timing, {1: 10.0}, []) == []
    dropped = policy.stalled(10.0 + limit + 0.1, timing, {1: 10.0}, [])
    assert [s for s, _ in dropped] == [1] and "silent" in dropped[0][1]
    # a slow-but-steady link gets a longer limit, never shorter than the floor
    slow = PartTiming(start=0.0)
    slow.received(0.0, 1000)
    slow.received(100.0, 1000)
    assert policy.silence_limit(slow, 1) > 100.0
    fast = PartTiming(start=0.0)
    fast.received(0.0, 1 << 20)
    fast.received(0.001, 1 << 20)
    assert policy.silence_limit(fast, 1) == 1.0
    # one sender completed after 2 s: a sender that never started is dropped after 16 s
    timing.completed(2.0)
    assert policy.start_limit(timing) == 16.0
    assert [s for s, _ in policy.stalled(16.5, timing, {}, [3])] == [3]
    assert policy.stalled(15.5, timing, {}, [3]) == []
    assert policy.reply_limit(0.5) == 8.0 and policy.reply_limit(0.01) == 4.0
    assert policy.reply_limit(None) == 4.0


def test_stall_policy_drops_in_order_deadline_gone_stalled_then_start_by():
    from swarm.averaging.butterfly.stall import PartTiming, StallPolicy

    policy = StallPolicy(floor_s=1.0, factor=8.0)
    timing = PartTiming(start=0.0)
    # nothing measured, nobody gone, no start_by: nobody is dropped before the deadline
    assert policy.drops(5.0, timing, {1: 4.0}, [2, 3], deadline=10.0) == []
    at_deadline = policy.drops(10.0, timing, {1: 4.0}, [2], deadline=10.0, gone={2})
    assert at_deadline == [(1, "all-reduce deadline"), (2, "all-reduce deadline")]
    # a pending sender whose address refuses connections goes first, alone
    gone = policy.drops(5.0, timing, {}, [2, 3], deadline=10.0, gone={3}, start_by=1.0)
    assert gone == [(3, "its address refused us, or the group is over there")]
    # from start_by on, every pending sender goes when nothing else was found
    late = policy.drops(5.0, timing, {1: 4.9}, [2, 3], deadline=10.0, start_by=5.0)
    assert [s for s, _ in late] == [2, 3] and "never started" in late[0][1]
    assert policy.drops(4.9, timing, {}, [2], deadline=10.0, start_by=5.0) == []
    # once the stall policy finds someone, start_by adds nothing: its verdicts stand
    for t in range(1, 11):
        timing.received(float(t), 1 << 20)
    stalled = policy.drops(60.0, timing, {1: 10.0}, [2], deadline=99.0, start_by=0.0)
    assert [s for s, _ in stalled] == [1, 2]
    assert "silent" in stalled[0][1] and "limit" in stalled[1][1]


def test_averaging_config_validates_and_derives_one_timeout():
    from swarm.config import AveragingConfig, SwarmConfig
    from swarm.errors import ConfigError

    config = AveragingConfig(matchmaking_timeout_s=10.0, round_timeout_s=40.0)
    assert config.allreduce_timeout_s == pytest.approx(29.0)
    assert config.gather_window == 0.5
    assert AveragingConfig(matchmaking_timeout_s=1.0, round_timeout_s=5.0).gather_window == 0.25
    for bad in (
        dict(min_group_size=1),
        dict(min_group_size=5, target_group_size=4),
        dict(matchmaking_timeout_s=0),
        dict(matchmaking_timeout_s=10.0, round_timeout_s=10.5),
        dict(gather_window_s=20.0),
        dict(stall_factor=0.5),
        dict(group_key="a/b"),
        dict(grouping="nearest"),
        dict(cross_every=0),
        dict(threads=0),
        dict(codec=""),
    ):
        with pytest.raises(ConfigError):
            AveragingConfig(**bad)
    swarm = SwarmConfig.build(codec="fp16", matchmaking_timeout_s=5.0, round_timeout_s=30.0)
    derived = swarm.averaging
    assert (derived.codec, derived.round_timeout_s, derived.matchmaking_timeout_s) == (
        "fp16",
        30.0,
        5.0,
    )
    assert SwarmConfig.build(mode="gradients").averaging.gather_window_s == 0.05


# ---- robust aggregation, bounded shares, owner checks (sans-I/O)


def test_cap_weights_at_twice_the_median():
    from swarm.averaging.butterfly.robust import cap_weights

    assert cap_weights([1.0, 1.0, 1.0, 1e30]) == [1.0, 1.0, 1.0, 2.0]
    assert cap_weights([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert cap_weights([0.0, 0.0, 5.0]) == [0.0, 0.0, 0.0]
    assert cap_weights([]) == []
    # of two senders (or an even split) the lower median: a claim alone cannot outweigh the other
    assert cap_weights([1.0, 1e30]) == [1.0, 2.0]
    assert cap_weights([1.0, 1.0, 1e30, 1e30]) == [1.0, 1.0, 2.0, 2.0]


@pytest.mark.parametrize("odd", [0, 1, 3])
@pytest.mark.parametrize("overwrite", [False, True])
def test_centered_clip_tells_apart_values_that_barely_differ(odd, overwrite):
    """Parameters, not their changes: three rows equal to 1e-7, one 1e-4 off. float32 norms of
    the raw rows cannot see such differences; the clip still leaves the odd row out."""
    from swarm.averaging.butterfly.robust import centered_clip

    g = torch.Generator().manual_seed(odd)
    base = torch.randn(20_000, generator=g)
    rows = torch.stack([base + 1e-7 * torch.randn(20_000, generator=g) for _ in range(4)])
    rows[odd] += 1e-4 * torch.randn(20_000, generator=g)
    cluster = torch.cat([rows[:odd], rows[odd + 1 :]]).mean(0)
    clip = centered_clip(rows.clone(), [1.0] * 4, overwrite=overwrite)
    assert float((clip.center - cluster).norm() / cluster.norm()) <= 1e-6
    assert clip.scales[odd] < 0.1 and min(clip.scales[:odd] + clip.scales[odd + 1 :]) > 0.5


@given(
    k=st.integers(3, 8),
    n=st.integers(1, 300),
    scale=st.sampled_from([1e3, 1e30, 3e38, -1e4]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=40, deadline=None)
def test_centered_clip_bounds_one_outlier(k, n, scale, seed):
    from swarm.averaging.butterfly.robust import centered_clip

    g = torch.Generator().manual_seed(seed)
    honest = torch.randn(k, n, generator=g) * 0.1 + 1.0
    mean = honest.double().mean(0)
    spread = float((honest.double() - mean).norm(dim=1).pow(2).mean().sqrt())
    rows = torch.cat((honest, torch.full((1, n), scale) if abs(scale) > 1e4 else -honest[:1] * 1e4))
    clip = centered_clip(rows, [1.0] * (k + 1))
    assert torch.isfinite(clip.center).all()
    assert float((clip.center - mean).norm()) <= 2.0 * spread + 1e-9
    assert clip.scales[-1] < 0.1  # the outlier was clipped (and will be reported)


@given(k=st.integers(3, 7), n=st.integers(1, 200), seed=st.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
def test_centered_clip_does_not_depend_on_the_rows_order(k, n, seed):
    """Groups of the same contributions in another order (a grid's columns of values rounds)
    get one result: a medoid picked by how the matmul rounded two mutual nearest rows moved it
    by 0.4% before."""
    from swarm.averaging.butterfly.robust import centered_clip

    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(k, n, generator=g)
    order = torch.randperm(k, generator=g)
    first = centered_clip(rows.clone(), [1.0] * k).center
    again = centered_clip(rows[order].clone(), [1.0] * k).center
    torch.testing.assert_close(again, first, rtol=0, atol=1e-5)


def test_centered_clip_leaves_blatant_outliers_out():
    """Far beyond ten radii a contribution pulls nothing, whatever its size or claimed weight."""
    from swarm.averaging.butterfly.robust import centered_clip

    honest = torch.randn(5, 500, generator=torch.Generator().manual_seed(3)) * 0.1 + 1.0
    mean = honest.double().mean(0)
    spread = float((honest.double() - mean).norm(dim=1).mean())
    centers = []
    for flip, huge, weight in ((-1e4, 1e30, 1.0), (-1e6, 1e20, 2.0)):
        rows = torch.cat((honest, flip * honest[:1], torch.full((1, 500), huge)))
        clip = centered_clip(rows, [1.0] * 5 + [weight, weight])
        assert max(clip.scales[-2:]) < 0.1  # both reported as clipped
        centers.append(clip.center.double())
    torch.testing.assert_close(centers[0], centers[1])
    assert float((centers[0] - mean).norm()) < 0.2 * spread


@pytest.mark.parametrize(("big", "far"), [(1e35, 1e20), (1e20, 1e5), (1e30, 1e10)])
def test_two_outliers_in_one_direction_cannot_become_the_medoid(big, far):
    """Two colluders send the same direction at very different sizes. The smaller lies closer
    to the larger than any honest row does, so on mean distance it wins; the median must
    decide. Before, a tie-break added to the median swamped it (the larger's distance sets
    the scale), the smaller became the medoid, and the result lay 4e4 to 4e19 honest spreads
    off."""
    from swarm.averaging.butterfly.robust import centered_clip

    g = torch.Generator().manual_seed(0)
    honest = 1.0 + 0.1 * torch.randn(6, 100, generator=g)
    direction = torch.randn(1, 100, generator=g)
    rows = torch.cat([honest, far * direction, big * direction])
    mean = honest.double().mean(0)
    spread = float((honest.double() - mean).norm(dim=1).max())
    clip = centered_clip(rows, [1.0] * 8)
    assert float((clip.center.double() - mean).norm()) < 0.1 * spread
    assert max(clip.scales[-2:]) < 0.1


def test_centered_clip_where_only_outliers_claim_a_weight_stays_finite():
    from swarm.averaging.butterfly.robust import centered_clip

    rows = torch.cat((torch.zeros(3, 50), torch.full((2, 50), 1e6)))
    clip = centered_clip(rows, [0.0, 0.0, 0.0, 1.0, 1.0])
    assert torch.isfinite(clip.center).all() and float(clip.center.abs().max()) == 0.0


def test_centered_clip_is_exact_when_nobody_is_clipped():
    from swarm.averaging.butterfly.robust import centered_clip

    rows = torch.tensor([[1.0, 2.0], [1.5, 2.5], [2.0, 3.0]])
    out = centered_clip(rows, [1.0, 2.0, 1.0], iterations=5)
    assert out.scales == pytest.approx((1.0, 1.0, 1.0))
    weights = torch.tensor([[1.0], [2.0], [1.0]], dtype=torch.float64)
    torch.testing.assert_close(out.center.double(), (rows.double() * weights).sum(0) / 4)


def test_centered_clip_averages_two_contributions():
    """Two rows: no majority, both count, weighted (the owner's own row used to win)."""
    from swarm.averaging.butterfly.robust import centered_clip

    rows = torch.tensor([[0.0, 0.0, 0.0], [1.0, 2.0, 3.0]])
    out = centered_clip(rows, [1.0, 3.0])
    assert out.scales == (1.0, 1.0)
    torch.testing.assert_close(out.center, torch.tensor([0.75, 1.5, 2.25]))


def _clip_in_row_space(rows: torch.Tensor, weights: list[float], iterations: int) -> torch.Tensor:
    """CenteredClip as written in the papers, on the rows themselves, in float64."""
    x = rows.double()
    w = torch.tensor(weights, dtype=torch.float64)
    dist2 = torch.cdist(x, x).square()  # ties on the median go to the smallest mean square
    start = int((dist2.median(dim=1).values + 1e-6 * dist2.mean(dim=1)).argmin())
    v = x[start].clone()
    for step in range(iterations):
        d = (x - v).norm(dim=1)
        others = torch.cat([d[:start], d[start + 1 :]]) if step == 0 else d
        tau = float(others.median())
        scale = torch.where(d > tau, tau / d.clamp(min=1e-300), 1.0)
        wk = torch.where(scale < 0.1, 0.0, w)
        if not float(wk.sum()) > 0:
            break
        v = v + ((wk * scale / wk.sum())[:, None] * (x - v)).sum(0)
    return v


@settings(max_examples=40, deadline=None)
@given(st.integers(3, 8), st.integers(0, 2), st.integers(1, 4), st.integers(0, 2**16))
def test_centered_clip_from_the_gram_matrix_matches_the_row_space_algorithm(
    k, outliers, iterations, seed
):
    """The clip keeps its centre as a combination of the rows and measures every distance
    through their Gram matrix; it lands where the row-space iteration does."""
    from swarm.averaging.butterfly.robust import centered_clip

    g = torch.Generator().manual_seed(seed)
    rows = 5.0 + torch.randn(k, 3000, generator=g)
    rows[:outliers] *= 1 + 20 * torch.rand(outliers, 1, generator=g)
    weights = (0.5 + torch.rand(k, generator=g)).tolist()
    want = _clip_in_row_space(rows, weights, iterations)
    # in float64: in float32 both clips land up to 8e-3 of the spread from the float64
    # iteration where distances nearly tie (the median picks another row), as large as a slip
    got = centered_clip(rows.double(), weights, iterations=iterations)
    spread = float((rows.double() - want).norm(dim=1).median())
    assert float((got.center.double() - want).norm()) <= 1e-9 * spread


@given(k=st.integers(3, 8), seed=st.integers(0, 2**16))
@settings(max_examples=30, deadline=None)
def test_centered_clip_stays_near_the_mean_of_honest_noise(k, seed):
    """Honest rows are clipped at most mildly: the medoid's own zero distance is not a radius."""
    from swarm.averaging.butterfly.robust import centered_clip

    rows = torch.randn(k, 2000, generator=torch.Generator().manual_seed(seed))
    out = centered_clip(rows, [1.0] * k)
    mean = rows.mean(0)
    assert min(out.scales) > 0.5
    assert float((out.center - mean).norm()) < 0.2 * float(rows.norm(dim=1).mean()) / k**0.5


@pytest.mark.parametrize("far", [1.8, 2.5])
def test_a_scoring_owner_keeps_the_odd_one_of_three_honest_rows(far):
    """Of three rows, two close ones shrink the radius (the middle of three distances): a third
    row at a few times their distance, honest noise, is scaled below half by the plain radius
    (0.45 and 0.32), not by a scoring owner's wider one, while a row at twenty times is still
    left out by both."""
    from swarm.averaging.butterfly.robust import OUTLIER_SCALE, centered_clip

    g = torch.Generator().manual_seed(0)
    base = torch.randn(1000, generator=g)
    step = torch.randn(1000, generator=g)
    step /= step.norm()
    side = torch.randn(1000, generator=g)
    side = side - (side @ step) * step
    side /= side.norm()
    close = [base, base + step]  # one apart
    honest = torch.stack([*close, base + 0.5 * step + far * side])
    assert min(centered_clip(honest.clone(), [1.0] * 3).scales) < 0.5
    wide = centered_clip(honest.clone(), [1.0] * 3, trio_radius=TRIO_RADIUS)
    assert min(wide.scales) >= 0.5
    attacker = torch.stack([*close, base + 0.5 * step + 20 * side])
    for trio in (1.0, TRIO_RADIUS):
        assert (
            centered_clip(attacker.clone(), [1.0] * 3, trio_radius=trio).scales[2] < OUTLIER_SCALE
        )
    # only three rows: four keep the plain radius
    four = torch.stack([*close, base + 0.5 * step + far * side, base + 0.5 * step - side])
    assert centered_clip(four.clone(), [1.0] * 4, trio_radius=TRIO_RADIUS).radius == (
        centered_clip(four.clone(), [1.0] * 4).radius
    )


@pytest.mark.parametrize("score", [False, True])
def test_only_a_scoring_owner_widens_the_radius_of_three(score):
    """The owner of a group of 3 that scores its senders keeps an honest odd row unclipped;
    CenteredClip alone, whose radius is its only bound on slow poison, clips it."""
    codec = get_codec("none")
    g = torch.Generator().manual_seed(1)
    base = torch.randn(64, generator=g)
    step, side = torch.zeros(64), torch.zeros(64)
    step[0], side[1] = 1.0, 2.0  # the odd row 2 from the middle of a pair 1 apart
    chunks = _chunks(64, 64)
    r = PartReducer(chunks, [1, 2], score=score)
    r.begin(base, 1.0)
    for sender, values in ((1, base + step), (2, base + 0.5 * step + side)):
        r.accept(sender, 1.0)
        r.add_chunk(sender, 0, codec.encode(values))
        r.chunk_added(sender)
        r.complete(sender)
    assert finish(r, torch.empty(64)) == (1, 2)
    scaled = r.clipped.get(2, 1.0)
    assert (scaled >= 0.5) if score else (scaled < 0.5), r.clipped


def test_reducer_centered_clip_refuses_to_be_dragged():
    codec = get_codec("none")
    n, chunks = 64, _chunks(64, 32)
    honest = [torch.full((n,), v) + 0.01 * torch.randn(n) for v in (1.0, 1.1, 0.9)]
    attacker = torch.full((n,), 1e30)
    acc = torch.empty(n)
    r = PartReducer(chunks, [1, 2, 3])
    r.begin(honest[0], 1.0)
    r.accept(3, 1e30)  # a huge weight, capped at twice the median; streams start in any order
    r.accept(1, 1.0)
    r.accept(2, 1.0)
    for i, (s, e) in enumerate(chunks):
        for sender, values in ((1, honest[1]), (2, honest[2]), (3, attacker)):
            r.add_chunk(sender, i, codec.encode(values[s:e]))
            r.chunk_added(sender)
    for sender in (1, 2, 3):
        r.complete(sender)
    assert finish(r, acc) == (1, 2, 3)
    assert torch.isfinite(acc).all() and (acc - 1.0).abs().max() < 0.5
    assert set(r.clipped) == {3} and r.capped == {3: 1e30}


def test_cap_shares_bounds_every_owner():
    from swarm.averaging.butterfly.parts import cap_shares

    shares = cap_shares([1e300, 1.0, 1.0, 1.0], 2.0)
    assert shares[0] == pytest.approx(0.5) and shares[1:] == pytest.approx([1 / 6] * 3)
    assert cap_shares([1.0, 1.0], 2.0) == pytest.approx([0.5, 0.5])
    assert cap_shares([0.0, 5.0, 0.0, 0.0], 2.0) == pytest.approx([0.0, 1.0, 0.0, 0.0])
    assert cap_shares([0.0, 0.0], 2.0) == [0.0, 0.0]
    plan = PartPlan.create(1000, [1e300, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], 10, 2.0)
    assert max(plan.size(i) for i in range(8)) <= 2 * 1000 / 8 + 1
    with pytest.raises(AveragingError):
        cap_shares([float("inf"), 1.0], 2.0)


@given(
    bws=st.lists(st.floats(0, 1e300), min_size=1, max_size=10),
    share=st.floats(1.0, 4.0),
)
def test_cap_shares_property(bws, share):
    from swarm.averaging.butterfly.parts import cap_shares

    shares = cap_shares(bws, share)
    owners = [b for b in bws if b > 0]
    if owners:
        assert sum(shares) == pytest.approx(1.0)
        assert max(shares) <= share / len(owners) + 1e-9


def test_implausible_parts_names_the_outlier_only():
    from swarm.averaging.butterfly.checks import implausible_parts

    assert set(implausible_parts({0: 0.5, 1: 0.6, 2: 0.55, 3: 1e29})) == {3}
    assert set(implausible_parts({0: 0.5, 1: 0.6, 2: 0.55, 3: float("inf")})) == {3}
    assert implausible_parts({0: 0.5, 1: 0.6, 2: 0.55, 3: 1.5}) == {}
    assert implausible_parts({0: 0.5, 1: 1e9}) == {}  # too few parts to judge
    assert implausible_parts({0: float("inf"), 1: float("inf"), 2: 1.0}) == {}  # own values 0
    assert implausible_parts({0: 0.0, 1: 0.0, 2: 0.0}) == {}
    # members in agreement up to rounding: part-to-part ratios are noise under the floor
    assert implausible_parts({0: 1.03e-5, 1: 1.1e-5, 2: 0.95e-5, 3: 8.02e-5}) == {}
    assert set(implausible_parts({0: 1.03e-5, 1: 1.1e-5, 2: 0.95e-5, 3: 2e-3})) == {3}
    # most parts came back as own values (median 0): an averaged part is not a lie for that,
    # flipped, huge or unrelated values still are
    assert implausible_parts({0: 0.0, 1: 0.0, 2: 0.128, 3: 0.0}) == {}
    assert "too few comparable parts" in implausible_parts({0: 0.0, 1: 0.0, 2: 2.0, 3: 0.0})[2]
    assert set(implausible_parts({0: 0.0, 1: 0.0, 2: 1e29, 3: 0.0})) == {2}
    # the median is the parts averaged with others': parts that came back as own values (int8
    # rounding away from them) do not make an honest average look 23x too far
    stream_lost = {0: 0.0062, 1: 0.145, 2: 0.0063, 3: 0.0061}
    assert set(implausible_parts(stream_lost)) == {1}  # what the median of all parts said
    assert implausible_parts(stream_lost, mixed={1}) == {}
    assert implausible_parts(stream_lost, mixed={1, 2}) == {}
    assert "too few comparable parts" in implausible_parts({**stream_lost, 1: 2.0}, mixed={1})[1]
    # a liar among parts averaged with others is still refused, whatever it claims averaged
    assert set(implausible_parts({0: 0.14, 1: 0.15, 2: 0.13, 3: 5.0}, mixed={0, 1, 2, 3})) == {3}
    assert set(implausible_parts({0: 0.14, 1: 0.15, 2: 0.13, 3: 5.0}, mixed={0, 1, 2})) == {3}
    # a part judged against the parts its contributors all went into: member 0 (far, after
    # missed rounds) was refused by the owners of parts 1 and 2 (they excluded it), so only
    # parts 0 and 3 hold its values; member 3's check of owner 0 is not a false accusation
    asymmetric = {0: 0.0364, 1: 0.0021, 2: 0.0023, 3: 0.0095}
    sets = {0: (0, 3), 1: (1, 2, 3), 2: (1, 2, 3), 3: (0, 1, 2, 3)}
    assert set(implausible_parts(asymmetric)) == {0}  # what the median of all parts said
    assert implausible_parts(asymmetric, contributors=sets) == {}
    assert "too few comparable" in implausible_parts({**asymmetric, 0: 2.0}, contributors=sets)[0]
    # updates barely align: an honest average lies about as far as the own update's size (a
    # late member's values in part 0 only, measured at 10 Mbit/s); with too few comparable
    # parts the rule over all of them applies when it is looser than r > 1
    late = {0: (0, 1, 2, 3), 1: (0, 1, 2), 2: (0, 1, 2), 3: (0, 1, 2)}
    updates = {0: 1.01, 1: 0.85, 2: 0.82, 3: 0.9}
    assert set(implausible_parts(updates, contributors={**late, 0: (0, 1, 2)})) == set()
    assert implausible_parts(updates, contributors=late) == {}
    assert "few comparable" in implausible_parts({**updates, 0: 1e29}, contributors=late)[0]
    # every part with every member: an owner's claim of fewer contributors changes nothing
    full = {p: (0, 1, 2, 3) for p in range(4)}
    liar = {0: 0.14, 1: 0.15, 2: 0.13, 3: 5.0}
    assert set(implausible_parts(liar, contributors=full)) == {3}
    assert set(implausible_parts(liar, contributors={**full, 3: (3,)})) == {3}
    assert set(implausible_parts(liar, contributors={**full, 3: (0, 3)})) == {3}
    # NaN stands for an average holding NaN or inf: refused whatever the other parts say
    assert set(implausible_parts({0: 0.5, 1: float("nan"), 2: 0.55, 3: 0.6})) == {1}
    assert set(implausible_parts({0: 0.5, 1: float("nan")})) == {1}


def test_kept_ranges_are_merged_split_and_forgotten_after_their_rounds():
    from swarm.averaging.butterfly.kept import KeptRanges, merge, split

    assert merge([(5, 9), (0, 2), (2, 3), (7, 12), (4, 4)]) == ((0, 3), (5, 12))
    assert split(0, 10, ((2, 4), (6, 8))) == ([(0, 2), (4, 6), (8, 10)], [(2, 4), (6, 8)])
    assert split(3, 7, ((0, 4), (6, 20))) == ([(4, 6)], [(3, 4), (6, 7)])
    assert split(3, 7, ((0, 2), (8, 9))) == ([(3, 7)], [])
    assert split(3, 7, ((0, 10),)) == ([], [(3, 7)])
    kept = KeptRanges(rounds=3)
    layout, other = ("", 100), ("f1", 100)
    kept.record(layout, [(10, 20)], averaged=True)
    kept.record(layout, [(0, 100)], averaged=False)  # nothing averaged: moved alike everywhere
    assert kept.recent(layout) == ((10, 20),) and kept.recent(other) == ()
    kept.record(other, [(0, 5)], averaged=True)  # another layout has its own rounds
    kept.record(layout, [(15, 30)], averaged=True)
    assert kept.recent(layout) == ((10, 30),)
    kept.record(layout, [], averaged=True)  # the first range's third round after: forgotten
    assert kept.recent(layout) == ((15, 30),) and kept.recent(other) == ((0, 5),)
    for _ in range(2):
        kept.record(layout, [], averaged=True)
    assert kept.recent(layout) == ()


def test_ranges_kept_lately_are_held_to_the_blatant_bound_only():
    """Measured at 10 Mbit/s: after a round where a member kept its own values of one part,
    the next sync's honest average of that range lay 0.226 from them against a median of
    0.00487 elsewhere, and the member accused the owner."""
    from swarm.averaging.butterfly.checks import implausible_parts

    measured = {0: 0.0049, 1: 0.0051, 2: 0.0047, 3: 0.226}
    assert set(implausible_parts(measured)) == {3}
    # part 3 wholly kept: only the r > 1 bound; part 1 half kept, its rest by the usual rule
    rest = {0: 0.0049, 1: 0.0051, 2: 0.0047}
    assert implausible_parts(rest, lenient={3: 0.226, 1: 0.39}) == {}
    assert "kept them lately" in implausible_parts(rest, lenient={3: 2.0})[3]  # flipped
    assert set(implausible_parts(rest, lenient={3: 1e29})) == {3}
    assert set(implausible_parts({**rest, 1: 0.2}, lenient={1: 0.3})) == {1}  # a lie outside
    assert set(implausible_parts(rest, lenient={3: float("nan")})) == {3}
    assert implausible_parts({0: 0.0049}, lenient={1: 5.0}) == {}  # too few parts to judge
    # never stricter than the usual rule: in a round of updates honest parts read about 1.6
    # from a member's own update (8 peers, colluders refusing one member)
    updates = {0: 1.61, 1: 1.6, 2: 1.8}
    assert implausible_parts(updates, lenient={1: 2.42}) == {}
    assert "over 6.44" in implausible_parts(updates, lenient={1: 7.5})[1]


def test_a_round_order_far_ahead_is_not_followed():
    """A hostile member claiming a huge round order cannot drag the others to MAX_ORDER (where
    their joins would be refused as malformed); honest orders a few rounds apart are followed."""
    from swarm.averaging.groups.group import MAX_ORDER, ORDER_SLACK, next_order

    assert next_order(5, [3, 17]) == 17
    assert next_order(5, [5 + ORDER_SLACK]) == 5 + ORDER_SLACK
    assert next_order(5, [6 + ORDER_SLACK, MAX_ORDER - 1, 9]) == 9
    assert next_order(5, []) == 5


def test_a_group_goes_on_from_the_second_largest_order_its_members_claimed():
    """One member alone cannot move its group's order (a claim far ahead would drag the group
    away from the rest of the swarm's plans every round); a member that ran ahead comes back to
    its group, one behind catches up, and a pair follows the larger claim."""
    from swarm.averaging.groups.group import ORDER_SLACK
    from swarm.averaging.groups.planner import GroupPlanner
    from swarm.config import AveragingConfig

    def settled(planned: int, claims: list[int]) -> int:
        planner = GroupPlanner(None, AveragingConfig(), None)  # type: ignore[arg-type]
        planner.order = planned + 1  # as plan() left it
        planner.settle(planned, claims)
        return planner.order

    assert settled(7, [7, 7 + ORDER_SLACK]) == 8  # a liar ahead among three
    assert settled(7, [7, 0]) == 8  # a liar behind
    assert settled(7, [7, 7 + ORDER_SLACK, 7 + ORDER_SLACK]) == 8 + ORDER_SLACK  # two agree
    assert settled(17, [5, 0]) == 6  # ran ahead of its group: back to it
    assert settled(0, [5, 17]) == 6  # behind (a restarted peer): catches up
    assert settled(0, [40]) == 41  # a pair: the larger
    assert settled(0, [1 + ORDER_SLACK]) == 1  # never further ahead than the slack
    assert settled(9, []) == 10  # nobody heard: as planned
    # the prober places this peer from the settled order, also when it came back down (a
    # placement planned from the order before would count that many rounds late)
    prober = types.SimpleNamespace(round_order=0)
    planner = GroupPlanner(None, AveragingConfig(), prober)  # type: ignore[arg-type]
    planner.settle(0, [ORDER_SLACK])  # a pair: a partner far ahead
    assert prober.round_order == planner.order == ORDER_SLACK + 1
    planner.settle(ORDER_SLACK + 1, [5, 5])  # its next group of three brings it back
    assert prober.round_order == planner.order == 6


def test_round_order_claims_in_part_streams_count_once_and_only_well_formed(records):
    """Every member's part streams carry the round order it planned with; a malformed claim,
    this member's own index, or a second claim of the same member counts for nothing."""
    group = GroupInfo(b"g" * 16, tuple(records[:4]))
    ctx = RoundContext(
        group=group,
        me=0,
        weight=1.0,
        feedback=FlatFeedback(get_codec("none"), 8),
        workers=Workers(concurrent.futures.ThreadPoolExecutor(1)),
        stall=StallPolicy(1.0, 8.0),
        deadline=time.monotonic() + 30.0,
        faults=FaultInjector(),
        order=12,
    )
    for junk in (-1, True, 2**53, 1.5, "7", None, b"\x07", [7]):
        ctx.heard_order(1, junk)
    ctx.heard_order(0, 99)  # its own index
    ctx.heard_order(2, 12)
    ctx.heard_order(2, 500)  # a second claim of member 2
    ctx.heard_order(3, 13)
    assert ctx.orders == {2: 12, 3: 13}
    assert FaultInjector(Fault.ORDER_AHEAD).order(12) > FaultInjector().order(12) == 12
    ctx.workers.pool.shutdown()


def test_repair_is_planned_alike_by_every_member_that_lost_the_same_parts(records):
    group = GroupInfo(b"g" * 16, tuple(records))
    plan = PartPlan.create(4000, [1.0] * 4, 256)
    # members 0 and 2 both refused part 3 (its owner lied); the liar itself lost nothing
    first, second = Repair.plan(group, plan, 0, {0, 1, 2}), Repair.plan(group, plan, 2, {0, 1, 2})
    assert first is not None and first == second
    assert first.parts == (3,) and first.numel == plan.size(3)
    assert first.group.members == tuple(records[:3])
    assert Repair.plan(group, plan, 3, {0, 1, 2, 3}) is None
    assert Repair.plan(group, plan, 0, {0, 1, 2, 3}) is None
    # only one member would be left: nothing to average with
    assert Repair.plan(group, plan, 0, {0}) is None
    two = Repair.plan(group, plan, 0, {0, 2})
    assert two is not None and two.parts == (1, 3) and two.group.group_id != first.group.group_id


def test_repair_maps_back_only_the_parts_averaged_whole(records):
    group = GroupInfo(b"g" * 16, tuple(records))
    plan = PartPlan.create(4000, [1.0] * 4, 256)
    repair = Repair.plan(group, plan, 0, {0, 2})
    assert repair is not None
    flat = torch.arange(4000, dtype=torch.float32)
    sub = repair.gather(flat)
    assert torch.equal(sub, torch.cat([flat[1000:2000], flat[3000:4000]]))
    sub_plan = PartPlan.create(repair.numel, [1.0, 1.0], 256)  # members 0 and 2 are left
    assert repair.repaired(sub_plan, {0: (0, 1), 1: (0, 1)}, group) == {1: (0, 2), 3: (0, 2)}
    assert repair.repaired(sub_plan, {0: (0, 1)}, group) == {1: (0, 2)}  # its half failed
    assert repair.repaired(sub_plan, {0: (0,)}, group) == {}  # nobody else contributed
    # a repair part that straddles two failed parts is needed for both
    skewed = PartPlan.create(repair.numel, [3.0, 1.0], 256)
    assert repair.repaired(skewed, {0: (0, 1)}, group) == {1: (0, 2)}
    assert repair.repaired(skewed, {1: (0, 1)}, group) == {}
    from swarm.averaging.butterfly.staged import StagedAverages

    sub_staged, staged = StagedAverages(sub), StagedAverages(flat)
    for j, (start, end) in enumerate(sub_plan.ranges):  # what the repair's owners sent back
        sub_staged.stage_values(j, start, sub[start:end] * 2)
    repair.stage(sub_staged, [0, 1], staged, {1})
    result = torch.zeros(4000)
    staged.apply([result], [1, 3])  # part 3 was not repaired: nothing staged, nothing written
    assert torch.equal(result[1000:2000], flat[1000:2000] * 2)
    assert not result[:1000].any() and not result[2000:].any()


class _CheckedEvent(asyncio.Event):
    """An event that runs a check each time it is set (the owner wakes on it)."""

    def __init__(self, check) -> None:
        super().__init__()
        self.check = check

    def set(self) -> None:
        self.check()
        super().set()


async def test_a_refused_chunk_is_never_ready_with_its_sender_live(records):
    """The owner finishes a chunk as soon as it is ready when its intake wakes it; a payload
    whose add failed must have failed its sender by then, or its half-decoded row (a NaN)
    enters the average."""
    group = GroupInfo(b"g" * 16, tuple(records[:3]))
    pool = concurrent.futures.ThreadPoolExecutor(1)
    ctx = RoundContext(
        group=group,
        me=0,
        weight=1.0,
        feedback=FlatFeedback(get_codec("none"), 8),
        workers=Workers(pool),
        stall=StallPolicy(1.0, 8.0),
        deadline=time.monotonic() + 30.0,
        faults=FaultInjector(),
    )
    reducer = PartReducer(((0, 8),), [1, 2])
    reducer.begin(torch.ones(8), 1.0)
    intake = PartIntake(ctx, reducer)
    wakes: list[tuple[bool, tuple[int, ...]]] = []  # (chunk ready, its live senders) per wake

    def check() -> None:  # runs in loop callbacks, where a raise would only be logged
        wakes.append((intake.chunk_ready(0), reducer.delivered(0)))

    intake.changed = _CheckedEvent(check)
    nan = FaultInjector(Fault.NAN).payload(get_codec("none").encode(torch.ones(8)))

    async def stream():
        yield nan

    try:
        intake.accept(1, 1.0)
        intake.fail(2)  # the other sender is gone: sender 1's chunk alone makes it ready
        with pytest.raises(TransportError, match="non-finite"):
            await intake.receive(stream(), 1)
        assert reducer.state(1) is SenderState.FAILED and reducer.tainted
        ready = [delivered for is_ready, delivered in wakes if is_ready]
        assert ready, wakes  # the owner was woken with the chunk ready
        assert all(1 not in delivered for delivered in ready), wakes
    finally:
        await ctx.workers.drain()
        pool.shutdown()


async def test_a_repair_that_never_starts_here_is_refused_once_its_round_settled() -> None:
    """Streams of a repair name the round they repair: once that round settled here, a repair
    that did not start here never will, so waiting and later streams hear "over" at once; a
    repair that did start is still found, and nothing is left behind."""
    from swarm.averaging.butterfly.rounds import RoundRegistry

    registry = RoundRegistry()
    parent, child, other = b"p" * 16, b"c" * 16, b"o" * 16
    waiting = asyncio.create_task(registry.find(child, parent))
    unrelated = asyncio.create_task(registry.find(other, b"x" * 16))
    await asyncio.sleep(0)
    assert not waiting.done()
    registry.settle(parent)
    for _ in range(5):  # a few turns of the loop, far from the 5 s a stream waits otherwise
        await asyncio.sleep(0)
    assert waiting.done() and waiting.result() is None
    assert not unrelated.done()  # another round's repair still waits for its start
    assert await registry.find(child, parent) is None  # later: at once
    started = object()
    registry.start(other, started)  # type: ignore[arg-type]
    assert await unrelated is started
    registry.settle(b"x" * 16)
    assert await registry.find(other, b"x" * 16) is started  # it started here: found
    assert registry._children == {}


def test_a_members_exclusions_never_change_the_groups_plan(records):
    """Every member computes the same plan from the group's agreed info: an owner this member
    accused keeps its part there (this member sends it nothing, and the part is repaired),
    so the other members' parts keep their sizes and nobody refuses anybody's streams."""
    from types import SimpleNamespace

    from swarm.averaging.butterfly.exclusions import Exclusions
    from swarm.averaging.butterfly.runner import ButterflyRunner
    from swarm.config import AveragingConfig

    group = GroupInfo.create(
        records, measured={r.peer_id: 1e6 * (i + 1) for i, r in enumerate(records)}
    )
    runner = SimpleNamespace(config=AveragingConfig(), _chunk_elems={}, excluded=Exclusions())
    codec = get_codec("int8")
    plan = ButterflyRunner._plan(runner, group, 100_000, codec)
    accused = max(range(len(records)), key=plan.size)
    runner.excluded.accuse(group.members[accused].peer_id, "accused in an earlier round")
    assert ButterflyRunner._plan(runner, group, 100_000, codec) == plan
    assert plan.size(accused) > 0


def test_a_second_accusation_within_8_rounds_excludes_for_rounds_that_double(records):
    """A wrong accusation (an honest owner whose part averaged a far member's values) must not
    cut an honest peer off: one accusation refuses the part only. A liar lies again at once and
    is excluded, for twice as long each time it comes back and lies."""
    from swarm.averaging.butterfly.exclusions import Exclusions

    peer, other = records[0].peer_id, records[1].peer_id
    ex = Exclusions(first_rounds=3, strike_rounds=2, remembered=2)
    ex.start_round()
    assert not ex.accuse(peer, "accused in round 1")  # a strike only
    assert peer not in ex and ex.accused(peer) and not ex.accused(other)
    for _ in range(3):
        ex.start_round()
    assert not ex.accuse(peer, "round 4: more than 2 rounds after the first")
    ex.start_round()
    assert ex.accuse(peer, "round 5: within 2 rounds")  # out for rounds 6-8
    left_out = []
    for _ in range(5):
        ex.start_round()
        left_out.append(peer in ex)
    assert left_out == [True, True, True, False, False] and ex.exclusions(peer) == 1
    with pytest.raises(KeyError):
        ex.why(peer)
    ex.start_round()
    assert ex.accuse(peer, "round 11")  # excluded before: out again at once, for 6 rounds
    assert ex.why(peer) == "round 11" and ex.exclusions(peer) == 2 and len(ex) == 1
    for _ in range(6):
        ex.start_round()
        assert peer in ex
    ex.start_round()
    assert peer not in ex and other not in ex and len(ex) == 0
    # bounded: the least recently accused is forgotten first
    ex.accuse(other, "x")
    ex.accuse(records[2].peer_id, "y")
    assert not ex.accused(peer) and ex.accused(other)
    assert "not a peer" not in ex
    assert Exclusions(strike_rounds=0).accuse(peer, "at once")
    with pytest.raises(ValueError):
        Exclusions(first_rounds=0)
