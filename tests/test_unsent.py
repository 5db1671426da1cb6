"""Error feedback kept in the model: what a sparse round's payloads leave out of a peer's
pseudo-gradient stays in its model, not in a residual beside it (``OuterState.keep_unsent``)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from loopback_peers import fixed_group_config, start_peers

from swarm.api import AsyncSwarm
from swarm.averaging import Averager, Fault, PartPlan
from swarm.averaging.butterfly.residuals import FlatFeedback
from swarm.compression import get_codec


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _residual(swarm: AsyncSwarm) -> torch.Tensor:
    """The averager's sender residual of its training rounds."""
    (fb,) = [f for kind, f in swarm.averager.butterfly.feedbacks.items() if kind.saved]
    return fb.unsent().float()


def test_only_the_ranges_given_are_cleared() -> None:
    fb = FlatFeedback(get_codec("sparse"), 8192)
    assert fb.unsent() is None  # nothing encoded yet
    fb.encode(torch.randn(8192, generator=torch.Generator().manual_seed(0)), 0)
    before = fb.unsent().clone()
    fb.drop_sent([(100, 200), (4096, 8192)])
    after = fb.unsent()
    assert not after[100:200].any() and not after[4096:].any()
    assert torch.equal(after[:100], before[:100]) and torch.equal(after[200:4096], before[200:4096])
    assert FlatFeedback(get_codec("none"), 10).unsent() is None  # lossless: no residual


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap", [False, True])
async def test_the_model_keeps_what_the_sparse_codec_left_out(overlap: bool) -> None:
    """After a round, each peer's model is its anchor minus what its payloads left out; before
    this, it was the anchor, and the residual sent that progress again one round later."""
    swarms: list[AsyncSwarm] = []
    try:
        for i in range(2):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh())
            swarms.append(
                await AsyncSwarm.create(
                    model,
                    torch.optim.SGD(model.parameters(), lr=0.05),
                    run_id=f"unsent-{overlap}",
                    listen=f"127.0.0.{240 + i}:0",
                    initial_peers=[swarms[0].address] if swarms else [],
                    codec="sparse",
                    inner_steps=2,
                    overlap=overlap,
                    min_group_size=2,
                    matchmaking_timeout_s=5.0,
                    round_timeout_s=30.0,
                    sync_on_join=False,
                    anchor_sync_every=0,
                )
            )

        async def train(swarm: AsyncSwarm, seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            for _ in range(2):
                x = torch.randn(16, 64, generator=g)
                (swarm.model(x) - 0.5 * seed).pow(2).mean().backward()
                await swarm.step(samples=16)
                swarm.optimizer.zero_grad()
            assert await swarm.wait_round() is not None or not overlap

        await asyncio.gather(*(train(s, i + 1) for i, s in enumerate(swarms)))
        for s in swarms:
            last = s.peer.progress.last_round
            assert last is not None and last.averaged, last
            r = _residual(s)
            # the other member's part (this one's own is not encoded): 96 of 4096 values went out
            assert r.count_nonzero() > r.numel() // 3
            anchor = _flat(s.engine.outer.anchor)
            model = _flat(s.model.parameters())
            # (an overlapped landing adds the steps in flight, none here, with float rounding)
            assert torch.allclose(model, anchor - r, rtol=0, atol=1e-8), (model - anchor + r).abs()
    finally:
        await asyncio.gather(*(s.close() for s in swarms), return_exceptions=True)


@pytest.mark.timeout(120)
async def test_a_round_that_keeps_unsent_values_adds_back_none_of_the_last() -> None:
    """Two rounds of the same values: with ``keep_unsent`` the second leaves out of each value
    it did not send the value itself (times the codec's decay: nothing added back); without,
    the value plus the first round's residual."""
    peers = await start_peers(range(242, 244), run_id="unsent-rounds")
    config = fixed_group_config(2, "unsent", codec="sparse")
    averagers = [Averager(p, config) for p in peers]
    try:
        numel = 40_000
        inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in (1, 2)]
        decay = get_codec("sparse").feedback_decay
        for keep in (True, False):
            for _ in range(2):
                results = await asyncio.gather(
                    *(
                        a.average([x.clone()], updates=True, keep_unsent=keep)
                        for a, x in zip(averagers, inputs, strict=True)
                    )
                )
                assert all(r.averaged for r in results), results
            for r, x in zip(results, inputs, strict=True):
                # where a payload (the own part's too: a pair's reply) left the value out
                fresh = (r.unsent == (x * decay).bfloat16()) | (r.unsent == 0)
                share = float(fresh.float().mean())
                assert share > 0.95 if keep else share < 0.6, (keep, share)
    finally:
        await asyncio.gather(*(a.close() for a in averagers))
        await asyncio.gather(*(p.close() for p in peers))


@pytest.mark.timeout(120)
async def test_a_part_that_kept_own_values_owes_nothing() -> None:
    """A frozen owner: the other member applies its own values to that part, so what its
    payloads to that owner left out is not owed to a later round (it would count twice)."""
    peers = await start_peers(range(244, 246), run_id="unsent-frozen")
    # the honest member waits out the round for the frozen owner's reply: 8 s of 40k values
    config = fixed_group_config(
        2, "frozen", codec="sparse", matchmaking_timeout_s=4.0, round_timeout_s=8.0
    )
    averagers = [Averager(p, config) for p in peers]
    averagers[1].faults.fault = Fault.SKIP_REPLY
    try:
        numel = 40_000
        inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in (1, 2)]
        results = await asyncio.gather(
            *(a.average([x], updates=True) for a, x in zip(averagers, inputs, strict=True))
        )
        honest = results[0]
        mine = honest.members.index(peers[0].peer_id)
        assert list(honest.parts) == [mine], honest
        ranges = PartPlan.create(numel, [1.0, 1.0], 1).ranges
        (start, end), (own_start, own_end) = ranges[1 - mine], ranges[mine]
        assert honest.unsent is not None and not honest.unsent[start:end].any()
        # in a pair the own part goes out as a payload of its own (its owner's reply): what
        # that left out is owed like any sender's
        assert honest.unsent[own_start:own_end].any()
    finally:
        await asyncio.gather(*(a.close() for a in averagers))
        await asyncio.gather(*(p.close() for p in peers))


@pytest.mark.timeout(120)
async def test_a_retried_int8_part_encodes_its_chunks_afresh(monkeypatch) -> None:
    """int8 senders keep no copy of their payloads for a retry (a fifth of the vector in a
    group of 4): when a sender that stalls halfway taints a part, the others encode their
    chunks of it again, without counting the discarded attempt's error twice."""
    again: list[int] = []
    encode_again = FlatFeedback.encode_again

    def counted(self: FlatFeedback, values: torch.Tensor, start: int) -> bytes:
        again.append(start)
        return encode_again(self, values, start)

    monkeypatch.setattr(FlatFeedback, "encode_again", counted)
    n, numel = 3, 8 << 20  # 8 chunks per part: the staller stops after 4
    peers = await start_peers(range(246, 249), run_id="unsent-retry")
    config = fixed_group_config(
        n, "retry", codec="int8", score_updates=False, stall_timeout_min_s=1.0
    )
    faults = [Fault.NONE, Fault.NONE, Fault.STALL_MID_STREAM]
    averagers = [Averager(p, config, fault=f) for p, f in zip(peers, faults, strict=True)]
    try:
        inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in (1, 2, 3)]
        tensors = [x.clone() for x in inputs]
        rounds = [a.average([t]) for a, t in zip(averagers, tensors, strict=True)]
        results = await asyncio.gather(*rounds[:2], asyncio.wait_for(rounds[2], 60))
        assert again, "no part was retried"
        honest = {p.peer_id for p in peers[:2]}
        ranges = PartPlan.create(numel, [1.0] * n, 1).ranges
        mean = (inputs[0] + inputs[1]) / 2
        for result in results[:2]:
            for j, members in result.parts.items():
                if result.members[j] in honest:  # retried without the staller
                    assert set(members) == honest, result
                    start, end = ranges[j]
                    err = (tensors[0][start:end] - mean[start:end]).abs().max()
                    assert err < 0.05, (j, err)  # int8 steps of about 4.5 / 127
        assert torch.equal(tensors[0], tensors[1])
        for a, x in zip(averagers[:2], inputs[:2], strict=True):
            (fb,) = a.butterfly.feedbacks.values()
            r = fb.unsent().float()
            # each encoding leaves at most half a step of its block: no chunk counted twice
            assert r.abs().max() < x.abs().max() / 127, r.abs().max()
    finally:
        for a in averagers:
            await a.close()
        await asyncio.gather(*(p.close() for p in peers))
