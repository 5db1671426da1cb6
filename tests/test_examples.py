"""The examples as a user runs them: --help, one-line errors, swarm-peer's key flags, Lightning."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import stat
import subprocess
import sys

import pytest
from processes import ROOT, child_env

from swarm.auth import Membership
from swarm.cli import describe_membership

EXAMPLES = ROOT / "examples"


def run(script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 180):
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**{k: v for k, v in child_env().items() if not k.startswith("SWARM_")}, **(env or {})},
    )


@pytest.mark.parametrize(("script", "options"), [("quickstart.py", 8), ("image_classifier.py", 14)])
def test_help_has_a_text_and_a_default_for_every_option(script, options) -> None:
    out = run(script, "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("(default:") == options, out.stdout
    assert "(default: int8)" in out.stdout


@pytest.mark.parametrize(
    ("script", "args", "named"),
    [
        ("quickstart.py", ["--codec", "int9"], "unknown codec 'int9'"),
        ("quickstart.py", ["--outer-lr", "-1"], "outer_lr"),
        ("quickstart.py", ["--peers", "0"], "--peers"),
        ("language_model.py", ["--codec", "int9"], "unknown codec 'int9'"),
        ("language_model.py", ["--outer-momentum", "1.5"], "outer_momentum"),
        ("image_classifier.py", ["--codec", "zip"], "unknown codec 'zip'"),
        ("image_classifier.py", ["--listen", "nowhere"], "nowhere"),
        ("image_classifier.py", ["--swarm-key", "/no/such/key"], "/no/such/key"),
        ("image_classifier.py", ["--batch", "-3"], "--batch"),
    ],
)
def test_bad_codec_or_flag_is_a_one_line_error(script, args, named) -> None:
    out = run(script, *args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if ": error:" in line]
    assert len(errors) == 1 and named in errors[0], out.stderr


def test_image_classifier_takes_swarm_peer_identity_and_key_flags(tmp_path) -> None:
    key = tmp_path / "swarm.key"
    key.write_text("a secret shared by the whole swarm\n")
    identity = tmp_path / "peer.key"
    expected = describe_membership(Membership.with_key(key.read_bytes().strip()))
    out = run(
        "image_classifier.py",
        "--swarm-key",
        str(key),
        "--identity",
        str(identity),
        "--max-steps",
        "2",
        "--batch",
        "16",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert expected in out.stdout
    assert re.search(r"peer listening on 127\.0\.0\.1:\d+", out.stdout)
    assert identity.exists()
    if os.name == "posix":
        assert stat.S_IMODE(identity.stat().st_mode) == 0o600
    # the same key through the environment gives the same fingerprint
    env_run = run("image_classifier.py", "--max-steps", "1", env={"SWARM_KEY_FILE": str(key)})
    assert env_run.returncode == 0 and expected in env_run.stdout, env_run.stderr


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="lightning missing")
def test_lightning_example_trains_through_swarm_optimizer() -> None:
    out = run(
        "lightning_trainer.py",
        "--max-steps",
        "40",
        "--inner-steps",
        "20",
        "--matchmaking-timeout",
        "0.5",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    m = re.search(r"steps (\d+) rounds (\d+) first loss ([\d.]+) last loss ([\d.]+)", out.stdout)
    assert m, out.stdout
    steps, rounds, first, last = int(m[1]), int(m[2]), float(m[3]), float(m[4])
    assert (steps, rounds) == (40, 2)  # every Lightning step was a swarm step
    assert last < first


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None
    or importlib.util.find_spec("accelerate") is None,
    reason="transformers or accelerate missing",
)
def test_hf_trainer_example_trains_through_swarm_optimizer() -> None:
    out = run(
        "hf_trainer.py", "--max-steps", "40", "--inner-steps", "20", "--matchmaking-timeout", "0.5"
    )
    assert out.returncode == 0, out.stdout + out.stderr
    m = re.search(r"steps (\d+) rounds (\d+) train loss ([\d.]+)", out.stdout)
    assert m, out.stdout
    assert (int(m[1]), int(m[2])) == (40, 2)
    assert float(m[3]) < 1.38  # below chance (ln 4 = 1.386): it learned


@pytest.mark.slow
def test_language_model_example_trains_two_peers_on_the_standard_library() -> None:
    tiny = "--peers 2 --steps 20 --inner-steps 5 --dim 32 --layers 1 --heads 2 --context 32"
    argv = [sys.executable, str(ROOT / "examples" / "language_model.py"), *tiny.split()]
    argv += ["--batch", "4", "--accumulate", "2", "--corpus-bytes", "200000"]
    done = subprocess.run(
        argv, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"corpus: \d+ bytes", done.stdout), done.stdout
    rounds = re.findall(r"peer 0 round +(\d+) .* loss (\S+) averaged with 1 peers", done.stdout)
    assert len(rounds) >= 2, done.stdout
    losses = [float(loss) for _, loss in rounds]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < math.log(256), losses
    # the peers end with one model: the final average leaves them the same loss
    final = re.search(
        r"held-out (\S+) bits/byte, mean of 2 peers \((\S+)-(\S+)\) after", done.stdout
    )
    assert final and final[2] == final[3] and float(final[1]) < 8.0, done.stdout
