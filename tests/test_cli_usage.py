"""swarm-peer as a user meets it: usage errors, the key fingerprint, the default port, stopping.

Each case runs the real command in a child process; the usage cases run side by side to keep the
file quick.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from processes import ROOT, OutputProcess, child_env

from swarm.cli import DEFAULT_PORT, apply_environment, build_parser

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="uses POSIX signals")

FINGERPRINT = re.compile(r"swarm key fingerprint ([0-9a-f-]{19})")
JOIN_LINE = re.compile(r"--initial-peers (\S+)")
SECRET = "correct horse battery staple"


def usage_cases(tmp: Path) -> list[tuple[str, list[str], dict[str, str], list[str]]]:
    """(name, argv, environment, what stderr must name)."""
    key_file = tmp / "swarm.key"
    key_file.write_text(SECRET)
    missing = str(tmp / "missing.key")
    return [
        ("negative bandwidth", ["--bandwidth", "-5"], {}, ["--bandwidth", "-5 Mbit/s"]),
        ("env bandwidth", [], {"SWARM_BANDWIDTH": "-5"}, ["SWARM_BANDWIDTH", "Mbit/s"]),
        ("env heartbeat", [], {"SWARM_HEARTBEAT": "soon"}, ["SWARM_HEARTBEAT", "seconds"]),
        ("zero heartbeat", ["--heartbeat", "0"], {}, ["--heartbeat", "0 seconds"]),
        ("env listen", [], {"SWARM_LISTEN": "nonsense"}, ["SWARM_LISTEN", "nonsense"]),
        ("env peers", [], {"SWARM_INITIAL_PEERS": "a:b"}, ["SWARM_INITIAL_PEERS"]),
        ("env log level", [], {"SWARM_LOG_LEVEL": "LOUD"}, ["SWARM_LOG_LEVEL", "LOUD"]),
        ("env run id", [], {"SWARM_RUN_ID": "a b"}, ["SWARM_RUN_ID"]),
        ("path in SWARM_KEY", [], {"SWARM_KEY": str(key_file)}, ["SWARM_KEY_FILE", "path"]),
        ("short SWARM_KEY", [], {"SWARM_KEY": "short"}, ["SWARM_KEY", "5 bytes"]),
        ("missing key file", ["--swarm-key", missing], {}, ["--swarm-key", "missing.key"]),
        ("env key file", [], {"SWARM_KEY_FILE": missing}, ["SWARM_KEY_FILE", "missing.key"]),
        ("unknown flag", ["--no-such-flag"], {}, ["--no-such-flag"]),
        ("peers without address", ["peers"], {}, ["--initial-peers"]),
        ("export without files", ["export"], {}, ["CHECKPOINT"]),
    ]


def test_every_usage_error_exits_2_and_names_its_flag_or_variable(tmp_path) -> None:
    cases = usage_cases(tmp_path)
    children = []
    for _name, argv, env, _ in cases:
        # --listen with port 0 so that a case that wrongly passes binds nothing fixed
        listen = (
            []
            if "SWARM_LISTEN" in env or argv[:1] in (["peers"], ["export"])
            else [
                "--listen",
                "127.0.0.1:0",
            ]
        )
        clean = {k: v for k, v in child_env().items() if not k.startswith("SWARM_")}
        children.append(
            subprocess.Popen(
                [sys.executable, "-m", "swarm", *listen, *argv],
                cwd=ROOT,
                env={**clean, **env},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for (name, _, _, wanted), child in zip(cases, children, strict=True):
        try:
            out, err = child.communicate(timeout=120)
        finally:
            child.kill()
        assert child.returncode == 2, (name, out, err)
        assert "Traceback" not in err, (name, err)
        for text in wanted:
            assert text in err, (name, text, err)
        assert SECRET not in out + err


def test_default_port_is_fixed_and_documented(monkeypatch) -> None:
    for var in ("SWARM_LISTEN", "SWARM_HEARTBEAT", "SWARM_BANDWIDTH"):
        monkeypatch.delenv(var, raising=False)
    parser = build_parser()
    args = parser.parse_args([])
    apply_environment(parser, args)
    assert args.listen == f"0.0.0.0:{DEFAULT_PORT}"
    assert (args.heartbeat, args.bandwidth) == (10.0, 100.0)
    monkeypatch.setenv("SWARM_LISTEN", "127.0.0.1:0")
    args = parser.parse_args(["--listen", "127.0.0.2:7"])
    apply_environment(parser, args)
    assert args.listen == "127.0.0.2:7"  # the flag wins over the variable
    assert f"0.0.0.0:{DEFAULT_PORT}" in parser.format_help()
    assert str(DEFAULT_PORT) in (ROOT / "README.md").read_text()


@pytest.fixture
def spawn() -> Iterator:
    started: list[OutputProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> OutputProcess:
        p = OutputProcess([sys.executable, "-m", "swarm", *args], env=env)
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()


def test_key_fingerprint_is_printed_and_matches_across_key_sources(spawn, tmp_path) -> None:
    key = tmp_path / "swarm.key"
    key.write_text(SECRET + "\n")
    common = ("--run-id", "fp-test", "--log-level", "WARNING")
    a = spawn("--listen", "127.0.0.21:0", "--swarm-key", str(key), *common)
    a_print = a.wait_for(FINGERPRINT).group(1)
    a_addr = a.wait_for(JOIN_LINE).group(1)
    b = spawn(
        "--listen", "127.0.0.22:0", "--initial-peers", a_addr, *common, env={"SWARM_KEY": SECRET}
    )
    assert b.wait_for(FINGERPRINT).group(1) == a_print
    b.wait_for(JOIN_LINE)  # joined: same key
    c = spawn("--listen", "127.0.0.23:0", *common, env={"SWARM_KEY_FILE": str(key)})
    assert c.wait_for(FINGERPRINT).group(1) == a_print
    d = spawn("--listen", "127.0.0.24:0", *common, env={"SWARM_KEY": "another secret, long enough"})
    assert d.wait_for(FINGERPRINT).group(1) != a_print
    e = spawn("--listen", "127.0.0.25:0", *common, env={"SWARM_KEY": ""})
    e.wait_for(r"membership: open swarm")
    for p in (a, b, c, d, e):
        assert SECRET not in p.output()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_during_a_join_stops_at_once_with_status_0(spawn, sig) -> None:
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # receives, never answers
    silent.bind(("127.0.0.26", 0))
    try:
        target = f"127.0.0.26:{silent.getsockname()[1]}"
        p = spawn("--listen", "127.0.0.27:0", "--initial-peers", target, "--run-id", "join-stop")
        p.wait_for(r"joining run 'join-stop'")
        p.proc.send_signal(sig)
        # Before, the signal waited for the join to time out, then exited 1.
        assert p.proc.wait(timeout=30) == 0, p.output()
    finally:
        silent.close()
    out = p.output()
    assert "Traceback" not in out and "no initial peer answered" not in out, out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_while_importing_exits_0_without_a_traceback(sig) -> None:
    # -X importtime reports each import as it happens: once swarm's CLI modules are being
    # imported, the guard is in place and the import is not over yet.
    p = OutputProcess(
        [sys.executable, "-X", "importtime", "-m", "swarm", "--listen", "127.0.0.28:0"]
    )
    try:
        p.wait_for(r"\|\s+swarm\.(auth|net|dht|identity|config)")
        p.proc.send_signal(sig)
        assert p.proc.wait(timeout=30) == 0, p.output()[-3000:]
    finally:
        p.kill()
    assert "Traceback" not in p.output()
