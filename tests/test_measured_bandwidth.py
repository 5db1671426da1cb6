"""Part sizes follow min(announced, measured) bandwidth: a claim alone cannot buy a larger part.

Units cover the planning rule, the rate table and the group answer that carries the leader's
measurements (hostile values included); the swarm test runs real peers on loopback, one of which
announces 1e300 bytes/s but uploads on a slow link.
"""

from __future__ import annotations

import asyncio
import math

import loopback_peers
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.address import PeerAddress
from swarm.averaging import Averager, Fault
from swarm.averaging import faults as fault_module
from swarm.averaging.butterfly.parts import (
    MEASURED_FLOOR,
    PartPlan,
    cap_shares,
    chunk_bytes_for,
    chunk_elems_for,
    effective_bandwidths,
)
from swarm.averaging.butterfly.repair import Repair
from swarm.averaging.butterfly.runner import unbelieved_claims
from swarm.averaging.butterfly.stall import StreamTiming
from swarm.averaging.groups.group import GroupInfo
from swarm.averaging.groups.rates import MIN_MEASURED_CHUNKS, PeerRates, stream_upload_rate
from swarm.compression import get_codec
from swarm.errors import AveragingError
from swarm.identity import Identity, PeerID
from swarm.net.record import PeerRecord

MB = 1e6


def _pid(i: int) -> PeerID:
    return PeerID(i.to_bytes(32, "big"))


def _records(bandwidths: list[float]) -> list[PeerRecord]:
    return [
        PeerRecord.create(
            Identity.generate(),
            address=PeerAddress("127.0.0.1", 4000 + i),
            run_id="run",
            bandwidth=bw,
        )
        for i, bw in enumerate(bandwidths)
    ]


def test_a_claim_is_believed_only_up_to_the_measurement():
    # measured lower than claimed: the measurement; higher: the claim
    assert effective_bandwidths([10 * MB, 10 * MB], [4 * MB, 50 * MB]) == [4 * MB, 10 * MB]
    # never measured: no more than the lower median claim
    assert effective_bandwidths([1e300, 10 * MB, 10 * MB, 10 * MB]) == [10 * MB] * 4
    assert effective_bandwidths([1e300, 10 * MB], [0.0, 0.0]) == [10 * MB, 10 * MB]
    # a member measured as nearly nothing keeps a floor of the largest
    floor = 10 * MB / MEASURED_FLOOR
    assert effective_bandwidths([10 * MB] * 3, [1.0, 1.0, 1e300]) == [floor, floor, 10 * MB]
    # ... which its own claim still bounds
    assert effective_bandwidths([1e3, 10 * MB], [1.0, 1e300]) == [1e3, 10 * MB]
    # a client (announced 0) stays a client whatever was measured
    assert effective_bandwidths([0.0, 10 * MB], [1e9, 1e9]) == [0.0, 10 * MB]
    assert effective_bandwidths([0.0, 0.0]) == [0.0, 0.0]


@pytest.mark.parametrize(
    "announced,measured",
    [
        ([float("inf"), 1.0], []),
        ([-1.0, 1.0], []),
        ([1.0, 1.0], [float("nan"), 1.0]),
        ([1.0, 1.0], [-1.0, 1.0]),
        ([1.0], [1.0, 1.0]),
    ],
)
def test_effective_bandwidths_refuses_junk(announced, measured):
    with pytest.raises(AveragingError):
        effective_bandwidths(announced, measured)


@given(
    n=st.integers(2, 16),
    honest=st.floats(1e3, 1e12),
    claim=st.floats(0.0, 1e300),
    data=st.data(),
)
@settings(deadline=None, max_examples=200)
def test_a_hostile_leader_owns_no_more_than_the_share_cap(n, honest, claim, data):
    """Whatever a leader hands out as measurements (its own claim and rate included), the
    honest members keep parts and the leader's share stays within max_share / n."""
    rates = data.draw(st.lists(st.floats(0.0, 1e300), min_size=n, max_size=n))
    announced = [claim] + [honest] * (n - 1)
    shares = cap_shares(effective_bandwidths(announced, rates), 2.0)
    assert all(s > 0 for s in shares[1:])
    assert shares[0] <= 2.0 / n + 1e-9
    assert math.isclose(sum(shares), 1.0)


def test_stream_upload_rate_needs_enough_chunks():
    assert stream_upload_rate(3_000_000, 4, 1.5, 6) == pytest.approx(12_000_000)
    assert stream_upload_rate(3_000_000, MIN_MEASURED_CHUNKS - 1, 1.5, 6) == 0.0
    assert stream_upload_rate(3_000_000, 4, 0.0, 6) == 0.0
    assert stream_upload_rate(0, 4, 1.0, 6) == 0.0


def test_a_stream_held_back_is_timed_without_its_holds():
    # held between chunks: the hold is the owner's, not the link's
    stream = StreamTiming()
    stream.held(5.0)  # before the first chunk: nothing to leave out yet
    for t, hold in ((10.0, 0.0), (11.0, 3.0), (15.0, 0.0)):
        stream.held(hold)
        stream.received(t, 1000)
    assert stream.elapsed == 2.0 and stream.bytes_after_first == 2000
    # a fast sender held after its last chunk waited for nothing: its rate stays its own (that
    # hold, counted, took its whole stream time and measured it at 0)
    stream.held(60.0)
    stream.complete = True
    assert stream.elapsed == 2.0


def test_peer_rates_smooth_bound_and_ignore_junk():
    rates = PeerRates(max_peers=3)
    rates.observe(_pid(1), 100.0)
    rates.observe(_pid(1), 200.0)
    assert rates.get(_pid(1)) == pytest.approx(150.0)
    for junk in (0.0, -5.0, float("nan"), float("inf")):
        rates.observe(_pid(2), junk)
    assert rates.get(_pid(2)) == 0.0 and len(rates) == 1
    for i in range(2, 6):
        rates.observe(_pid(i), 10.0 * i)
    assert len(rates) == 3 and rates.get(_pid(1)) == 0.0  # the least recently measured left


def test_a_leader_rates_itself_at_the_median_of_the_others():
    rates = PeerRates()
    for i, r in ((1, 10.0), (2, 30.0), (3, 20.0)):
        rates.observe(_pid(i), r)
    got = rates.estimates([_pid(i) for i in range(5)], _pid(0))
    assert got == {_pid(0): 20.0, _pid(1): 10.0, _pid(2): 30.0, _pid(3): 20.0, _pid(4): 0.0}
    assert PeerRates().estimates([_pid(0), _pid(1)], _pid(0)) == {_pid(0): 0.0, _pid(1): 0.0}


def test_group_answer_carries_the_measurements_and_refuses_junk():
    records = _records([10 * MB] * 4)
    measured = {r.peer_id: float(i + 1) * MB for i, r in enumerate(records)}
    group = GroupInfo.create(records, measured=measured)
    assert group.measured == tuple(measured[r.peer_id] for r in group.members)
    me, leader = records[1].peer_id, records[0].peer_id
    wire = msgpack.unpackb(msgpack.packb(group.to_wire()))
    assert GroupInfo.from_wire(wire, me=me, leader=leader) == group
    without = {k: v for k, v in wire.items() if k != "r"}
    assert GroupInfo.from_wire(without, me=me, leader=leader).measured == ()
    for junk in (
        "fast",
        [1.0, 2.0],  # not one per member
        [1.0, 2.0, 3.0, 4.0, 5.0],
        [1.0, 2.0, 3.0, float("nan")],
        [1.0, 2.0, 3.0, float("inf")],
        [1.0, 2.0, 3.0, -1.0],
        [1.0, 2.0, 3.0, 4],  # ints are not rates on this wire
        [1.0, 2.0, 3.0, None],
    ):
        with pytest.raises(AveragingError):
            GroupInfo.from_wire({**wire, "r": junk}, me=me, leader=leader)


def test_repairs_and_plans_keep_the_measurements():
    records = _records([10 * MB] * 4)
    group = GroupInfo.create(records, measured={r.peer_id: 2 * MB for r in records})
    plan = PartPlan.create(4000, [1.0] * 4, 100)
    repair = Repair.plan(group, plan, 0, {0, 2, 3})
    assert repair is not None
    assert repair.group.members == tuple(m for i, m in enumerate(group.members) if i != 1)
    assert repair.group.measured == (2 * MB,) * 3
    # one stream to each other owner, and replies to every other member from an owner
    assert plan.streams(0) == 3 + 3
    client = PartPlan.create(4000, [1.0, 0.0, 1.0, 1.0], 100)
    assert client.streams(1) == 3 and client.streams(0) == 2 + 3


def test_the_report_names_claims_planned_below_half():
    records = _records([10 * MB, 10 * MB, 1e300, 12 * MB])
    group = GroupInfo.create(records)
    named = {r.peer: r.why for r in unbelieved_claims(group)}
    assert set(named) == {records[2].peer_id}
    assert "not measured yet" in named[records[2].peer_id]
    measured = {records[2].peer_id: 3 * MB, records[3].peer_id: 50 * MB}
    group = GroupInfo.create(records, measured=measured)
    named = {r.peer: r.why for r in unbelieved_claims(group)}
    assert set(named) == {records[2].peer_id} and "(measured)" in named[records[2].peer_id]


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_an_overclaiming_peer_gets_the_part_its_link_delivers(monkeypatch):
    """Four real peers announce more than loopback carries, so every part follows what the
    leader measured. The one that also uploads slowly (0.5 s before each chunk) claims 1e300
    bytes/s; once measured, the group plans it far below its claim and the report says so.

    The slow link's rate is compared with loopback's, which a loaded machine slows: with 0.2 s
    a chunk it measured 0.21-0.25 of the slowest honest link idle, but 0.506 in a loaded suite
    and 0.4999 on CI, where the bounds below are 0.5 and 0.6; with 0.5 s, 0.05-0.06 idle."""
    monkeypatch.setattr(fault_module, "OVERCLAIM_DELAY_S", 0.5)
    peers = await loopback_peers.start_peers(range(231, 235), bandwidths=[1e12] * 4)
    # the largest PeerID never leads: an honest leader measures the overclaimer
    slow = max(range(4), key=lambda i: peers[i].peer_id.digest)
    config = loopback_peers.fixed_group_config(4, "measured", aggregator="mean")
    faults = [Fault.OVERCLAIM if i == slow else Fault.NONE for i in range(4)]
    averagers = [Averager(p, config, fault=f) for p, f in zip(peers, faults, strict=True)]
    # every part of each member's stream spans 4 chunks: enough to time the link
    numel = 4 * 4 * chunk_elems_for(get_codec("none"))
    try:
        import torch

        rounds = []
        for r in range(2):
            tensors = [torch.full((numel,), float(i + r)) for i in range(4)]
            rounds.append(
                await asyncio.gather(
                    *(a.average([t]) for a, t in zip(averagers, tensors, strict=True))
                )
            )
        slow_id = peers[slow].peer_id
        for i, result in enumerate(rounds[0]):
            assert result.averaged, result
            if i != slow:  # before any measurement: planned with the median claim
                assert {r.peer for r in result.refusals} == {slow_id}, result.refusals
        leader = averagers[min(range(4), key=lambda i: peers[i].peer_id.digest)]
        slow_rate = leader.rates.get(slow_id)
        honest_rates = [leader.rates.get(p.peer_id) for i, p in enumerate(peers) if i != slow]
        assert 0 < slow_rate < min(r for r in honest_rates if r > 0) / 2, (
            slow_rate,
            honest_rates,
        )
        # a member of an all-reduce sends V - p to the other owners and 3p back (p: its part)
        sent = [[r.bytes_sent for r in results] for results in rounds]
        honest = [i for i in range(4) if i != slow]
        assert max(sent[0]) - min(sent[0]) < 0.01 * max(sent[0])  # equal parts
        # second round, planned with the first round's measurements (those above include the
        # second's): V + 2p against V + 2q. Its link took at most half an honest one's rate
        # (0.5 s per chunk against a loaded machine's loopback), so p is well below every q
        vector = numel * 4
        part = (sent[1][slow] - vector) / 2
        assert all(part <= 0.6 * (sent[1][i] - vector) / 2 for i in honest), sent
        for i in honest:
            assert rounds[1][i].averaged, rounds[1][i]
            capped = [r for r in rounds[1][i].refusals if r.peer == slow_id]
            assert [r.action for r in capped] == ["bandwidth-capped"], rounds[1][i].refusals
            assert "(measured)" in capped[0].why
    finally:
        for a in averagers:
            await a.close()
        await asyncio.gather(*(p.close() for p in peers))


@pytest.mark.timeout(120)
async def test_a_group_its_leader_measured_slow_averages_in_small_chunks():
    """Three real peers whose leader measured every link at 100 KB/s: each member derives the
    same smaller chunks from the group's figures (nothing else says how to cut the parts), and
    the round still averages exactly."""
    import torch

    peers = await loopback_peers.start_peers(range(236, 239))
    config = loopback_peers.fixed_group_config(3, "small-chunks", aggregator="mean")
    averagers = [Averager(p, config) for p in peers]
    leader = averagers[min(range(3), key=lambda i: peers[i].peer_id.digest)]
    for p in peers:
        leader.rates.observe(p.peer_id, 1e5)
    codec = get_codec("none")
    part = chunk_elems_for(codec)  # one 1 MB chunk per part, unless the plan cuts it smaller
    small = chunk_elems_for(codec, chunk_bytes_for([1e5] * 3, 3))
    assert small < part
    try:
        tensors = [torch.full((3 * part,), float(i)) for i in range(3)]
        results = await asyncio.gather(
            *(a.average([t]) for a, t in zip(averagers, tensors, strict=True))
        )
        header = len(codec.encode(torch.zeros(small))) - 4 * small
        # a member streams the 2 other parts and sends its own part back to both
        chunks = 4 * math.ceil(part / small)
        for result, t in zip(results, tensors, strict=True):
            assert result.averaged, result
            assert torch.equal(t, torch.full_like(t, 1.0))
            assert result.bytes_sent == 4 * 4 * part + chunks * header, result.bytes_sent
    finally:
        for a in averagers:
            await a.close()
        await asyncio.gather(*(p.close() for p in peers))
