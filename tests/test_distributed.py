"""torchrun nodes: 2 nodes of 2 gloo processes each, one swarm peer per node, on loopback."""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch.distributed as dist
from processes import ROOT, OutputProcess

from swarm.errors import ConfigError

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed missing"),
    # a rank aborts inside torch's C++ now and then ("terminate called without an active
    # exception", SIGABRT, no Python frame; about one run in ten to twenty on 2 loaded cores,
    # and once in a full suite twice in a row, though 0 of 13 runs alone aborted after that):
    # a third run decides, and a real regression fails all three
    pytest.mark.flaky(reruns=2),
]


def torchrun(node: int, listen: str, out, *extra: str) -> OutputProcess:
    return OutputProcess(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(ROOT / "tests" / "torchrun_worker.py"),
            "--node-id",
            str(node),
            "--listen",
            listen,
            "--out",
            str(out),
            *extra,
        ],
        env={"OMP_NUM_THREADS": "1"},
    )


def two_nodes(tmp_path, *extra: str, first: tuple[str, ...] = ()) -> dict[tuple[int, int], dict]:
    """Run node 0 (with ``first`` added), then node 1 joining it; each rank's result by
    (node, rank)."""
    address_file = tmp_path / "a.addr"
    a = torchrun(0, "127.0.0.41:0", tmp_path, "--address-file", str(address_file), *extra, *first)
    b = None
    try:
        deadline = time.monotonic() + 120
        while not address_file.exists() or not address_file.read_text():
            assert a.proc.poll() is None and time.monotonic() < deadline, a.output()
            time.sleep(0.1)
        address = address_file.read_text()
        b = torchrun(1, "127.0.0.42:0", tmp_path, "--initial-peers", address, *extra)
        both = lambda: f"node 0:\n{a.output()}\nnode 1:\n{b.output()}"  # noqa: E731
        assert a.proc.wait(timeout=240) == 0, both()
        assert b.proc.wait(timeout=240) == 0, both()
    finally:
        a.kill()
        if b is not None:
            b.kill()
    results = {
        (r["node"], r["rank"]): r
        for r in (json.loads(p.read_text()) for p in tmp_path.glob("node*_rank*.json"))
    }
    assert set(results) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    return results


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["diloco", "gradients"])
def test_two_nodes_of_two_processes_train_as_two_peers(tmp_path, mode) -> None:
    results = two_nodes(tmp_path, "--mode", mode)
    for node in (0, 1):
        # Every step ends with the same weights on both ranks: the last steps are inner steps
        # after the last round, so this holds only if gradients were averaged inside the node.
        assert results[(node, 0)]["params"] == results[(node, 1)]["params"], node
        assert results[(node, 1)]["rounds"] == []  # only rank 0 is a swarm peer
        rounds = results[(node, 0)]["rounds"]
        assert [True, 2] in rounds, rounds  # averaged with the other node at least once
    if mode == "diloco":  # the last steps are local: each node trained on its own data
        assert results[(0, 0)]["params"] != results[(1, 0)]["params"]


@pytest.mark.slow
def test_ranks_stay_identical_while_a_round_is_in_flight(tmp_path) -> None:
    # Node 0 takes 0.3 s a step, node 1 no time: node 1's first round waits for node 0's, which
    # then finds node 1 waiting and averages at once; it lands at step 4 or 5, not at a due
    # step. Node 0's second round (step 6) then starts alone, with no round ending at that step,
    # and looks for partners for 5 s (node 1 has finished), so it is still in flight at step 7,
    # the last. After an averaged round, its eager outer step moved rank 0's model at step 6:
    # rank 1 must follow that too, bit for bit.
    results = two_nodes(tmp_path, "--mode", "diloco", first=("--step-sleep", "0.3"))
    for node in (0, 1):
        assert results[(node, 0)]["params"] == results[(node, 1)]["params"], node
        assert [True, 2] in results[(node, 0)]["rounds"], results[(node, 0)]["rounds"]
    assert results[(0, 0)]["launches_alone"] >= 1, results[(0, 0)]


def test_needs_an_initialized_process_group() -> None:
    import torch

    from swarm.distributed import NodeSwarm

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="init_process_group"):
        NodeSwarm(model, torch.optim.SGD(model.parameters(), lr=0.1))
