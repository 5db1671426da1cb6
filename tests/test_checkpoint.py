"""Checkpoints: safetensors round trip, export, tampering, and all-or-nothing restores."""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from swarm.config import SwarmConfig
from swarm.errors import CheckpointError, TrainingError
from swarm.training.checkpoint import OLD_MAGIC, export_model, read_checkpoint, write_checkpoint
from swarm.training.engine import TrainingEngine
from swarm.training.snapshot import pack_snapshot, unpack_snapshot


def engine(mode: str = "diloco", seed: int = 0) -> TrainingEngine:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    return TrainingEngine(model, opt, SwarmConfig.build(mode=mode, inner_steps=3, codec="none"))


def trained(mode: str = "diloco", steps: int = 4) -> TrainingEngine:
    e = engine(mode)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    for _ in range(steps):
        e.optimizer.zero_grad()
        torch.nn.functional.mse_loss(e.model(x), y).backward()
        e.count(len(x))
        e.inner_step()
    return e


def snapshot_of(e: TrainingEngine) -> dict[str, torch.Tensor]:
    """Copies of everything a restore writes: model and optimizer tensors, counters."""
    state = {f"model.{k}": v.clone() for k, v in e.model.state_dict().items()}
    for pid, entry in e.optimizer.state_dict()["state"].items():
        for k, v in entry.items():
            state[f"opt.{pid}.{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    counters = (e.round, e.step_count, e.steps_in_round, e.values_rounds)
    state["counters"] = counters  # type: ignore[assignment]
    return state


def assert_unchanged(before: dict, e: TrainingEngine) -> None:
    after = snapshot_of(e)
    assert before.keys() == after.keys()
    for k, v in before.items():
        assert torch.equal(v, after[k]) if isinstance(v, torch.Tensor) else v == after[k], k


def test_round_trip_restores_everything_and_safetensors_alone_reads_it(tmp_path) -> None:
    e = trained()
    path = tmp_path / "ckpt.safetensors"
    write_checkpoint(path, e.state_dict({"feedback": {"codec": "none", "sender": torch.ones(3)}}))
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    plain = load_file(path)  # no swarm code, no pickle
    assert torch.equal(plain["model.0.weight"], e.model[0].weight)
    assert "optimizer.state.0.exp_avg" in plain
    other = engine(seed=3)
    averager = other.load_state_dict(read_checkpoint(path))
    assert torch.equal(averager["feedback"]["sender"], torch.ones(3))
    assert (other.step_count, other.round, other.steps_in_round) == (4, 0, 4)
    for p, q in zip(e.model.state_dict().values(), other.model.state_dict().values(), strict=True):
        assert torch.equal(p, q)
    assert other.optimizer.state_dict()["param_groups"][0]["betas"] == (0.8, 0.95)
    mine, theirs = e.optimizer.state_dict()["state"], other.optimizer.state_dict()["state"]
    assert mine.keys() == theirs.keys()
    for pid in mine:
        for k, v in mine[pid].items():
            assert torch.equal(v, theirs[pid][k]), (pid, k)


def test_export_gives_a_plain_model_state_dict(tmp_path) -> None:
    e = trained()
    write_checkpoint(tmp_path / "c", e.state_dict(None))
    assert export_model(tmp_path / "c", tmp_path / "model.safetensors") == len(e.model.state_dict())
    fresh = engine(seed=9).model
    fresh.load_state_dict(load_file(tmp_path / "model.safetensors"))
    for p, q in zip(e.model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(p, q)


def test_tied_weights_are_saved(tmp_path) -> None:
    emb = torch.nn.Embedding(5, 3)
    head = torch.nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    model = torch.nn.Sequential(emb, head)
    e = TrainingEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), SwarmConfig.build())
    write_checkpoint(tmp_path / "c", e.state_dict(None))
    e.load_state_dict(read_checkpoint(tmp_path / "c"))


def test_tampered_truncated_and_foreign_files_are_refused(tmp_path) -> None:
    path = tmp_path / "c"
    write_checkpoint(path, trained().state_dict(None))
    good = path.read_bytes()
    for offset in (len(good) - 10, len(good) // 2):
        data = bytearray(good)
        data[offset] ^= 0x01
        path.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match=r"checksum|not a swarm|decoded"):
            read_checkpoint(path)
    # Edit the JSON state (a counter) without fixing the checksum.
    n = struct.unpack_from("<Q", good, 0)[0]
    header = json.loads(good[8 : 8 + n])
    header["__metadata__"]["swarm.state"] = header["__metadata__"]["swarm.state"].replace(
        '"step":4', '"step":9'
    )
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + good[8 + n :])
    with pytest.raises(CheckpointError, match="checksum"):
        read_checkpoint(path)
    for junk in (good[:5], good[: len(good) // 2], b"", b"\xff" * 64):
        path.write_bytes(junk)
        with pytest.raises(CheckpointError):
            read_checkpoint(path)
    with pytest.raises(CheckpointError, match="cannot read"):
        read_checkpoint(tmp_path / "missing")


@settings(max_examples=40, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_load(tmp_path_factory, data: bytes) -> None:
    path = tmp_path_factory.mktemp("junk") / "c"
    path.write_bytes(struct.pack("<Q", len(data)) + data)
    with pytest.raises(CheckpointError):
        read_checkpoint(path)


def test_old_format_is_refused_with_a_clear_message(tmp_path) -> None:
    path = tmp_path / "old.swarm"
    path.write_bytes(OLD_MAGIC + b"\0" * 32 + b"pickle bytes")
    with pytest.raises(CheckpointError, match="old pickle-based format"):
        read_checkpoint(path)


def test_bad_optimizer_part_with_a_correct_checksum_changes_nothing(tmp_path) -> None:
    state = trained().state_dict(None)
    state["optimizer"]["state"][1]["exp_avg"] = torch.zeros(3, 3)  # another shape
    write_checkpoint(tmp_path / "c", state)
    target = trained(steps=2)
    before = snapshot_of(target)
    with pytest.raises(CheckpointError, match=r"optimizer state 1\.exp_avg"):
        target.load_state_dict(read_checkpoint(tmp_path / "c"))
    assert_unchanged(before, target)

    state = trained().state_dict(None)
    state["optimizer"]["param_groups"][0]["params"] = [0, 1]  # fewer parameters
    write_checkpoint(tmp_path / "c", state)
    with pytest.raises(CheckpointError, match="group 0"):
        target.load_state_dict(read_checkpoint(tmp_path / "c"))
    assert_unchanged(before, target)


@pytest.mark.parametrize("part", ["model", "optimizer", "outer", "averager", "counter"])
def test_non_finite_values_are_refused_before_anything_is_written(tmp_path, part) -> None:
    state = trained().state_dict({"feedback": {"codec": "none", "sender": torch.ones(3)}})
    if part == "model":
        state["model"]["3.weight"][0, 2] = float("nan")
    elif part == "optimizer":
        state["optimizer"]["state"][2]["exp_avg_sq"][0] = float("inf")
    elif part == "outer":
        state["outer"]["momentum.3.bias"][0] = float("nan")
    elif part == "averager":
        state["averager"]["feedback"]["sender"][1] = float("-inf")
    else:
        state["round"] = -1
    write_checkpoint(tmp_path / "c", state)
    target = trained(steps=2)
    before = snapshot_of(target)
    with pytest.raises(CheckpointError):
        target.load_state_dict(read_checkpoint(tmp_path / "c"))
    assert_unchanged(before, target)


def test_the_finishing_rounds_count_survives_a_restart(tmp_path) -> None:
    """``average_parameters()`` numbers its rounds, and every peer's k-th round takes the same
    axis of the grid: a peer restarted from a checkpoint goes on from its count, not from 0."""
    e = trained()
    e.begin_values_round()
    e.begin_values_round()
    write_checkpoint(tmp_path / "c", e.state_dict(None))
    other = engine(seed=3)
    other.load_state_dict(read_checkpoint(tmp_path / "c"))
    assert other.values_rounds == 2 and other.begin_values_round().number == 2
    older = e.state_dict(None)
    del older["values_rounds"]  # a checkpoint written before the count was kept
    write_checkpoint(tmp_path / "old", older)
    other.load_state_dict(read_checkpoint(tmp_path / "old"))
    assert other.values_rounds == 0
    for bad in (-1, 2.5, "2", True, 2**41):
        state = e.state_dict(None)
        state["values_rounds"] = bad
        write_checkpoint(tmp_path / "bad", state)
        before = snapshot_of(other)
        with pytest.raises(CheckpointError, match="values_rounds"):
            other.load_state_dict(read_checkpoint(tmp_path / "bad"))
        assert_unchanged(before, other)


def test_checkpoint_of_another_model_or_mode_is_refused(tmp_path) -> None:
    path = tmp_path / "ckpt"
    write_checkpoint(path, engine("diloco").state_dict(None))
    with pytest.raises(CheckpointError, match="mode"):
        engine("local_sgd").load_state_dict(read_checkpoint(path))
    model = torch.nn.Linear(3, 3)
    other = TrainingEngine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), SwarmConfig.build(codec="none")
    )
    with pytest.raises(CheckpointError, match="another model"):
        other.load_state_dict(read_checkpoint(path))


def test_non_finite_snapshot_is_refused() -> None:
    e = engine("local_sgd")
    named = [(n, t.detach().clone()) for n, t in zip(e.tensors.names, e.tensors.all, strict=True)]
    names = [n for n, _ in e.snapshot_layout()]
    named = list(zip(names, [t for _, t in named], strict=True))
    data = pack_snapshot(3, e.schema, "local_sgd", named)
    assert unpack_snapshot(data, schema=e.schema, expected=e.snapshot_layout()).round == 3
    named[1][1][0] = float("nan")
    data = pack_snapshot(3, e.schema, "local_sgd", named)
    with pytest.raises(TrainingError, match="not finite"):
        unpack_snapshot(data, schema=e.schema, expected=e.snapshot_layout())


def test_swarm_peer_export_command(tmp_path) -> None:
    e = trained()
    write_checkpoint(tmp_path / "c", e.state_dict(None))
    out = tmp_path / "model.safetensors"
    done = subprocess.run(
        [sys.executable, "-m", "swarm.cli", "export", str(tmp_path / "c"), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"wrote {len(e.model.state_dict())} tensors" in done.stdout
    assert torch.equal(load_file(out)["3.bias"], e.model[3].bias)
    (tmp_path / "bad").write_bytes(OLD_MAGIC + b"x" * 40)
    done = subprocess.run(
        [sys.executable, "-m", "swarm.cli", "export", str(tmp_path / "bad"), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "old pickle-based format" in done.stderr and "Traceback" not in done.stderr


def _plain_and_nesterov() -> tuple[TrainingEngine, TrainingEngine]:
    """A ``sparse`` DiLoCo engine (plain outer step, no momentum) after an inner step, and an
    ``int8`` one of the same model (Nesterov) with a momentum of ones."""
    engines = []
    for codec in ("sparse", "int8"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engines.append(TrainingEngine(model, opt, SwarmConfig.build(codec=codec, inner_steps=3)))
    plain, nesterov = engines
    for m in nesterov.outer.momentum:
        m.fill_(1.0)
    plain.model(torch.randn(8, 4)).pow(2).mean().backward()
    plain.count(8)
    plain.inner_step()
    return plain, nesterov


def test_a_plain_step_keeps_no_momentum_and_its_checkpoints_cross_codecs(tmp_path, caplog) -> None:
    """A sparse DiLoCo peer keeps and saves no outer momentum (one fp32 vector of the model
    less); a peer that keeps one restores its checkpoint with zero momentum, and the other way
    round the saved momentum is ignored. A checkpoint missing only part of it is refused."""
    plain, nesterov = _plain_and_nesterov()
    assert plain.outer.momentum == [] and len(nesterov.outer.momentum) == 4
    state = plain.state_dict(None)
    assert not any(k.startswith("momentum.") for k in state["outer"]), list(state["outer"])
    write_checkpoint(tmp_path / "plain", state)
    with caplog.at_level(logging.INFO, logger="swarm.training.outer"):
        nesterov.load_state_dict(read_checkpoint(tmp_path / "plain"))
    assert all(not m.any() for m in nesterov.outer.momentum)
    assert "no outer momentum" in caplog.text
    for a, b in zip(nesterov.outer.anchor, plain.outer.anchor, strict=True):
        assert torch.equal(a, b)
    for m in nesterov.outer.momentum:
        m.fill_(2.0)
    full = nesterov.state_dict(None)
    write_checkpoint(tmp_path / "nesterov", full)
    plain.load_state_dict(read_checkpoint(tmp_path / "nesterov"))
    assert plain.outer.momentum == []
    del full["outer"][next(k for k in full["outer"] if k.startswith("momentum."))]
    write_checkpoint(tmp_path / "partial", full)
    before = snapshot_of(nesterov)
    with pytest.raises(CheckpointError, match="momentum"):
        nesterov.load_state_dict(read_checkpoint(tmp_path / "partial"))
    assert_unchanged(before, nesterov)
    assert all(bool((m == 2.0).all()) for m in nesterov.outer.momentum)


def test_a_plain_step_serves_joiners_zero_momentum_in_the_one_snapshot_layout() -> None:
    """Joiners get one layout whatever the codec: a sparse provider's momentum is zero, and a
    sparse joiner of a Nesterov provider takes the model and leaves the momentum."""
    plain, nesterov = _plain_and_nesterov()
    assert plain.snapshot_layout() == nesterov.snapshot_layout()
    _, blob = plain.snapshot()
    snap = unpack_snapshot(blob, schema=nesterov.schema, expected=nesterov.snapshot_layout())
    nesterov.load_snapshot(snap, steps_in_round=0)
    assert all(not m.any() for m in nesterov.outer.momentum)
    for a, b in zip(nesterov.outer.anchor, plain.outer.anchor, strict=True):
        assert torch.equal(a, b)
    for m in nesterov.outer.momentum:
        m.fill_(1.0)
    _, blob = nesterov.snapshot()
    plain.load_snapshot(
        unpack_snapshot(blob, schema=plain.schema, expected=plain.snapshot_layout()), 0
    )
    assert plain.outer.momentum == []
