"""Training peers as real processes on loopback: convergence, churn, late joiners, resume."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from processes import OutputProcess

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = [sys.executable, str(HERE / "training_worker.py")]


def _load_worker_module():
    spec = importlib.util.spec_from_file_location("training_worker", HERE / "training_worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_worker = _load_worker_module()
full_loss, make_model, task = _worker.full_loss, _worker.make_model, _worker.task


class Worker(OutputProcess):
    """A training_worker process."""

    def __init__(self, *args: str):
        super().__init__([*WORKER, *args])


@pytest.fixture
def workers():
    started: list[Worker] = []

    def start(*args: str) -> Worker:
        w = Worker(*args)
        started.append(w)
        return w

    yield start
    for w in started:
        w.kill()


def single_process_samples(target: float, batch: int, lr: float, check_every: int) -> int:
    """Samples one process needs on all the data (same model, optimizer and global batch)."""
    x, y = task()
    model = make_model("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(7)
    for step in range(1, 5000):
        idx = torch.randint(len(x), (batch,), generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        opt.step()
        if step % check_every == 0 and full_loss(model, x, y) < target:
            return step * batch
    raise AssertionError("the single-process baseline never reached the target")


def _four_peers(workers, tmp_path: Path, overlap: str) -> tuple[list[dict], float]:
    """4 peers, 24 rounds of 10 steps: every peer's rounds and the loss of the final model."""
    peers, inner, batch, lr = 4, 10, 16, 0.1
    common = [
        "--shards",
        str(peers),
        "--inner-steps",
        str(inner),
        "--batch",
        str(batch),
        "--lr",
        str(lr),
        "--steps",
        str(24 * inner),
        "--overlap",
        overlap,
        "--final-average",
        "--wait-peers",
        str(peers),
        "--barrier",
        str(tmp_path / f"barrier-{overlap}"),
    ]
    out = tmp_path / overlap
    out.mkdir()
    (tmp_path / f"barrier-{overlap}").mkdir()
    first = workers("--rank", "0", "--out", str(out / "p0.pt"), *common)
    address = first.wait_for(r"ADDRESS (\S+)", 60)[1]
    others = [
        workers(
            "--rank", str(r), "--initial-peers", address, "--out", str(out / f"p{r}.pt"), *common
        )
        for r in range(1, peers)
    ]
    for w in [first, *others]:
        w.wait_for("^DONE", 300)
    final = [json.loads(w.wait_for(r"^FINAL (.*)", 120)[1]) for w in [first, *others]]
    assert all(f["averaged"] and f["group"] == peers for f in final), final
    states = [torch.load(out / f"p{r}.pt") for r in range(peers)]
    for state in states[1:]:
        for key, value in state.items():
            gap = (value - states[0][key]).abs().max().item()
            assert gap <= 1e-5, (key, gap, final)
    model = make_model("mlp")
    model.load_state_dict(states[0])
    return first.rounds(), full_loss(model, *task())


@pytest.mark.flaky(reruns=1)  # real processes on 2 shared cores: a late group or slow join
def test_four_peers_reach_single_process_loss_blocking_or_overlapped(workers, tmp_path) -> None:
    """Both settings reach the single-process loss as fast, and both end below the target."""
    peers, inner, batch, lr, target = 4, 10, 16, 0.1, 0.002
    baseline = single_process_samples(target, peers * batch, lr, inner)
    final = {}
    for overlap in ("on", "off"):
        rounds, final[overlap] = _four_peers(workers, tmp_path, overlap)
        assert len(rounds) == 24, rounds
        assert sum(r["averaged"] for r in rounds) >= len(rounds) - 2, rounds
        losses = [(r["step"], round(r["loss"], 5), r["group"], r["round_s"]) for r in rounds]
        reached = next((r["step"] for r in rounds if r["loss"] < target), None)
        assert reached is not None, (overlap, losses)
        swarm_samples = reached * batch * peers
        assert swarm_samples <= 1.1 * baseline, (overlap, swarm_samples, baseline, rounds)
    # Same steps, same rounds: overlapped ends within 2% of blocking (measured 3.6e-4 against
    # 3.8e-4 with the fixed half share; landing_share keeps the progress made in flight).
    assert final["off"] < target / 2 and final["on"] < target / 2, final
    assert final["on"] <= 1.02 * final["off"], final


@pytest.mark.flaky(reruns=1)  # real processes on 2 shared cores: a late group or slow join
def test_killed_peer_is_survived_and_late_joiner_catches_up(workers, tmp_path) -> None:
    # blocking rounds: after a round every member holds the group's model, which the loss
    # comparison below relies on (overlapped, each keeps its own in-flight progress on top)
    common = [
        "--overlap",
        "off",
        "--shards",
        "3",
        "--inner-steps",
        "10",
        "--matchmaking-timeout",
        "3",
        "--step-delay",
        "0.05",
    ]
    # the survivors train until the test has seen enough (the late joiner's start takes
    # seconds on a loaded machine), then are killed
    first = workers("--rank", "0", "--rounds", "100000", "--wait-peers", "3", *common)
    address = first.wait_for(r"ADDRESS (\S+)", 60)[1]
    second, doomed = (
        workers(
            "--rank",
            rank,
            "--rounds",
            "100000",
            "--wait-peers",
            "3",
            "--initial-peers",
            address,
            *common,
        )
        for rank in ("1", "2")
    )
    doomed.wait_for(r'ROUND \{"round": 3,', 120)
    doomed.kill()
    killed_at = max(r["round"] for r in first.rounds())
    late = workers("--rank", "2", "--rounds", "2", "--initial-peers", address, *common)
    joined_round = int(late.wait_for(r"^START (\d+)", 120)[1])
    assert joined_round >= killed_at  # downloaded the live state, not round 0
    late.wait_for("^DONE", 120)
    last = max(r["round"] for r in late.rounds())
    for w in (first, second):
        w.wait_for(rf'ROUND \{{"round": {last + 1},', 60)
        w.kill()
    # The survivors went on averaging with each other after losing a member.
    after = [r for r in first.rounds() if r["round"] > killed_at + 1]
    assert after and sum(r["averaged"] for r in after) >= len(after) - 1, [
        (r["round"], r["averaged"], r["group"], r["reason"], r["wait_s"]) for r in first.rounds()
    ]
    late_first = late.rounds()[0]
    assert late_first["averaged"], late.rounds()
    # the late joiner averaged with at least one survivor, so after that round it holds about
    # the model of its group: compare with the closest survivor round near the same number (a
    # racy matchmaking may have grouped it with one survivor only, and with rounds of half a
    # second the survivors may be a round or two on by the time its download lands)
    same_round = [
        r for w in (first, second) for r in w.rounds() if abs(r["round"] - late_first["round"]) <= 2
    ]
    gap = min(abs(late_first["loss"] - r["loss"]) / r["loss"] for r in same_round)
    assert gap <= 0.05, (late_first, same_round)
    fresh_loss = float(first.wait_for(r"^START \d+ (\S+)")[1])
    assert late_first["loss"] < 0.5 * fresh_loss  # it trains from the swarm's state, not anew


def test_save_sigkill_load_resumes_the_saved_round(workers, tmp_path) -> None:
    ckpt, out = tmp_path / "peer.ckpt", tmp_path / "params.pt"
    solo = ["--min-group", "2", "--matchmaking-timeout", "0.3", "--inner-steps", "5"]
    first = workers(
        "--rounds", "1000", "--save", str(ckpt), "--save-at-round", "3", "--out", str(out), *solo
    )
    # overlapped, the round in flight at the save lands first: the checkpoint may be of round 4
    saved_round = int(first.wait_for(r"^SAVED (\d+)", 120)[1])
    assert saved_round in (3, 4)
    first.wait_for(rf'ROUND \{{"round": {saved_round + 1},', 60)  # trained past it, then dies
    first.kill()
    resumed = workers("--rounds", "1", "--load", str(ckpt), "--out", str(out), *solo)
    assert int(resumed.wait_for(r"^LOADED (\d+)", 120)[1]) == saved_round
    resumed.wait_for("^DONE", 120)
    saved = torch.load(str(out) + ".saved")
    loaded = torch.load(str(out) + ".loaded")
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert resumed.rounds()[0]["round"] == saved_round + 1
