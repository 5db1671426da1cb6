"""Hostile peers through the real code: each attack of issue 11 against honest peers on loopback.

Every peer is a real :class:`~swarm.peer.Peer` with its own loopback address; attackers run the
same :class:`~swarm.averaging.Averager` with a :class:`~swarm.averaging.Fault` switched on (huge
values, scaled sign flips, a huge weight, overflow values, NaN, a lying owner, a huge bandwidth
claim then lies, a frozen owner, a claim of 1e300 bytes/s on a slow link). With 1 attacker among
4 peers and 2 among 8, every honest peer must apply only finite values that stay close to the
honest peers' mean, and its round report must name every attacker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import loopback_peers
import pytest
import torch

from swarm.averaging import Averager, Fault, RoundResult
from swarm.averaging.faults import LIARS
from swarm.peer import Peer

NUMEL = 40_000
ATTACKS = [
    Fault.HUGE_VALUES,
    Fault.SIGN_FLIP,
    Fault.HUGE_WEIGHT,
    Fault.OVERFLOW,
    Fault.NAN,
    Fault.LYING_OWNER,
    Fault.HUGE_BANDWIDTH,
    Fault.SKIP_REPLY,
    Fault.NAN_OWNER,
    Fault.OVERCLAIM,
]
HONEST_DEV_BOUND = 1.0  # the benchmark's "poisoned" line
HONEST_DEV_GOAL = 0.5  # issue 11's goal, for every attack and every round
# Stall limits (stall_timeout_min_s; the default is 6 s): short, so that a frozen owner costs
# seconds, but not so short that an honest sender whose first chunk a loaded 2-core machine
# delays (8 peers share one event loop) is dropped as one that never started.
STALL_FLOOR_S = 2.0
OWNER_FAULTS = (*LIARS, Fault.SKIP_REPLY)  # their parts fail: averaged again without them


def honest_values(seed: int, numel: int = NUMEL) -> torch.Tensor:
    """A shared trend plus this peer's own noise, as pseudo-gradients of one model look."""
    trend = torch.randn(numel, generator=torch.Generator().manual_seed(1234))
    return trend + 0.5 * torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def honest_dev(got: torch.Tensor, honest: Sequence[torch.Tensor]) -> float:
    """||got - honest mean|| / RMS distance of the honest inputs to their mean."""
    stack = torch.stack([h.double() for h in honest])
    mean = stack.mean(0)
    rms = float((stack - mean).norm(dim=1).pow(2).mean().sqrt())
    return float((got.double() - mean).norm()) / rms


async def start_peers(n: int, base: int) -> list[Peer]:
    return await loopback_peers.start_peers(range(base, base + n), run_id="byzantine")


async def run_rounds(
    n: int, attackers: int, fault: Fault, rounds: int, base: int, codec: str = "none"
) -> tuple[list[list[RoundResult]], list[list[torch.Tensor]], list[torch.Tensor], list[Peer]]:
    """``rounds`` rounds of ``n`` peers, the last ``attackers`` of them faulty; returns every
    honest peer's results and applied values per round, the honest inputs and the peers."""
    peers = await start_peers(n, base)
    config = loopback_peers.fixed_group_config(
        n, "byz", stall_timeout_min_s=STALL_FLOOR_S, codec=codec
    )
    faults = [Fault.NONE] * (n - attackers) + [fault] * attackers
    averagers = [Averager(p, config, fault=f) for p, f in zip(peers, faults, strict=True)]
    inputs = [honest_values(i) for i in range(n)]
    results: list[list[RoundResult]] = [[] for _ in range(n - attackers)]
    applied: list[list[torch.Tensor]] = [[] for _ in range(n - attackers)]
    try:
        for _ in range(rounds):
            tensors = [x.clone() for x in inputs]
            got = await asyncio.gather(
                *(a.average([t]) for a, t in zip(averagers, tensors, strict=True))
            )
            for i in range(n - attackers):
                results[i].append(got[i])
                applied[i].append(tensors[i])
    finally:
        for a in averagers:
            await a.close()
        await asyncio.gather(*(p.close() for p in peers))
    return results, applied, inputs[: n - attackers], peers


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,attackers", [(4, 1), (8, 2)])
@pytest.mark.parametrize("fault", ATTACKS, ids=[f.value for f in ATTACKS])
async def test_honest_peers_stay_near_the_honest_mean(n: int, attackers: int, fault: Fault):
    base = 10 + 10 * ATTACKS.index(fault) + (0 if n == 4 else 100)
    rounds = 3 if fault in LIARS else 1
    results, applied, honest, peers = await run_rounds(n, attackers, fault, rounds, base)
    bad = {p.peer_id for p in peers[n - attackers :]}
    for mine, values in zip(results, applied, strict=True):
        first = mine[0]
        assert first.averaged, first
        named = {r.peer for r in first.refusals}
        assert bad <= named, (fault, [str(r) for r in first.refusals])
        assert not (named - bad), [str(r) for r in first.refusals]  # no honest peer named
        for result, got in zip(mine, values, strict=True):
            assert torch.isfinite(got).all()
            assert honest_dev(got, honest) <= HONEST_DEV_GOAL, (fault, result)
        if fault in OWNER_FAULTS:  # the attackers' parts, averaged again by the honest peers
            honest_ids = set(first.members) - bad
            owned = [j for j, m in enumerate(first.members) if m in bad]
            assert all(set(first.parts[j]) == honest_ids for j in owned), first
            assert "averaged again" in first.reason, first
        if rounds > 2:  # the liar was accused in rounds 1 and 2: excluded from round 3
            last = mine[-1]
            assert {r.peer for r in last.refusals if r.action == "excluded"} == bad, last


# Sparse rounds: one round carries a few values of each chunk by design, and error feedback
# sends the rest in later rounds, so what honest peers apply is judged over rounds (the mean of
# what they applied). A 4-bit spec keeping 3/4 of each chunk gets there in a few rounds; the
# default spec (1.6% of the values, 2 bits) needs about 150 honest rounds to come within 0.5 of
# its own honest mean, so with it each round is checked for refusals and bounded values.
SPARSE_ATTACKS = [Fault.HUGE_VALUES, Fault.LYING_OWNER, Fault.NAN, Fault.NAN_OWNER]
SPARSE_FAST = "sparse:64:48:4"
SPARSE_ROUNDS = 3  # measured: 0.18 (huge values) and 0.26 (a lying owner) after 3 rounds


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec", ["sparse", SPARSE_FAST])
@pytest.mark.parametrize("fault", SPARSE_ATTACKS, ids=[f.value for f in SPARSE_ATTACKS])
async def test_sparse_rounds_refuse_attackers_and_stay_near_the_honest_mean(fault, codec):
    base = 210 + 8 * SPARSE_ATTACKS.index(fault) + (4 if codec == SPARSE_FAST else 0)
    rounds = SPARSE_ROUNDS if codec == SPARSE_FAST or fault in LIARS else 2
    results, applied, honest, peers = await run_rounds(4, 1, fault, rounds, base, codec)
    bad = peers[3].peer_id
    scale = max(float(h.abs().max()) for h in honest)
    for mine, values in zip(results, applied, strict=True):
        first = mine[0]
        assert first.averaged and len(first.parts) >= 3, first  # the honest parts at least
        assert {r.peer for r in first.refusals} == {bad}, [str(r) for r in first.refusals]
        for got in values:
            # a sparse round keeps the largest values of each chunk (error feedback's backlog
            # included): a few times the inputs at most, never the attacker's 1e30
            assert torch.isfinite(got).all() and float(got.abs().max()) < 100 * scale
        if fault in LIARS:  # accused in rounds 1 and 2, excluded from the third
            assert "averaged again" in first.reason, first
            assert {r.peer for r in mine[-1].refusals if r.action == "excluded"} == {bad}
        if codec == SPARSE_FAST:
            assert honest_dev(torch.stack(values).mean(0), honest) <= HONEST_DEV_GOAL
    # every honest member applied the same bits in every round
    for r in range(rounds):
        assert all(torch.equal(applied[0][r], other[r]) for other in applied[1:])


async def test_plain_mean_is_one_setting_away_and_exact() -> None:
    peers = await start_peers(3, 240)
    config = loopback_peers.fixed_group_config(3, "mean", aggregator="mean")
    averagers = [Averager(p, config) for p in peers]
    try:
        inputs = [honest_values(i, 5000) for i in range(3)]
        tensors = [x.clone() for x in inputs]
        results = await asyncio.gather(
            *(
                a.average([t], weight=w)
                for a, t, w in zip(averagers, tensors, (1.0, 2.0, 5.0), strict=True)
            )
        )
        want = (inputs[0] + 2 * inputs[1] + 5 * inputs[2]) / 8
        for result, got in zip(results, tensors, strict=True):
            assert result.averaged and not result.refusals, result
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        for a in averagers:
            await a.close()
        await asyncio.gather(*(p.close() for p in peers))


async def test_parameters_that_barely_differ_average_to_one_model() -> None:
    """Averaging model values (not their changes): three peers hold the same weights, the fourth
    a few local steps more, which moved its small biases the most. Every peer ends with the
    same values, near the three's, and no honest owner is accused."""
    n, numel = 4, 20_000
    peers = await start_peers(n, 250)
    config = loopback_peers.fixed_group_config(n, "values", codec="none")
    averagers = [Averager(p, config) for p in peers]
    try:
        weights = torch.randn(numel, generator=torch.Generator().manual_seed(5))
        weights[-numel // 8 :] *= 0.01  # biases near zero, last in the vector
        drift = 1e-5 * torch.randn(numel, generator=torch.Generator().manual_seed(6))
        drift[-numel // 8 :] *= 20  # ... which local steps moved the most
        inputs = [weights.clone() for _ in range(n - 1)] + [weights + drift]
        tensors = [x.clone() for x in inputs]
        results = await asyncio.gather(
            *(a.average([t]) for a, t in zip(averagers, tensors, strict=True))
        )
        for result in results:
            assert result.averaged and len(result.parts) == n, result
            assert not [r for r in result.refusals if r.action == "accused"], result
        for got in tensors[1:]:
            assert float((got - tensors[0]).abs().max()) <= 1e-6
        assert float((tensors[0] - weights).norm()) <= 0.1 * float(drift.norm())
    finally:
        for a in averagers:
            await a.close()
        await asyncio.gather(*(p.close() for p in peers))


async def test_a_member_that_kept_its_own_values_of_a_part_accuses_no_honest_owner_after() -> None:
    """Round 1: one owner breaks its reply to one member, which keeps its own values of that
    part while the others apply the average. Round 2 (every peer honest, each a few local steps
    further): that member's values part from the others' in that range only, ten times as far
    as anywhere else, and its check accused the honest owner there (issue 34, seen at 10
    Mbit/s). It no longer does; an owner that lies there blatantly in round 3 still is."""
    n, numel = 4, 20_000
    peers = await start_peers(n, 225)
    config = loopback_peers.fixed_group_config(n, "kept", stall_timeout_min_s=2.0)
    faults = [Fault.NONE] * (n - 1) + [Fault.CUT_ONE_REPLY]
    averagers = [Averager(p, config, fault=f) for p, f in zip(peers, faults, strict=True)]

    def steps(seed: int, scale: float) -> list[torch.Tensor]:
        return [
            scale * torch.randn(numel, generator=torch.Generator().manual_seed(seed + i))
            for i in range(n)
        ]

    async def average(tensors: list[torch.Tensor]) -> list[RoundResult]:
        return await asyncio.gather(
            *(a.average([t]) for a, t in zip(averagers, tensors, strict=True))
        )

    try:
        weights = torch.randn(numel, generator=torch.Generator().manual_seed(7))
        tensors = [weights + e for e in steps(10, 1e-2)]
        first = await average(tensors)
        lone = [i for i, r in enumerate(first) if len(r.parts) < n]
        assert len(lone) == 1 and "kept local values" in first[lone[0]].reason, first
        kept = (tensors[lone[0]] != tensors[n - 1]).nonzero()
        assert 0 < kept.numel() < numel // 2, kept.numel()
        averagers[n - 1].faults.fault = Fault.NONE
        for t, d in zip(tensors, steps(20, 1e-3), strict=True):
            t.add_(d)
        second = await average(tensors)
        for result in second:
            assert result.averaged and len(result.parts) == n, result
            assert not [r for r in result.refusals if r.action == "accused"], result
        assert all(torch.equal(tensors[0], t) for t in tensors[1:])
        # the member still holds its kept range to the blatant bound: a liar there is refused
        averagers[n - 1].faults.fault = Fault.LYING_OWNER
        third = await average(tensors)
        liar = peers[n - 1].peer_id
        for result in third[: n - 1]:
            assert liar in {r.peer for r in result.refusals if r.action == "accused"}, result
        assert all(torch.isfinite(t).all() for t in tensors[: n - 1])
    finally:
        for a in averagers:
            await a.close()
        await asyncio.gather(*(p.close() for p in peers))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
async def test_round_tensors_stay_on_the_gpu_and_the_clip_runs_there() -> None:
    peers = await start_peers(3, 245)
    config = loopback_peers.fixed_group_config(3, "cuda", codec="int8")
    faults = [Fault.NONE, Fault.NONE, Fault.HUGE_VALUES]
    averagers = [Averager(p, config, fault=f) for p, f in zip(peers, faults, strict=True)]
    try:
        inputs = [honest_values(i, 50_000).cuda() for i in range(3)]
        # two tensors each: gathered into one flat GPU buffer, the averages written back there
        tensors = [[x[:20_000].clone(), x[20_000:].clone()] for x in inputs]
        results = await asyncio.gather(
            *(a.average(t) for a, t in zip(averagers, tensors, strict=True))
        )
        for result, pair in zip(results[:2], tensors[:2], strict=True):
            got = torch.cat(pair)
            assert result.averaged and all(t.is_cuda for t in pair) and torch.isfinite(got).all()
            assert honest_dev(got.cpu(), [x.cpu() for x in inputs[:2]]) <= HONEST_DEV_BOUND
            assert peers[2].peer_id in {r.peer for r in result.refusals}
        stagings = averagers[0].butterfly._stagings.values()
        assert stagings and all(s._flat is not None and s._flat.is_cuda for s in stagings)
    finally:
        for a in averagers:
            await a.close()
        await asyncio.gather(*(p.close() for p in peers))


async def test_values_in_agreement_up_to_rounding_accuse_no_honest_owner() -> None:
    """A round of values among members that already agree up to 1e-5 of their size (an anchor
    sync of a swarm in sync; after a few int8 rounds of the same values, the leftover rounding
    is that small and differs from part to part by several times). The median rule accused the
    owner of the part where they differed most (8e-5 against a median of 1e-5, 4 peers, 25M
    values, `benchmarks/allreduce.py`): averages that close to the own values are plausible
    whatever the other parts say. A blatant liar among such members is still accused."""
    n, numel = 4, 40_000
    peers = await start_peers(n, 230)
    config = loopback_peers.fixed_group_config(n, "synced", stall_timeout_min_s=STALL_FLOOR_S)
    averagers = [Averager(p, config) for p in peers]

    def members(seed: int) -> list[torch.Tensor]:
        weights = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
        tensors = []
        for i in range(n):
            noise = torch.randn(numel, generator=torch.Generator().manual_seed(seed + 1 + i))
            noise[-numel // 8 :] *= 8  # inside the last part, whatever the plan's rounding
            tensors.append(weights + 1e-5 * noise)
        return tensors

    async def average(tensors: list[torch.Tensor]) -> list[RoundResult]:
        return await asyncio.gather(
            *(a.average([t]) for a, t in zip(averagers, tensors, strict=True))
        )

    try:
        for result in await average(members(40)):
            assert result.averaged and len(result.parts) == n, result
            assert not [r for r in result.refusals if r.action == "accused"], result
        averagers[n - 1].faults.fault = Fault.LYING_OWNER
        results = await average(members(50))
        liar = peers[n - 1].peer_id
        for result in results[: n - 1]:
            assert liar in {r.peer for r in result.refusals if r.action == "accused"}, result
    finally:
        for a in averagers:
            await a.close()
        await asyncio.gather(*(p.close() for p in peers))


async def test_a_faulty_contribution_still_lands_the_average_in_tensors_read_in_place() -> None:
    """Tensors that lie end to end in one buffer (as the training slots do) are read and
    written in place; a contribution that is a tensor of its own (the tests' attackers, here a
    sign flip) must not take the averages with it: they land in the peer's own tensors."""
    peers = await start_peers(3, 248)
    config = loopback_peers.fixed_group_config(3, "in-place")
    faults = [Fault.NONE, Fault.NONE, Fault.SIGN_FLIP]
    averagers = [Averager(p, config, fault=f) for p, f in zip(peers, faults, strict=True)]
    try:
        buffers = [honest_values(i, 30_000) for i in range(3)]
        before = buffers[2].clone()
        views = [[b[:10_000].view(100, 100), b[10_000:]] for b in buffers]
        results = await asyncio.gather(
            *(a.average(v) for a, v in zip(averagers, views, strict=True))
        )
        assert all(r.averaged for r in results), results
        assert all(s._flat is None for s in averagers[2].butterfly._stagings.values())
        # where both honest peers applied one average, the faulty peer applied it too
        agreed = buffers[0] == buffers[1]
        assert agreed.sum() > 10_000 and not torch.equal(buffers[2], before)
        assert torch.equal(buffers[2][agreed], buffers[0][agreed])
    finally:
        for a in averagers:
            await a.close()
        await asyncio.gather(*(p.close() for p in peers))
