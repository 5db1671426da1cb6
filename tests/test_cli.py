"""swarm-peer as real processes on loopback: start, join, list, expire, stop."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from processes import OutputProcess

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="uses POSIX signals")

RUN_ID = "cli-test"
JOIN_LINE = re.compile(r"--initial-peers (\S+)")


class PeerProcess(OutputProcess):
    """A swarm-peer child process."""

    def __init__(self, *args: str, env: dict[str, str] | None = None):
        super().__init__([sys.executable, "-m", "swarm.cli", *args], env=env)

    def stop(self) -> None:
        self.kill()


@pytest.fixture
def spawn() -> Iterator:
    started: list[PeerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> PeerProcess:
        p = PeerProcess(*args, env=env)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


def list_peers(via: str, *extra: str) -> str:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "swarm.cli",
            "peers",
            "--initial-peers",
            via,
            "--run-id",
            RUN_ID,
            "--listen",
            "127.0.0.1:0",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def wait_listing(via: str, predicate, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        out = list_peers(via)
        if predicate(out) or time.monotonic() > deadline:
            return out
        time.sleep(0.5)


def test_three_peers_join_list_expire_and_stop(spawn):
    common = ("--run-id", RUN_ID, "--heartbeat", "1", "--log-level", "WARNING")
    a = spawn("--listen", "127.0.0.2:0", *common)
    a_addr = a.wait_for(JOIN_LINE).group(1)
    assert a_addr.startswith("127.0.0.2:")
    b = spawn("--listen", "127.0.0.3:0", "--initial-peers", a_addr, *common)
    b_addr = b.wait_for(JOIN_LINE).group(1)
    c = spawn("--listen", "127.0.0.4:0", *common, env={"SWARM_INITIAL_PEERS": a_addr})
    c_addr = c.wait_for(JOIN_LINE).group(1)

    listing = wait_listing(c_addr, lambda out: all(x in out for x in (a_addr, b_addr, c_addr)))
    for addr in (a_addr, b_addr, c_addr):
        assert addr in listing, listing
    assert "3 peer(s)" in listing

    b.proc.send_signal(signal.SIGKILL)
    b.proc.wait(timeout=10)
    listing = wait_listing(
        c_addr, lambda out: b_addr not in out and a_addr in out and c_addr in out
    )
    assert b_addr not in listing, listing
    assert a_addr in listing and c_addr in listing

    started = time.monotonic()
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(timeout=10) == 0, a.output()
    elapsed = time.monotonic() - started
    print(f"SIGTERM to exit: {elapsed:.2f} s")


def test_wrong_swarm_key_cannot_join(spawn, tmp_path):
    key = tmp_path / "swarm.key"
    key.write_text("correct horse battery staple\n")
    a = spawn("--listen", "127.0.0.5:0", "--run-id", RUN_ID, "--swarm-key", str(key))
    a_addr = a.wait_for(JOIN_LINE).group(1)
    assert "correct horse" not in a.output()

    wrong = subprocess.run(
        [
            sys.executable,
            "-m",
            "swarm.cli",
            "--listen",
            "127.0.0.6:0",
            "--run-id",
            RUN_ID,
            "--initial-peers",
            a_addr,
            "--dht-request-timeout-s",
            "0.5",  # refused: it waits out its timeouts, kept short
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SWARM_KEY": "another key entirely, 16+ bytes"},
    )
    assert wrong.returncode == 1
    assert "no initial peer answered" in wrong.stderr

    listing = list_peers(a_addr, "--swarm-key", str(key))
    assert a_addr in listing and "1 peer(s)" in listing


def test_bad_flags_give_clear_errors(tmp_path):
    bad = subprocess.run(
        [sys.executable, "-m", "swarm.cli", "--listen", "nonsense"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0
    assert "nonsense" in bad.stderr
    corrupt = tmp_path / "peer.key"
    corrupt.write_text("not a key")
    bad = subprocess.run(
        [sys.executable, "-m", "swarm.cli", "--listen", "127.0.0.1:0", "--identity", str(corrupt)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1
    assert "corrupt" in bad.stderr
    assert corrupt.read_text() == "not a key"


@pytest.mark.skipif(shutil.which("swarm-peer") is None, reason="package not installed")
def test_console_script_help():
    out = subprocess.run(["swarm-peer", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--initial-peers", "--listen", "--announce", "--identity", "--swarm-key"):
        assert flag in out.stdout


def test_malformed_environment_value_is_a_usage_error():
    result = subprocess.run(
        [sys.executable, "-m", "swarm.cli", "--run-id", RUN_ID],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SWARM_HEARTBEAT": "soon"},
    )
    assert result.returncode == 2
    assert "SWARM_HEARTBEAT='soon': 'soon' is not a number of seconds" in result.stderr
