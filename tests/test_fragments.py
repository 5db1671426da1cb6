"""Streaming DiLoCo's fragments: the cut, the configuration, rounds that take turns over
fragments (blocking and overlapped), the loss they reach, and checkpoints of fragmented peers."""

from __future__ import annotations

import itertools

import pytest
import torch
from held_rounds import Rounds, backward, no_blocking_round
from lockstep import Lockstep, lockstep_loss

from swarm.config import SwarmConfig
from swarm.errors import ConfigError, TrainingError
from swarm.training.checkpoint import read_checkpoint, write_checkpoint
from swarm.training.driver import run_step
from swarm.training.engine import TrainingEngine
from swarm.training.fragments import split
from swarm.training.rounds import RoundOutcome, RoundPlan
from swarm.training.tensors import ModelTensors


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    # parameters 32+8, 8+8, 8+1 elements; floating buffers 8+8 (BatchNorm)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    )


def engine(fragments: int, overlap: bool, seed: int = 0, inner: int | str = 4) -> TrainingEngine:
    m = model(seed)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    config = SwarmConfig.build(
        inner_steps=inner, codec="none", overlap=overlap, fragments=fragments, anchor_sync_every=0
    )
    return TrainingEngine(m, opt, config)


def test_fragments_are_diloco_only_and_divide_the_inner_steps() -> None:
    assert (
        SwarmConfig.build().fragments == 1
        and SwarmConfig.build(inner_steps=12).round_interval == 12
    )
    assert SwarmConfig.build(inner_steps=12, fragments=3).round_interval == 4
    with pytest.raises(ConfigError, match="multiple of fragments"):
        SwarmConfig.build(inner_steps=10, fragments=3)
    with pytest.raises(ConfigError, match="only mode='diloco'"):
        SwarmConfig.build(mode="local_sgd", inner_steps=4, fragments=2)
    with pytest.raises(ConfigError, match="only mode='diloco'"):
        SwarmConfig.build(mode="gradients", fragments=2)
    for bad in (0, -1, 2.0, True, "2"):
        with pytest.raises(ConfigError, match="fragments must be an integer"):
            SwarmConfig.build(inner_steps=4, fragments=bad)  # type: ignore[arg-type]


def _covered(tensors: ModelTensors, cut: list) -> list[tuple[int, int]]:
    """The global element ranges of the fragments' pieces, in order."""
    starts = [sum(t.numel() for t in tensors.all[:i]) for i in range(len(tensors.all))]
    return [(starts[i] + s, starts[i] + e) for f in cut for i, s, e in f.pieces]


def test_the_cut_is_runs_of_equal_length_in_the_models_order() -> None:
    tensors = ModelTensors.of(model())
    total = tensors.numel  # 32, 8, 8, 8, 8, 1 | 8, 8 = 81
    for count in range(1, total + 1):
        cut = split(tensors, count)
        assert [f.index for f in cut] == list(range(count))
        ranges = _covered(tensors, cut)
        assert ranges[0][0] == 0 and ranges[-1][1] == total
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))  # in order
        sizes = [f.numel for f in cut]
        assert sum(sizes) == total and max(sizes) - min(sizes) <= 1, (count, sizes)
        assert split(tensors, count) == cut  # a pure function: every peer cuts the same way
    halves = split(tensors, 2)
    assert [f.numel for f in halves] == [40, 41] and [f.label for f in halves] == ["1/2", "2/2"]
    assert halves[0].pieces == ((0, 0, 32), (1, 0, 8))
    assert split(tensors, 1)[0].label == ""
    thirds = split(tensors, 3)  # 27 elements each: the first cut falls inside the weight
    assert thirds[0].pieces == ((0, 0, 27),) and thirds[1].pieces[0] == (0, 27, 32)
    with pytest.raises(TrainingError, match="cannot cut 81 elements in 8 tensors into 82"):
        split(tensors, 82)
    with pytest.raises(TrainingError, match="cannot cut"):
        engine(fragments=82, overlap=False, inner=82)


def test_a_non_contiguous_tensor_is_never_cut() -> None:
    m = model()
    m[0].weight = torch.nn.Parameter(torch.randn(4, 8).t())  # 8x4, not contiguous
    tensors = ModelTensors.of(m)
    assert not tensors.all[0].is_contiguous()
    for count in (2, 3):
        for f in split(tensors, count):
            assert all(i != 0 or (s, e) == (0, 32) for i, s, e in f.pieces), f.pieces
    e = TrainingEngine(
        m, torch.optim.SGD(m.parameters(), lr=0.05), SwarmConfig.build(inner_steps=3, fragments=3)
    )
    assert e.fragments[0].pieces == ((0, 0, 32),)  # 27 was the cut: it moved to the end
    assert e._outers[0].tensors.params[0].shape == (8, 4)  # whole: its own shape


def _states(e: TrainingEngine, fragment: int) -> list[torch.Tensor]:
    outer = e._outers[fragment]
    return [t.clone() for t in outer.anchor + outer.momentum + outer.buffer_anchor]


def _unchanged(before: list[torch.Tensor], after: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_blocking_rounds_take_turns_and_each_moves_its_own_fragment_only() -> None:
    e = engine(fragments=2, overlap=False)
    plans: list[RoundPlan] = []

    def run_round(plan: RoundPlan) -> RoundOutcome:
        plans.append(plan)
        for t in plan.tensors:
            t.mul_(2.0)  # an "average" unlike this peer's own pseudo-gradient
        return RoundOutcome(True, 2, 0, 0)

    for step in range(1, 9):
        turn = e.fragment
        others = _states(e, 1 - turn)
        backward(e, step)
        report = run_step(e.step(16), run_round)
        assert report.round_due == (step % 2 == 0), step  # a round every 4 / 2 steps
        if report.round_due:
            assert report.averaged and e.round == step // 2
            assert _unchanged(others, _states(e, 1 - turn))  # the other fragment kept its state
            assert not _unchanged(_states(engine(2, False), turn), _states(e, turn))
    assert [p.fragment for p in plans] == ["1/2", "2/2"] * 2
    numel = [sum(t.numel() for t in p.tensors) for p in plans[:2]]
    assert numel == [40, 41] and sum(numel) == e.tensors.numel
    # a fragment's pseudo-gradient spans its whole inner loop: 4 steps since its last round
    assert [p.weight for p in plans] == [32.0] * 4


def test_rounds_on_the_wall_clock_take_the_fragment_of_their_instant() -> None:
    """On the clock a round averages fragment (clock order mod F), whatever this peer's count:
    peers whose counts differ by one (a round deferred across an instant) average the same
    fragment, so they still group. By count, they would never group again."""
    e = engine(fragments=2, overlap=False, inner="600s")  # instants 300 s apart
    for lag in (1, 2, 3):
        order = e.cadence.clock_order()
        e.round = order + lag  # a count apart from the clock's, by one or more
        backward(e, lag)
        e.count(16)
        plan = e.begin_round()
        assert plan.order == order, "an instant passed (300 s apart): run again"
        assert plan.fragment == e.fragments[order % 2].label, (lag, plan)
        assert e.fragment == order % 2  # frozen till the round ends
        e.finish_round(plan, RoundOutcome(True, 2, 0, 0))
        assert e.fragment == order % 2  # the next round's, at the same instant


def test_overlapped_rounds_of_fragments_land_on_the_fragment_they_started_with() -> None:
    """Two peers, two fragments, rounds landing only when the next fragment's round is due:
    after each landing the landed fragment's anchor and momentum agree across the peers."""
    engines = [engine(2, True, seed=0), engine(2, True, seed=0)]
    drivers = [Rounds(), Rounds()]
    landed = 0
    for step in range(1, 13):
        if drivers[0].started and not drivers[0].started[-1][1].done():
            plans = [d.started[-1][0] for d in drivers]
            mean = [(a + b) / 2 for a, b in zip(*(p.tensors for p in plans), strict=True)]
            for d in drivers:  # the round lands when a step waits for it: the next due one
                d.on_wait = lambda d=d, mean=mean: d.finish(mean)
        for k, (e, d) in enumerate(zip(engines, drivers, strict=True)):
            backward(e, 100 * k + step)
            run_step(e.step(16), no_blocking_round, d.start)
        if step % 2 == 0 and step > 2:  # each due round waited for the last and launched
            landed += 1
            fragment = (landed - 1) % 2
            first, second = (_states(e, fragment) for e in engines)
            for a, b in zip(first, second, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
            assert all(e.round == landed and e.in_flight for e in engines)
    assert [p.fragment for p, _ in drivers[0].started] == ["1/2", "2/2"] * 3
    assert drivers[0].waits == 5  # every round but the last was waited for by the next


def test_streaming_rounds_reach_whole_model_diloco_loss() -> None:
    """4 peers, 2 fragments taking turns every 5 of 10 inner steps, overlapped (landing 3 steps
    late, or when the next round is due): within 10% of whole-model blocking DiLoCo at the same
    steps (measured 1.08x and 0.91x); blocking, within 2x (measured 1.62x). Before the outer
    momentum restarted (swarm.training.outer_rule), whole-model blocking ended 2.8x higher (4.0e-4)
    and the fragments at 0.91x-0.94x of it: each fragment restarts its own momentum, and
    blocking fragments gained less from that (3.6e-4 -> 2.3e-4) than the whole model. With the
    landing's fixed half share (before ``landing_share``) the overlapped fragments ended at
    0.96x: in one group of the whole swarm the error each peer keeps helped here, and in
    groups of 4 among 16 peers it cost 1.2-5x (see test_overlap)."""
    blocking = lockstep_loss(overlap=False, delay=0)
    assert lockstep_loss(overlap=False, delay=0, swarm=Lockstep(fragments=2)) <= 2 * blocking
    for delay in (3, 5):
        loss = lockstep_loss(overlap=True, delay=delay, swarm=Lockstep(fragments=2))
        assert loss <= 1.10 * blocking, (delay, loss, blocking)


def test_a_checkpoint_of_a_fragmented_peer_resumes_at_the_same_fragment(tmp_path) -> None:
    e = engine(fragments=2, overlap=False)
    for step in range(1, 8):  # 3 rounds and a step: fragment 2/2 is next
        backward(e, step)
        run_step(e.step(16), lambda plan: RoundOutcome(True, 2, 0, 0))
    write_checkpoint(tmp_path / "c.pt", e.state_dict({"feedback": None}))
    resumed = engine(fragments=2, overlap=False, seed=3)
    resumed.load_state_dict(read_checkpoint(tmp_path / "c.pt"))
    assert (resumed.round, resumed.fragment, resumed.steps_in_round) == (3, 1, 1)
    saved, restored = (_states(x, 0) + _states(x, 1) for x in (e, resumed))
    assert all(torch.equal(a, b) for a, b in zip(saved, restored, strict=True))
    backward(resumed, 8)
    plans: list[RoundPlan] = []
    run_step(resumed.step(16), lambda plan: plans.append(plan) or RoundOutcome(False, 0, 0, 0))
    assert [p.fragment for p in plans] == ["2/2"]
