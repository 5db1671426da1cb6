"""Groups of two under a sparse codec: each owner sends back its own payload of its part and
the shares of the mean, and both members apply the same bits (swarm.averaging.butterfly.pairs)."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from loopback_peers import fixed_group_config, start_peers

from swarm.averaging import Averager, Fault, PartPlan
from swarm.averaging.butterfly.pairs import check_shares, compose, is_pairwise, pair_shares
from swarm.averaging.result import RefusalAction
from swarm.compression import decode, get_codec
from swarm.errors import AveragingError

NUMEL = 40_000


def test_only_pairs_averaging_updates_in_a_sparse_codec_exchange_payloads() -> None:
    sparse, int8 = get_codec("sparse"), get_codec("int8")
    assert is_pairwise(True, sparse, 2)
    assert is_pairwise(True, get_codec("1bit:256"), 2)  # the models' differences at the end
    assert not is_pairwise(True, int8, 2)  # a dense mean re-encoded loses little
    assert not is_pairwise(True, sparse, 3)  # each payload to every member: more bytes
    assert not is_pairwise(False, sparse, 2)  # rounds of values


def test_shares_are_float32_and_sum_to_one() -> None:
    owner, sender = pair_shares(1.0, 2.0)
    assert owner == pytest.approx(1 / 3) and abs(owner + sender - 1) < 1e-6
    assert check_shares([owner, sender], robust=True, cap=2.0) == (owner, sender)
    assert pair_shares(0.0, 0.0) == (0.5, 0.5)  # no claim either way: counted alike
    assert pair_shares(3.0, 0.0) == (1.0, 0.0)


@pytest.mark.parametrize(
    "value",
    [
        None,
        0.5,
        [0.5],
        [0.5, 0.5, 0.0],
        [True, False],
        [1, 0],
        ["0.5", "0.5"],
        [math.nan, 0.5],
        [math.inf, -math.inf],
        [1.5, -0.5],
        [0.1, 0.9],  # not float32 numbers: the owner's bits would not be the sender's
        [0.25, 0.25],
        [0.75, 0.25],  # more than a capped weight gives the owner
        [1.0, 0.0],
    ],
)
def test_hostile_shares_are_refused(value: object) -> None:
    with pytest.raises(AveragingError):
        check_shares(value, robust=True, cap=2.0)


def test_without_clipping_an_owner_may_take_any_share() -> None:
    assert check_shares([0.75, 0.25], robust=False, cap=2.0) == (0.75, 0.25)
    assert check_shares([0.75, 0.25], robust=True, cap=3.0) == (0.75, 0.25)


def test_composing_is_the_weighted_sum_of_both_payloads() -> None:
    codec = get_codec("sparse:64:4:2")
    a, b = (torch.randn(4096, generator=torch.Generator().manual_seed(i)) for i in (1, 2))
    pa, pb = codec.encode(a), codec.encode(b)
    out = compose(torch.empty(4096), pa, pb, (0.25, 0.75))
    assert torch.allclose(out, 0.25 * decode(pa) + 0.75 * decode(pb))
    assert torch.equal(compose(torch.empty(4096), pa, None, (0.25, 0.75)), decode(pa))


def _inputs() -> list[torch.Tensor]:
    return [torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)) for i in (1, 2)]


@pytest.mark.timeout(120)
async def test_a_pair_applies_both_payloads_once_compressed_and_the_same_bits() -> None:
    """Each member ends with the mean of the two members' own payloads (what each payload left
    out is in its residual), the same bits on both, and more values a chunk than one payload
    holds: nothing was compressed a second time."""
    peers = await start_peers(range(246, 248), run_id="pairs")
    config = fixed_group_config(2, "pairs", codec="sparse")
    averagers = [Averager(p, config) for p in peers]
    try:
        inputs = _inputs()
        tensors = [x.clone() for x in inputs]
        results = await asyncio.gather(
            *(
                a.average([t], updates=True, keep_unsent=True)
                for a, t in zip(averagers, tensors, strict=True)
            )
        )
        assert all(r.averaged and len(r.parts) == 2 for r in results), results
        assert torch.equal(tensors[0], tensors[1])
        decay = get_codec("sparse").feedback_decay
        sent = [x - r.unsent.float() / decay for x, r in zip(inputs, results, strict=True)]
        expected = 0.5 * sent[0] + 0.5 * sent[1]
        assert torch.allclose(tensors[0], expected, atol=0.05), (tensors[0] - expected).abs().max()
        chunks = math.ceil(NUMEL / 4096)
        assert int(tensors[0].count_nonzero()) > 1.5 * 96 * chunks  # one payload: 96 a chunk
    finally:
        await asyncio.gather(*(a.close() for a in averagers))
        await asyncio.gather(*(p.close() for p in peers))


@pytest.mark.timeout(120)
async def test_an_owner_that_claims_the_whole_mean_is_accused() -> None:
    """An owner of a pair that gives itself the whole mean: its part is refused (the honest
    member keeps its own values there) and it is accused; the honest member's own part still
    averages (the liar applies it too)."""
    peers = await start_peers(range(248, 250), run_id="pairs-liar")
    config = fixed_group_config(2, "pairs-liar", codec="sparse")
    averagers = [Averager(p, config) for p in peers]
    averagers[1].faults.fault = Fault.LYING_OWNER
    try:
        inputs = _inputs()
        tensors = [x.clone() for x in inputs]
        results = await asyncio.gather(
            *(a.average([t], updates=True) for a, t in zip(averagers, tensors, strict=True))
        )
        honest = results[0]
        mine = honest.members.index(peers[0].peer_id)
        assert list(honest.parts) == [mine], honest
        accused = [r for r in honest.refusals if r.action is RefusalAction.ACCUSED]
        assert [r.peer for r in accused] == [peers[1].peer_id], honest.refusals
        start, end = PartPlan.create(NUMEL, [1.0, 1.0], 1).ranges[1 - mine]
        assert torch.equal(tensors[0][start:end], inputs[0][start:end])
    finally:
        await asyncio.gather(*(a.close() for a in averagers))
        await asyncio.gather(*(p.close() for p in peers))
