"""A late joiner adopts the state a majority of distinct providers agree on, nothing else."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from swarm.api import AsyncSwarm
from swarm.errors import TrainingError
from swarm.training.agreement import SKETCH_SLICES, Manifest, agree, sketch_distance, sketch_of
from swarm.training.transfer import Fault

SKETCH = tuple(float(i + 1) for i in range(8))


def manifest(name: str, round_: int = 10, scale: float = 1.0, **kw) -> Manifest:
    provider = SimpleNamespace(peer_id=name)
    sketch = kw.pop("sketch", tuple(x * scale for x in SKETCH))
    return Manifest(provider, round_, 100, kw.pop("sha", name * 64)[:64], 0, sketch, **kw)


def names(ms) -> list[str]:
    return sorted(m.provider.peer_id for m in ms)


def test_lone_provider_far_ahead_is_refused() -> None:
    v = agree([manifest("a"), manifest("b", 11), manifest("c", 10**9)], sketch_len=8)
    assert names(v.accepted) == ["a", "b"] and v.majority
    ((liar, why),) = v.refused
    assert liar.provider.peer_id == "c" and "far ahead" in why


def test_values_and_loss_out_of_line_are_refused() -> None:
    ms = [manifest("a", loss=0.5), manifest("b", scale=1.02, loss=0.6), manifest("c", scale=100)]
    v = agree(ms, sketch_len=8)
    assert names(v.accepted) == ["a", "b"] and "away from" in v.refused[0][1]
    ms = [manifest("a", loss=0.5), manifest("b", loss=0.6), manifest("c", loss=0.55)]
    ms.append(manifest("d", loss=9.0))
    v = agree(ms, sketch_len=8)
    assert names(v.accepted) == ["a", "b", "c"] and "loss" in v.refused[0][1]
    nan = manifest("e", sketch=(float("nan"),) * 8)
    short = manifest("f", sketch=SKETCH[:4])
    bad_loss = manifest("g", loss=float("inf"))
    v = agree([manifest("a"), nan, short, bad_loss], sketch_len=8)
    assert names(v.accepted) == ["a"] and not v.majority


def test_no_majority_and_duplicates() -> None:
    assert not agree([manifest("a"), manifest("b", scale=10)], sketch_len=8).majority
    same = manifest("a")
    v = agree([same, same, same, manifest("b", scale=10)], sketch_len=8)
    assert not v.majority  # one provider answering three times is one voice
    assert agree([manifest("a")], sketch_len=8).majority  # a swarm of one provider


def test_candidates_prefer_more_holders_then_newer_rounds() -> None:
    ms = [manifest("a", sha="x"), manifest("b", sha="x"), manifest("c", 11, sha="y")]
    groups = agree(ms, sketch_len=8).candidates()
    assert [names(g) for g in groups] == [["a", "b"], ["c"]]


def test_sketch() -> None:
    values = torch.arange(1000, dtype=torch.float32)
    s = sketch_of(values)
    assert len(s) == SKETCH_SLICES and sketch_distance(s, s) == 0
    assert len(sketch_of(torch.ones(5))) == 5 and sketch_of(torch.zeros(0)) == ()
    assert sketch_distance((1.0,), (1.0, 2.0)) == float("inf")


# -- against real providers ------------------------------------------------------------------


OPTIONS = {"listen": "127.0.0.1:0", "codec": "none", "heartbeat_s": 2.0, "inner_steps": 2}


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 2))


async def start(seed: int, peers=(), **kw) -> AsyncSwarm:
    m = model(seed)
    return await AsyncSwarm.create(
        m,
        torch.optim.SGD(m.parameters(), lr=0.1),
        run_id="agree",
        initial_peers=list(peers),
        **{**OPTIONS, **kw},
    )


async def providers_and_a_liar() -> list[AsyncSwarm]:
    """Two honest providers and a third (last) that the test makes lie."""
    a = await start(0, sync_on_join=False)
    peers = [a]
    try:
        peers.append(await start(1, [a.address]))
        peers.append(await start(2, [a.address]))
    except BaseException:
        for p in reversed(peers):
            await p.close()
        raise
    return peers


@pytest.mark.parametrize("fault", [Fault.LIE_ROUND, Fault.LIE_WEIGHTS])
async def test_joiner_facing_one_lying_provider_of_three_adopts_the_honest_state(
    fault: Fault, caplog
) -> None:
    peers = await providers_and_a_liar()
    a, liar = peers[0], peers[-1]
    try:
        liar._provider.fault = fault
        honest = [t.clone() for t in a.model.state_dict().values()]
        with caplog.at_level(logging.WARNING, logger="swarm.training.transfer"):
            joiner = await start(3, [a.address])
        peers.append(joiner)
        got = list(joiner.model.state_dict().values())
        assert all(torch.equal(x, y) for x, y in zip(honest, got, strict=True))
        assert joiner.round == a.round < 10
        refused = dict(joiner.joined.refused)
        assert list(refused) == [liar.peer.peer_id], refused
        assert liar.peer.peer_id not in joiner.joined.providers
        assert "refused" in caplog.text and liar.peer.peer_id.short in caplog.text
    finally:
        for p in reversed(peers):
            await p.close()


@pytest.mark.parametrize("lie", [2**50, "40", -1, 2**60])
async def test_joiner_plans_with_its_providers_round_order_whatever_one_claims(lie) -> None:
    """The joiner's first plans use the order its providers plan with (their median), so they
    match theirs; one provider's huge or malformed order moves nothing."""
    peers = await providers_and_a_liar()
    a, liar = peers[0], peers[-1]
    try:
        for p in peers[:2]:
            p.averager.planner.order = 40
        liar._provider.order = lambda: lie
        joiner = await start(3, [a.address])
        peers.append(joiner)
        assert joiner.averager.order == 40
        assert joiner.round == a.round  # the training round is the downloaded one
    finally:
        for p in reversed(peers):
            await p.close()


async def test_no_majority_refuses_to_join_and_leaves_the_model_alone() -> None:
    a = await start(0, sync_on_join=False)
    peers = [a]
    try:
        liar = await start(2, [a.address])
        peers.append(liar)
        liar._provider.fault = Fault.LIE_WEIGHTS
        victim = model(3)
        before = [t.clone() for t in victim.state_dict().values()]
        with pytest.raises(TrainingError, match="no majority"):
            await AsyncSwarm.create(
                victim,
                torch.optim.SGD(victim.parameters(), lr=0.1),
                run_id="agree",
                initial_peers=[a.address],
                **OPTIONS,
            )
        after = victim.state_dict().values()
        assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    finally:
        for p in reversed(peers):
            await p.close()


async def test_nan_state_behind_an_honest_sketch_is_never_loaded() -> None:
    liar = await start(0, sync_on_join=False)
    try:
        liar._provider.fault = Fault.LIE_NAN  # announces a plausible sketch, serves NaN
        victim = model(3)
        before = [t.clone() for t in victim.state_dict().values()]
        with pytest.raises(TrainingError, match=r"NaN or Inf|not finite"):
            await AsyncSwarm.create(
                victim,
                torch.optim.SGD(victim.parameters(), lr=0.1),
                run_id="agree",
                initial_peers=[liar.address],
                **OPTIONS,
            )
        after = victim.state_dict().values()
        assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    finally:
        await liar.close()
