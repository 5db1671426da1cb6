"""Peers in their own Linux network namespaces behind rate-limited links (benchmarks only).

``rate_limited_namespaces(n, rate_bits)`` joins ``n`` namespaces on one bridge, each through a
veth pair whose both directions ``tc ... tbf`` limits to ``rate_bits``/s, like home connections
with a symmetric line; the namespaces are removed afterwards, also on errors. Needs root.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

_NS, _BRIDGE, _SUBNET = "swarm-bench-", "swbench0", "10.77.0."


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@contextlib.contextmanager
def rate_limited_namespaces(n: int, rate_bits: int):
    """``n`` namespaces on one bridge, each behind a veth limited both ways to ``rate_bits``/s.

    Yields the command prefix and address of each peer: (["ip", "netns", "exec", NAME], IP).
    """
    tbf = ["tbf", "rate", f"{rate_bits // 1_000_000}mbit", "burst", "128kb", "latency", "100ms"]
    try:
        _sh("ip", "link", "add", _BRIDGE, "type", "bridge")
        _sh("ip", "link", "set", _BRIDGE, "up")
        peers = []
        for i in range(n):
            ns, outer, inner, ip = f"{_NS}{i}", f"swbv{i}", f"swbp{i}", f"{_SUBNET}{i + 1}"
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            _sh("ip", "link", "set", inner, "netns", ns)
            _sh("ip", "link", "set", outer, "master", _BRIDGE, "up")
            run = ["ip", "netns", "exec", ns]
            _sh(*run, "ip", "addr", "add", f"{ip}/24", "dev", inner)
            _sh(*run, "ip", "link", "set", inner, "up")
            _sh(*run, "ip", "link", "set", "lo", "up")
            _sh(*run, "tc", "qdisc", "add", "dev", inner, "root", *tbf)  # peer -> network
            _sh("tc", "qdisc", "add", "dev", outer, "root", *tbf)  # network -> peer
            peers.append((run, ip))
        yield peers
    finally:
        for i in range(n):
            subprocess.run(["ip", "netns", "del", f"{_NS}{i}"], capture_output=True)
            subprocess.run(["ip", "link", "del", f"swbv{i}"], capture_output=True)
        subprocess.run(["ip", "link", "del", _BRIDGE], capture_output=True)


def tbf_available() -> str | None:
    """None when the tbf100 setting can run here, else why not."""
    if not sys.platform.startswith("linux"):
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root (ip netns, tc)"
    try:
        _sh("ip", "netns", "list")
        _sh("tc", "qdisc", "show")
    except (OSError, subprocess.CalledProcessError) as e:
        return f"ip/tc unavailable: {e}"
    return None
