"""Round counters from a file or a peer are bounded: past 2^40 a claim is refused, never loaded.

(msgpack carries integers up to 2^64, so a snapshot or a manifest cannot even say 2^70; the
largest it can say is refused here, and a manifest past 2^40 in test_joiner_agreement.py.)
"""

from __future__ import annotations

import pytest
import torch

from swarm.api import AsyncSwarm
from swarm.config import SwarmConfig
from swarm.errors import CheckpointError, TrainingError
from swarm.training.checkpoint import read_checkpoint, write_checkpoint
from swarm.training.engine import TrainingEngine
from swarm.training.snapshot import MAX_ROUND, pack_snapshot, unpack_snapshot

CONFIG = {"mode": "diloco", "inner_steps": 2, "codec": "none"}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def engine() -> TrainingEngine:
    m = model()
    return TrainingEngine(m, torch.optim.SGD(m.parameters(), lr=0.1), SwarmConfig.build(**CONFIG))


def checkpoint_claiming(tmp_path, **counters: int):
    state = engine().state_dict({})
    state.update(counters)
    path = tmp_path / "claims.ckpt"
    write_checkpoint(path, state)
    assert all(read_checkpoint(path)[k] == v for k, v in counters.items())  # it says so
    return path


@pytest.mark.parametrize("key", ["round", "step", "steps_in_round"])
@pytest.mark.parametrize("value", [2**70, MAX_ROUND + 1])
async def test_a_checkpoint_past_the_sane_round_is_refused_and_nothing_loaded(
    tmp_path, key: str, value: int
) -> None:
    path = checkpoint_claiming(tmp_path, **{key: value})
    m = model()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)  # differs from the checkpoint's model
    before = [t.clone() for t in m.state_dict().values()]
    swarm = AsyncSwarm(m, torch.optim.SGD(m.parameters(), lr=0.1), **CONFIG)
    with pytest.raises(CheckpointError, match=rf"checkpoint {key} {value} is past .* 2\^40"):
        await swarm.load(path)
    assert swarm.round == 0 and swarm.engine.step_count == 0
    assert swarm.engine.offer_from_round is None  # a refused checkpoint offers nothing
    assert all(torch.equal(x, y) for x, y in zip(before, m.state_dict().values(), strict=True))


def test_a_checkpoint_at_the_sane_round_loads(tmp_path) -> None:
    path = checkpoint_claiming(tmp_path, round=MAX_ROUND)
    e = engine()
    e.load_state_dict(read_checkpoint(path))
    assert e.round == MAX_ROUND and e.offer_from_round == MAX_ROUND


@pytest.mark.parametrize("claimed", [MAX_ROUND + 1, 2**63, 2**64 - 1])
def test_a_snapshot_past_the_sane_round_is_refused(claimed: int) -> None:
    e = engine()
    _, blob = e.snapshot()
    snap = unpack_snapshot(blob, schema=e.schema, expected=e.snapshot_layout())
    lie = pack_snapshot(claimed, e.schema, "diloco", list(snap.tensors.items()))
    with pytest.raises(TrainingError, match="past the largest sane round"):
        unpack_snapshot(lie, schema=e.schema, expected=e.snapshot_layout())
    honest = pack_snapshot(MAX_ROUND, e.schema, "diloco", list(snap.tensors.items()))
    assert unpack_snapshot(honest, schema=e.schema, expected=e.snapshot_layout()).round == MAX_ROUND
