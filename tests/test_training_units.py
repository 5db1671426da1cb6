"""Training layer without the network: outer step, engine modes, snapshots, checkpoints, shards."""

from __future__ import annotations

import asyncio
import itertools
import logging
import struct

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.api import outcome_of
from swarm.averaging.result import RoundResult
from swarm.config import (
    DENSE_ANCHOR_SYNC_EVERY,
    SPARSE_ANCHOR_SYNC_EVERY,
    Mode,
    PeerConfig,
    SwarmConfig,
)
from swarm.errors import ConfigError, TrainingError
from swarm.identity import Identity
from swarm.training.checkpoint import read_checkpoint, write_checkpoint
from swarm.training.driver import arun_step, run_step
from swarm.training.engine import TrainingEngine
from swarm.training.outer_rule import outer_step
from swarm.training.report import FAILED_ROUNDS_TO_WARN, RoundFailures
from swarm.training.rounds import RoundOutcome, RoundPlan
from swarm.training.sharding import assign_shards, shard_indices
from swarm.training.snapshot import snapshot_size, unpack_snapshot
from swarm.training.transfer import split_parts


def bn_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
    )


def engine(
    mode: str = "diloco", seed: int = 0, codec_override: str = "none", **kw: object
) -> TrainingEngine:
    model = bn_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    config = SwarmConfig.build(mode=mode, inner_steps=3, codec=codec_override, **kw)
    return TrainingEngine(model, opt, config)


def local_average(engines: list[TrainingEngine], weights: list[float]) -> RoundOutcome:
    """Weighted mean of the engines' round buffers, in place (what a group all-reduce does)."""
    total = sum(weights)
    for parts in zip(*(e.outer.slots for e in engines), strict=True):
        mean = sum(w * t for w, t in zip(weights, parts, strict=True)) / total
        for t in parts:
            t.copy_(mean)
    return RoundOutcome(True, len(engines), 0, 0)


def train_steps(e: TrainingEngine, x: torch.Tensor, y: torch.Tensor) -> bool:
    e.optimizer.zero_grad()
    torch.nn.functional.mse_loss(e.model(x), y).backward()
    due = e.count(len(x))
    e.inner_step()
    return due


def test_outer_step_is_torch_nesterov_sgd() -> None:
    torch.manual_seed(1)
    anchor, momentum = [torch.randn(7, 3)], [torch.zeros(7, 3)]
    p = torch.nn.Parameter(anchor[0].clone())
    reference = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(5):
        g = torch.randn(7, 3)
        p.grad = g.clone()
        reference.step()
        outer_step(anchor, [g.clone()], momentum, lr=0.7, beta=0.9)
    torch.testing.assert_close(anchor[0], p.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["diloco", "local_sgd", "gradients"])
def test_two_engines_agree_after_a_round_including_batchnorm(mode: str) -> None:
    engines = [engine(mode, seed=s) for s in (0, 1)]
    # Start from one model, as a joiner would after downloading the state.
    engines[1].model.load_state_dict(engines[0].model.state_dict())
    for e in engines:
        e.outer.reset_anchor()
    torch.manual_seed(5)
    data = [(torch.randn(16, 4), torch.randn(16, 1)) for _ in engines]
    reports = []
    for _ in range(3):
        for e, (x, y) in zip(engines, data, strict=True):
            if mode == "gradients":
                e.optimizer.zero_grad()
                torch.nn.functional.mse_loss(e.model(x), y).backward()
                e.count(len(x))
            else:
                train_steps(e, x, y)
    plans = [e.begin_round() for e in engines]
    outcome = local_average(engines, [p.weight for p in plans])
    for e, plan in zip(engines, plans, strict=True):
        reports.append(e.finish_round(plan, outcome))
        if mode == "gradients":
            e.inner_step()
    a, b = (dict(e.model.state_dict()) for e in engines)
    for key in a:
        if a[key].is_floating_point():
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6, msg=key)
    assert all(r.averaged and r.round == 1 and r.group_size == 2 for r in reports)


@pytest.mark.parametrize("mode", list(Mode))
def test_step_asks_for_a_round_exactly_when_one_is_due(mode: Mode) -> None:
    e = engine(mode)
    torch.manual_seed(3)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    asked: list[int] = []

    def run_round(plan: RoundPlan) -> RoundOutcome:
        asked.append(e.step_count)
        if mode.averages_gradients:
            # the round comes before optimizer.step(): the model is still the one of the last step
            for p, q in zip(e.model.parameters(), before, strict=True):
                assert torch.equal(p, q)
        return RoundOutcome(False, 0, 0, 0, "alone")

    reports = []
    for _ in range(6):
        e.optimizer.zero_grad()
        torch.nn.functional.mse_loss(e.model(x), y).backward()
        before = [p.detach().clone() for p in e.model.parameters()]
        reports.append(run_step(e.step(len(x)), run_round))
    due = [1, 2, 3, 4, 5, 6] if mode.averages_gradients else [3, 6]
    assert asked == due
    assert [r.step for r in reports if r.round_due] == due
    assert [r.round for r in reports] == [sum(d <= s for d in due) for s in range(1, 7)]
    assert all(r.reason == "alone" for r in reports if r.round_due)


@pytest.mark.parametrize("mode", list(Mode))
def test_sync_and_async_steps_are_one_sequence(mode: Mode) -> None:
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    sync_engine, async_engine = engine(mode), engine(mode)

    def solo(plan: RoundPlan) -> RoundOutcome:
        return RoundOutcome(False, 0, 0, 0, "alone")

    async def asolo(plan: RoundPlan) -> RoundOutcome:
        return solo(plan)

    async def async_steps() -> list[bool]:
        due = []
        for _ in range(4):
            async_engine.optimizer.zero_grad()
            torch.nn.functional.mse_loss(async_engine.model(x), y).backward()
            due.append((await arun_step(async_engine.step(len(x)), asolo)).round_due)
        return due

    sync_due = []
    for _ in range(4):
        sync_engine.optimizer.zero_grad()
        torch.nn.functional.mse_loss(sync_engine.model(x), y).backward()
        sync_due.append(run_step(sync_engine.step(len(x)), solo).round_due)
    assert asyncio.run(async_steps()) == sync_due
    for p, q in zip(sync_engine.model.parameters(), async_engine.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_mode_is_an_enum_that_reads_as_its_text() -> None:
    assert SwarmConfig.build(mode="local_sgd").mode is Mode.LOCAL_SGD
    assert SwarmConfig.build(mode=Mode.GRADIENTS).inner_steps == 1
    assert Mode.DILOCO == "diloco" and str(Mode.DILOCO) == "diloco" and f"{Mode.DILOCO}" == "diloco"
    with pytest.raises(ConfigError, match="use one of diloco, local_sgd, gradients"):
        SwarmConfig.build(mode="fedavg")
    state = engine("local_sgd").state_dict(None)
    assert type(state["mode"]) is str and state["mode"] == "local_sgd"


def test_outcome_of_reads_a_round_result_by_its_fields() -> None:
    members = tuple(Identity.generate().peer_id for _ in range(3))
    done = outcome_of(RoundResult(True, members=members, bytes_sent=10, bytes_received=20))
    assert done == RoundOutcome(True, 3, 10, 20, "")
    failed = outcome_of(RoundResult(False, reason="no group", members=members, bytes_sent=5))
    assert failed == RoundOutcome(False, 0, 5, 0, "no group")
    assert outcome_of(RoundResult(False)).reason == "not averaged"
    assert outcome_of(RoundResult(True, members=members, synced=True)).synced  # anchors too


def test_failed_diloco_round_is_plain_local_training() -> None:
    e = engine("diloco")
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    for m in e.outer.momentum:
        m.fill_(1.0)  # left over from earlier averaged rounds
    while not train_steps(e, x, y):
        pass
    before = [p.detach().clone() for p in e.model.parameters()]
    plan = e.begin_round()
    plan.tensors[0].fill_(float("nan"))  # a cut round left garbage behind
    report = e.finish_round(plan, RoundOutcome(False, 0, 0, 0, "no partners"))
    assert not report.averaged and report.reason == "no partners" and report.round == 1
    for p, q, a in zip(e.model.parameters(), before, e.outer.anchor, strict=True):
        # Alone: no outer step at all; the anchor follows the local model.
        assert torch.equal(p.detach(), q) and torch.equal(a, q)
    # The stale momentum fades without being applied.
    assert all(torch.allclose(m, torch.full_like(m, 0.9)) for m in e.outer.momentum)


def test_snapshot_round_trip_and_load() -> None:
    src, dst = engine("diloco", seed=0), engine("diloco", seed=1)
    src.outer.momentum[0].fill_(0.5)
    src.round = 7
    round_, blob = src.snapshot()
    snap = unpack_snapshot(bytearray(blob), schema=dst.schema, expected=dst.snapshot_layout())
    dst.load_snapshot(snap, steps_in_round=2)
    assert round_ == dst.round == 7 and dst.steps_in_round == 2
    for p, q in zip(src.outer.anchor, dst.model.parameters(), strict=True):
        torch.testing.assert_close(p, q.detach())
    assert torch.equal(dst.outer.momentum[0], src.outer.momentum[0])
    assert len(blob) <= snapshot_size(dst.snapshot_layout(), schema=dst.schema, mode="diloco")


def _blob() -> tuple[TrainingEngine, bytes]:
    e = engine("diloco")
    return e, e.snapshot()[1]


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b[:5],
        lambda b: b[:-4],
        lambda b: b + b"\0" * 4,
        lambda b: b"XXSNAP" + b[6:],
        lambda b: b[:6] + struct.pack("<H", 9) + b[8:],
        lambda b: b[:8] + struct.pack("<I", 2**31) + b[12:],
        lambda b: b[:12] + b"\xc1" + b[13:],
    ],
    ids=["short", "truncated", "extended", "magic", "version", "header-len", "junk-msgpack"],
)
def test_hostile_snapshots_are_refused(mutate) -> None:
    e, blob = _blob()
    with pytest.raises(TrainingError):
        unpack_snapshot(bytearray(mutate(blob)), schema=e.schema, expected=e.snapshot_layout())


@pytest.mark.parametrize(
    "header",
    [
        {"round": -1, "schema": "S", "mode": "diloco", "tensors": []},
        {"round": "1", "schema": "S", "mode": "diloco", "tensors": []},
        {"round": 1, "schema": "other", "mode": "diloco", "tensors": []},
        {"round": 1, "schema": "S", "mode": "diloco", "tensors": [["model.0.weight", 2**40]]},
        [1, 2, 3],
    ],
)
def test_hostile_snapshot_headers_are_refused(header) -> None:
    e = engine("diloco")
    if isinstance(header, dict) and header.get("schema") == "S":
        header["schema"] = e.schema
    raw = msgpack.packb(header)
    data = b"SWSNAP" + struct.pack("<HI", 1, len(raw)) + raw + b"\0" * 64
    with pytest.raises(TrainingError):
        unpack_snapshot(bytearray(data), schema=e.schema, expected=e.snapshot_layout())


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_never_parse_as_a_snapshot(data: bytes) -> None:
    e = engine("local_sgd")
    with pytest.raises(TrainingError):
        unpack_snapshot(data, schema=e.schema, expected=e.snapshot_layout())


def test_shards_are_disjoint_cover_everything_and_move_little() -> None:
    peers = [bytes([i]) * 32 for i in range(5)]
    owners = assign_shards(peers, 64, salt="run")
    all_shards = sorted(s for shards in owners.values() for s in shards)
    assert all_shards == list(range(64))
    fewer = assign_shards(peers[:4], 64, salt="run")
    moved = sum(1 for p in peers[:4] for s in owners[p] if s not in fewer[p])
    assert moved == 0  # survivors keep their shards; only the leaver's are redistributed
    idx = [shard_indices(1000, owners[p], 64) for p in peers]
    assert sorted(i for part in idx for i in part) == list(range(1000))


def test_split_parts_covers_the_range() -> None:
    for size in (0, 1, 5 << 20, (64 << 20) + 3):
        parts = split_parts(size, 3)
        assert sum(n for _, n in parts) == size
        assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(parts))


def test_config_validation() -> None:
    assert SwarmConfig.build(mode="gradients", inner_steps=50).inner_steps == 1
    for bad in (
        {"mode": "ddp"},
        {"inner_steps": 0},
        {"outer_momentum": 1.0},
        {"min_group_size": 1},
        {"round_timeout_s": 1.0, "matchmaking_timeout_s": 2.0},
        {"anchor_sync_every": -1},
        {"anchor_sync_every": 2.5},
        {"anchor_sync_codec": "sparse"},  # raw weights need a dense codec
        {"anchor_sync_codec": "1bit"},
        {"anchor_sync_codec": "nope"},
    ):
        with pytest.raises(ConfigError):
            SwarmConfig.build(**bad)
    with pytest.raises(ConfigError):
        SwarmConfig.build(peer="x")  # type: ignore[arg-type]
    assert SwarmConfig.build(peer=PeerConfig(run_id="r")).peer.run_id == "r"


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_half_precision_models_keep_fp32_master_state(dtype: torch.dtype, device: str) -> None:
    engines = []
    for _ in range(2):
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
        model.load_state_dict(bn_free_state(0))  # one start, as after joining
        model = model.to(device=device, dtype=dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        engines.append(TrainingEngine(model, opt, SwarmConfig.build(inner_steps=2, codec="none")))
    for e in engines:
        assert all(a.dtype == torch.float32 and a.device.type == device for a in e.outer.anchor)
        for _ in range(2):
            x = torch.randn(8, 4, device=device, dtype=dtype)
            e.model(x).float().pow(2).mean().backward()
            e.count(8)
            e.inner_step()
            e.optimizer.zero_grad()
    plans = [e.begin_round() for e in engines]
    assert all(t.dtype == torch.float32 and t.device.type == device for t in plans[0].tensors)
    outcome = local_average(engines, [p.weight for p in plans])
    for e, plan in zip(engines, plans, strict=True):
        e.finish_round(plan, outcome)
    for p, q in zip(engines[0].model.parameters(), engines[1].model.parameters(), strict=True):
        assert p.dtype == dtype and p.device.type == device
        assert torch.equal(p, q)
    torch.testing.assert_close(engines[0].outer.anchor[0], engines[1].outer.anchor[0])


def bn_free_state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)).state_dict()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_round_snapshot_and_checkpoint(tmp_path) -> None:
    model = bn_model(0).cuda()
    e = TrainingEngine(
        model, torch.optim.AdamW(model.parameters()), SwarmConfig.build(inner_steps=2, codec="none")
    )
    for _ in range(2):
        e.model(torch.randn(16, 4, device="cuda")).pow(2).mean().backward()
        e.count(16)
        e.inner_step()
    plan = e.begin_round()
    assert all(t.is_cuda for t in plan.tensors + e.outer.anchor + e.outer.momentum)
    e.finish_round(plan, RoundOutcome(False, 0, 0, 0, "alone"))
    _, blob = e.snapshot()
    other = TrainingEngine(
        bn_model(1).cuda(),
        torch.optim.AdamW(model.parameters()),
        SwarmConfig.build(inner_steps=2, codec="none"),
    )
    other.load_snapshot(
        unpack_snapshot(bytearray(blob), schema=other.schema, expected=other.snapshot_layout()), 0
    )
    for p, q in zip(e.outer.anchor, other.model.parameters(), strict=True):
        assert q.is_cuda and torch.equal(p, q)
    write_checkpoint(tmp_path / "c", e.state_dict(None))
    other.load_state_dict(read_checkpoint(tmp_path / "c"))
    assert all(p.is_cuda for p in other.model.parameters())


def test_sparse_codecs_keep_batchnorm_buffers_local() -> None:
    dense, sparse = engine("diloco"), engine("diloco", codec_override="1bit")
    assert dense.tensors.buffer_names == ("1.running_mean", "1.running_var")
    assert sparse.tensors.buffer_names == ()
    assert len(sparse.outer.slots) == len(sparse.tensors.params)


@pytest.mark.parametrize(
    ("kw", "every", "codec"),
    [
        ({}, DENSE_ANCHOR_SYNC_EVERY, "int8"),
        ({"anchor_sync_every": 0}, 0, ""),
        (
            {"overlap": True},
            DENSE_ANCHOR_SYNC_EVERY,
            "int8",
        ),  # the step hands the launch copies instead (test_overlap)
        ({"codec": "fp16", "anchor_sync_every": 2}, 2, "fp16"),
        # sparse codecs: rarely, and in a dense codec (top-K or 1-bit would ruin raw weights)
        ({"codec": "topk:0.1"}, SPARSE_ANCHOR_SYNC_EVERY, "int8"),
        ({"codec": "sparse", "anchor_sync_codec": "bf16"}, SPARSE_ANCHOR_SYNC_EVERY, "bf16"),
        ({"mode": "local_sgd"}, 0, ""),
    ],
)
def test_rounds_offer_the_anchors_to_sync_in_a_dense_codec(kw: dict, every: int, codec: str):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    e = TrainingEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), SwarmConfig.build(**kw))
    plan = e.begin_round()
    if every:
        assert plan.sync_every == every and plan.sync is not None and plan.sync_codec == codec
        assert [t.data_ptr() for t in plan.sync] == [a.data_ptr() for a in e.outer.anchor]
    else:
        assert plan.sync is None


def test_a_round_that_fails_now_and_then_is_no_warning_but_a_peer_alone_is(caplog) -> None:
    """Honest swarms fail a round now and then (a planned member went elsewhere): INFO. Rounds
    failing in a row are a peer training alone: one WARNING, then INFO when it averages again."""
    caplog.set_level(logging.DEBUG, logger="swarm.training.report")
    failures = RoundFailures()

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    failures.log(1, False, 0, "no planned member came")
    failures.log(2, True, 4, "")
    failures.log(3, False, 0, "no planned member came")
    assert warnings() == [] and "round 3 not averaged" in caplog.text
    for rnd in range(4, 4 + FAILED_ROUNDS_TO_WARN + 3):
        failures.log(rnd, False, 0, "no group formed")
    last = 2 + FAILED_ROUNDS_TO_WARN  # the streak began at round 3
    assert warnings() == [
        f"rounds 3-{last} not averaged (the last: no group formed); training on alone"
    ], warnings()
    failures.log(20, True, 3, "")
    assert "round 20 averaged with 2 peers after" in caplog.text
    for rnd in range(21, 21 + FAILED_ROUNDS_TO_WARN):
        failures.log(rnd, False, 0, "no group formed")
    assert len(warnings()) == 2, warnings()
