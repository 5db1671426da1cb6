"""What seeing the swarm costs: round time with status publishing and /metrics on vs off.

Runs :mod:`allreduce`'s N peer processes on loopback twice per repetition, alternating, so load
from elsewhere on the machine hits both sides alike:

- ``on``: every heartbeat publishes the peer's progress in its record and reads the run's records
  (join/leave lines); each round is counted in the peer's metrics; ``/metrics`` is served and
  scraped every ``--scrape-interval`` seconds by each peer's own client;
- ``off``: the record carries no progress, no run read per heartbeat, no metrics route.

Heartbeats are short (``--heartbeat``, 1 s by default, a tenth of the CLI's) so that the
publishing happens many times per round and the figure is an upper bound. Prints one JSON line
per run, then::

    {"status_overhead": (median round_s on - median round_s off) / median round_s off,
     "round_s_on": ..., "round_s_off": ..., "status_overhead_cpu": ..., "cpu_s_per_round_on": ...,
     "cpu_s_per_round_off": ..., "publish_ms": ..., "metrics_render_ms": ...,
     "n": ..., "numel": ..., "codec": ..., "repeats": ..., "load": [1, 5, 15 min]}

``status_overhead_cpu`` is the same comparison for the CPU seconds all peer processes spend per
timed round: wall time on a shared machine swings with others' load by far more than 1 %, CPU
time much less. ``publish_ms`` is the CPU time of one progress snapshot plus record signing, and
``metrics_render_ms`` of one ``/metrics`` body, measured in this process.

    python benchmarks/status.py [--n 4] [--numel 4M] [--rounds 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import allreduce


def in_process_costs(samples: int = 200) -> tuple[float, float]:
    """(ms per progress publish, ms per metrics render) on this machine."""
    from swarm.config import PeerConfig
    from swarm.monitor.tracker import RoundFigures
    from swarm.peer import Peer

    async def measure() -> tuple[float, float]:
        peer = await Peer.start(PeerConfig(run_id="bench-status", listen="127.0.0.1:0"))
        try:
            transport = peer.transport
            assert transport is not None
            figures = RoundFigures(True, "", "abcd", 4, 1 << 20, 1 << 20, 1.0, 0.1, 0.9)
            for _ in range(10):
                peer.record_round(figures)
            start = time.process_time()
            for _ in range(samples):
                progress = peer.progress.snapshot(reachability="public").to_wire()
                transport.update_record(extra={**transport.record().extra, "pg": progress})
            publish = (time.process_time() - start) / samples * 1e3
            start = time.process_time()
            for _ in range(samples):
                peer._render_metrics()
            render = (time.process_time() - start) / samples * 1e3
            return publish, render
        finally:
            await peer.close()

    return asyncio.run(measure())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--numel", default="4M")
    p.add_argument("--codec", default="none")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--heartbeat", type=float, default=1.0)
    p.add_argument("--scrape-interval", type=float, default=1.0)
    args = p.parse_args()
    numel = allreduce.parse_numel(args.numel)
    times: dict[str, list[float]] = {"on": [], "off": []}
    cpu: dict[str, list[float]] = {"on": [], "off": []}
    for rep in range(args.repeats):
        order = ("on", "off") if rep % 2 == 0 else ("off", "on")
        for mode in order:
            extra = ("--status", mode, "--heartbeat", str(args.heartbeat))
            extra += ("--scrape-interval", str(args.scrape_interval))
            row = allreduce.run_config(args.n, numel, args.codec, args.rounds, 0.05, extra=extra)
            row["status"] = mode
            print(json.dumps(row), flush=True)
            times[mode].append(row["round_s"])
            cpu[mode].append(row["cpu_s_per_round"])
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    cpu_on, cpu_off = statistics.median(cpu["on"]), statistics.median(cpu["off"])
    publish_ms, render_ms = in_process_costs()
    print(
        json.dumps(
            {
                "status_overhead": round((on - off) / off, 4),
                "round_s_on": round(on, 4),
                "round_s_off": round(off, 4),
                "status_overhead_cpu": round((cpu_on - cpu_off) / cpu_off, 4),
                "cpu_s_per_round_on": round(cpu_on, 4),
                "cpu_s_per_round_off": round(cpu_off, 4),
                "publish_ms": round(publish_ms, 3),
                "metrics_render_ms": round(render_ms, 3),
                "n": args.n,
                "numel": numel,
                "codec": args.codec,
                "repeats": args.repeats,
                "load": [round(x, 2) for x in os.getloadavg()]
                if hasattr(os, "getloadavg")
                else None,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
