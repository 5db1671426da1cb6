"""Peers behind real NATs: time to become reachable, and all-reduce through relays vs direct.

Linux, as root, with iptables (and miniupnpd for ``upnp``): every peer runs in its own network
namespace (tests/nat_topology.py), on an "internet" bridge whose links are limited both ways to
``--rate-mbit`` by ``tc tbf``. Topologies: ``public`` (every peer on the bridge), ``upnp`` (one
public peer, the others behind UPnP routers that map their port), ``nat_no_upnp`` (one public
peer, the others behind plain MASQUERADE routers: relayed through the public peer).

    sudo python benchmarks/nat.py [--peers 3] [--numel 5000000] [--rate-mbit 100]

One JSON object per line: ``topology``, ``peers``, ``reachable`` (direct/mapped/relayed counts),
``time_to_reachable_s`` (the slowest joiner, from its start to knowing how others reach it;
the first peer has nobody to ask until others join),
``allreduce_s`` (the slowest member's all-reduce of one round), ``efficiency`` = ideal / measured
with ideal = 2 (N-1)/N x payload bytes / link rate, and ``relay_bytes_per_s`` (bytes the relays
forwarded over the all-reduce time).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from nat_topology import NatTopology, nat_unavailable  # noqa: E402
from processes import OutputProcess  # noqa: E402

WORKER = [sys.executable, str(ROOT / "tests" / "averaging_worker.py")]
TOPOLOGIES = {"public": None, "upnp": True, "nat_no_upnp": False}


def run(topology: str, peers: int, numel: int, rate_mbit: int) -> dict:
    upnp = TOPOLOGIES[topology]
    public = peers if upnp is None else 1
    routers = [] if upnp is None else [upnp] * (peers - 1)
    with NatTopology(public=public, routers=routers, rate_mbit=rate_mbit) as net:
        hosts = [*net.public, *net.homes]
        common = ["--wait-peers", str(peers), "--wait-reachable", str(peers)]
        common += ["--min-group", str(peers), "--target-group", str(peers), "--numel", str(numel)]
        common += ["--matchmaking-timeout", "30", "--allreduce-timeout", "120", "--linger", "3"]
        workers: list[OutputProcess] = []
        bootstrap = None
        try:
            for rank, host in enumerate(hosts):
                argv = [*WORKER, *common, "--seed", str(rank + 1), "--listen", f"{host.ip}:0"]
                argv += ["--initial-peers", bootstrap] if bootstrap else []
                workers.append(OutputProcess(host.argv(argv)))
                if bootstrap is None:
                    bootstrap = workers[0].wait_for(r"^ADDRESS (\S+)", 60)[1]
            for w in workers:
                w.wait_for("^DONE", 300)
            reach = [w.wait_for(r"^REACH (\S+) (\S+)") for w in workers]
            rounds = [w.rounds()[0] for w in workers]
            relayed = sum(int(w.wait_for(r"^RELAYED (\d+)")[1]) for w in workers)
        finally:
            for w in workers:
                w.kill()
    counts = {kind: sum(m[1] == kind for m in reach) for kind in ("direct", "mapped", "relayed")}
    allreduce_s = max(r["allreduce_s"] for r in rounds)
    ideal = 2 * (peers - 1) / peers * numel * 4 / (rate_mbit * 1e6 / 8)
    return {
        "topology": topology,
        "peers": peers,
        "reachable": counts,
        "time_to_reachable_s": round(max(float(m[2]) for m in reach[1:]), 3),
        "allreduce_s": round(allreduce_s, 3),
        "efficiency": round(ideal / allreduce_s, 3) if all(r["averaged"] for r in rounds) else None,
        "relay_bytes_per_s": round(relayed / allreduce_s) if allreduce_s else 0,
        "averaged": all(r["averaged"] for r in rounds),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--numel", type=int, default=5_000_000)
    p.add_argument("--rate-mbit", type=int, default=100)
    p.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES), choices=list(TOPOLOGIES))
    args = p.parse_args()
    for topology in args.topologies:
        if (why := nat_unavailable(upnp=TOPOLOGIES[topology] is True)) is not None:
            print(f"{topology} skipped: {why}", file=sys.stderr)
            continue
        started = time.monotonic()
        row = run(topology, args.peers, args.numel, args.rate_mbit)
        row["wall_s"] = round(time.monotonic() - started, 1)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
