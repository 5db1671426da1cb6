"""Smoke tests of the examples: each runs offline with a tiny configuration and trains."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
from processes import ROOT, child_env

pytestmark = pytest.mark.slow


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
