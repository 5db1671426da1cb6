"""Two or three AsyncSwarm peers on one loop: BatchNorm averaging, state download, CUDA."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarm.api import AsyncSwarm
from swarm.averaging.butterfly.runner import RoundKind
from swarm.training.checkpoint import read_checkpoint
from swarm.training.transfer import Fault

OPTIONS = {
    "listen": "127.0.0.1:0",
    "codec": "none",
    "matchmaking_timeout_s": 5.0,
    "round_timeout_s": 60.0,
    "heartbeat_s": 2.0,
}


def bn_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 12), torch.nn.BatchNorm1d(12), torch.nn.ReLU(), torch.nn.Linear(12, 2)
    )


async def start(model: torch.nn.Module, run_id: str, peers: list[str] = (), **kw) -> AsyncSwarm:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return await AsyncSwarm.create(
        model, opt, run_id=run_id, initial_peers=list(peers), **{**OPTIONS, **kw}
    )


async def train(swarm: AsyncSwarm, shift: float, steps: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(int(shift * 10))
    report = None
    for _ in range(steps):
        x = (torch.randn(32, 6, generator=g) * (1 + shift) + shift).to(device)
        swarm.model(x).pow(2).mean().backward()
        report = await swarm.step(samples=32)
        swarm.optimizer.zero_grad()
    # an overlapped round still in flight lands here (the report of the last step says so)
    landed = await swarm.wait_round() if report is not None and report.in_flight else None
    return landed or report


async def test_batchnorm_statistics_agree_after_averaging() -> None:
    a = await start(bn_model(0), "bn", inner_steps=4)
    try:
        b = await start(bn_model(1), "bn", [a.address], inner_steps=4)
        try:
            # b downloaded a's weights on joining.
            for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
                assert torch.equal(p, q)
            ra, rb = await asyncio.gather(train(a, 0.0, 4), train(b, 3.0, 4))
            assert ra.averaged and rb.averaged and ra.group_size == 2, (ra, rb)
            bn_a, bn_b = a.model[1], b.model[1]
            torch.testing.assert_close(bn_a.running_mean, bn_b.running_mean, rtol=0, atol=1e-6)
            torch.testing.assert_close(bn_a.running_var, bn_b.running_var, rtol=0, atol=1e-6)
            assert bn_a.running_mean.abs().max() > 0.05  # really moved by b's shifted data
            for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
                torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
        finally:
            await b.close()
    finally:
        await a.close()


async def test_joiner_downloads_from_several_and_survives_a_truncating_provider() -> None:
    a = await start(bn_model(0), "join", inner_steps=2, sync_on_join=False)
    c = await start(bn_model(0), "join", [a.address], inner_steps=2)
    try:
        c._provider.fault = Fault.TRUNCATE
        # Same round and same bytes at both providers: the joiner splits the download.
        b = await start(bn_model(5), "join", [a.address], inner_steps=2, state_parts=2)
        try:
            for p, q in zip(
                a.model.state_dict().values(), b.model.state_dict().values(), strict=True
            ):
                assert torch.equal(p, q)
        finally:
            await b.close()
        a._provider.fault = Fault.CORRUPT
        c._provider.fault = Fault.CORRUPT
        victim = bn_model(6)
        before = [t.clone() for t in victim.state_dict().values()]
        # no verified state: the joiner starts from its own weights (issue 35: it used to raise)
        joiner = await start(victim, "join", [a.address], inner_steps=2)
        await joiner.close()
        assert joiner.joined is None and joiner.round == 0
        assert all(
            torch.equal(x, y) for x, y in zip(before, victim.state_dict().values(), strict=True)
        )
    finally:
        await c.close()
        await a.close()


async def test_joiner_asks_again_when_its_only_provider_breaks_the_connection_once() -> None:
    """A reset mid-part (seen under load) is not the end of the join: the part is asked again."""
    a = await start(bn_model(0), "rejoin", inner_steps=2, sync_on_join=False)
    try:
        a._provider.fault = Fault.BREAK_ONCE
        b = await start(bn_model(5), "rejoin", [a.address], inner_steps=2)
        try:
            assert a._provider.fault is Fault.NONE  # the break did happen
            for p, q in zip(
                a.model.state_dict().values(), b.model.state_dict().values(), strict=True
            ):
                assert torch.equal(p, q)
        finally:
            await b.close()
    finally:
        await a.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("codec", ["int8", "sparse"])
async def test_cuda_model_averages_on_the_gpu(codec: str) -> None:
    models = [bn_model(0).cuda(), bn_model(0).cuda()]
    a = await start(models[0], f"cuda-{codec}", inner_steps=3, codec=codec)
    try:
        b = await start(models[1], f"cuda-{codec}", [a.address], inner_steps=3, codec=codec)
        try:
            assert all(t.is_cuda for t in a.engine.outer.slots + a.engine.outer.anchor)
            ra, rb = await asyncio.gather(train(a, 0.0, 3, "cuda"), train(b, 2.0, 3, "cuda"))
            assert ra.averaged and rb.averaged, (ra, rb)
            if codec == "sparse":  # members of a sparse round apply bit-identical updates
                for x, y in zip(a.engine.outer.anchor, b.engine.outer.anchor, strict=True):
                    assert x.is_cuda and torch.equal(x, y)
            for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
                assert p.is_cuda
                torch.testing.assert_close(p, q, rtol=0, atol=5e-2)
        finally:
            await b.close()
    finally:
        await a.close()


@pytest.mark.parametrize("mode", ["diloco", "gradients"])
@pytest.mark.parametrize("sync_every", [1, 0])
async def test_anchor_sync_brings_apart_peers_to_one_model(sync_every: int, mode: str) -> None:
    """Two peers that start from different weights (as peers of different groups end up, or in
    gradients mode a peer that missed a round) share one model after a round that syncs
    anchors; without the sync each keeps its own anchor (its own parameters)."""
    kw = {"inner_steps": 3, "sync_on_join": False, "anchor_sync_every": sync_every, "mode": mode}
    run = f"sync{sync_every}{mode}"
    a = await start(bn_model(0), run, **kw)
    try:
        b = await start(bn_model(1), run, [a.address], **kw)
        try:
            ra, rb = await asyncio.gather(train(a, 0.0, 3), train(b, 1.0, 3))
            assert ra.averaged and rb.averaged, (ra, rb)
            gaps = [
                float((p - q).detach().abs().max())
                for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True)
            ]
            if sync_every:
                assert max(gaps) < 1e-5, gaps
            else:
                assert max(gaps) > 1e-2, gaps  # the anchors stay apart for good
            # slots and anchors are views of one buffer each: averaged in place, no copy kept
            stagings = a.averager.butterfly._stagings.values()
            assert stagings and all(s._flat is None for s in stagings)
        finally:
            await b.close()
    finally:
        await a.close()


async def test_gradients_mode_syncs_parameters_only_while_they_differ() -> None:
    """In gradients mode a group syncs its members' parameters where they differ (the first
    round here: two different initial models), and sends nothing more once they are in step."""
    kw = {"sync_on_join": False, "anchor_sync_every": 1, "mode": "gradients"}
    a = await start(bn_model(0), "in-step", **kw)
    try:
        b = await start(bn_model(1), "in-step", [a.address], **kw)
        try:
            ra, rb = await asyncio.gather(_reports(a, 0.0, 4), _reports(b, 1.0, 4))
            assert all(r.averaged for r in ra + rb), (ra, rb)
            sent = [r.bytes_sent for r in ra]
            # the parameters and floating buffers are about as large as the gradients
            assert sent[0] > 1.8 * max(sent[1:]), sent
            assert max(sent[1:]) < 1.1 * min(sent[1:]), sent
            assert [r.synced for r in ra] == [True, False, False, False], ra
            assert "(synced)" in ra[0].line() and "(synced)" not in ra[1].line()
        finally:
            await b.close()
    finally:
        await a.close()


async def test_fragments_take_turns_over_the_network_each_with_its_own_residuals(
    tmp_path,
) -> None:
    """Two peers, two fragments, int8: the rounds alternate fragments, each moves about half of
    the model's bytes, anchors agree after every fragment's round, each fragment keeps its own
    error feedback, and a checkpoint restores the residuals of both."""
    kw = {"inner_steps": 4, "fragments": 2, "codec": "int8", "anchor_sync_every": 0}
    a = await start(bn_model(0), "frag", **kw)
    try:
        b = await start(bn_model(1), "frag", [a.address], **kw)
        try:
            reports = await asyncio.gather(_reports(a, 0.0, 8), _reports(b, 2.0, 8))
            for rounds in reports:
                assert [r.averaged and r.group_size == 2 for r in rounds] == [True] * 4, rounds
            # every round sent one fragment: 79 of the 158 elements, in int8
            sent = [r.bytes_sent for r in reports[0]]
            assert len(set(sent)) == 1, sent
            assert a.engine.round == b.engine.round == 4
            for x, y in zip(
                a.engine.outer.anchor + a.engine.outer.buffer_anchor,
                b.engine.outer.anchor + b.engine.outer.buffer_anchor,
                strict=True,
            ):
                torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
            kinds = {k.fragment for k in a.averager.butterfly.feedbacks if k.saved}
            assert kinds == {"1/2", "2/2"}, kinds
            # a fragment's slots are one run of the slot buffer: averaged in place
            assert all(s._flat is None for s in a.averager.butterfly._stagings.values())
            await a.save(tmp_path / "a.pt")
            saved = read_checkpoint(tmp_path / "a.pt")["averager"]
            assert saved["feedback"] is None and set(saved["fragments"]) == {"1/2", "2/2"}
            residual = saved["fragments"]["2/2"]["sender"]
            assert residual.numel() == 79 and residual.abs().max() > 0
            # a round of the parameters themselves keeps its own residual, not a fragment's
            values = await asyncio.gather(a.average_parameters(), b.average_parameters())
            assert all(v.averaged for v in values), values
            assert RoundKind("values", "") in a.averager.butterfly.feedbacks
            assert torch.equal(a.averager.state_dict()["fragments"]["2/2"]["sender"], residual)
            c = await start(bn_model(0), "frag-resumed", sync_on_join=False, **kw)
            try:
                await c.load(tmp_path / "a.pt")
                restored = c.averager.butterfly.feedback_for(
                    79, torch.device("cpu"), RoundKind("", "2/2")
                )
                assert torch.equal(restored._sender, residual)
            finally:
                await c.close()
        finally:
            await b.close()
    finally:
        await a.close()


async def _reports(swarm: AsyncSwarm, shift: float, steps: int) -> list:
    """The reports of the rounds of ``steps`` training steps (the last one landed at the end)."""
    g = torch.Generator().manual_seed(int(shift * 10))
    rounds = []
    for _ in range(steps):
        x = torch.randn(32, 6, generator=g) * (1 + shift) + shift
        swarm.model(x).pow(2).mean().backward()
        report = await swarm.step(samples=32)
        swarm.optimizer.zero_grad()
        rounds.append(report)
    landed = await swarm.wait_round()
    return [r for r in rounds if r.round_due] + ([landed] if landed is not None else [])
