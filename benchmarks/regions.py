"""Latency-aware vs random groups on an emulated WAN: wall time to consensus.

Runs in-process peers behind tests/wan.py (one-way delay 2 ms inside a region, tens of ms
between regions, ``--wan-rate`` bytes/s on links between regions), lets their Vivaldi
coordinates settle, then for each grouping starts every peer from its own random tensor and runs
numbered rounds until every peer is within ``--tolerance`` (relative) of the global mean. Both
groupings use the same group sizes (:func:`swarm.averaging.groups.regions.random_plan` keeps the
sizes of the latency-aware plan).

Prints one JSON line per (configuration, grouping) with ``regions``, ``peers``, ``grouping``,
``consensus_s``, ``single_region_group_fraction`` (regular rounds for ``latency``, all rounds for
``random``), ``rtt_prediction_median_rel_error``, and the rounds it took; then the speedups.

    python benchmarks/regions.py [--numel 262144] [--cross-every 2] [--wan-rate 4e6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import wan_swarm as ws
from wan import WanEmulator

INTRA = 0.002
CONFIGS = {
    # name: (peers per region, one-way delay between two regions)
    "2 regions": ({"eu": 4, "us": 4}, {("eu", "us"): 0.060}),
    "3 regions": (
        {"eu": 4, "us": 3, "asia": 1},
        {("eu", "us"): 0.060, ("eu", "asia"): 0.050, ("us", "asia"): 0.080},
    ),
}


async def run_config(name: str, args: argparse.Namespace) -> list[dict]:
    sizes, between = CONFIGS[name]
    delays = {**{(r, r): INTRA for r in sizes}, **between}
    lines = []
    async with WanEmulator(delays=delays, rate=args.rate) as wan:
        regions = [r for r, n in sizes.items() for _ in range(n)]
        swarm = await ws.start_swarm(wan, regions, run_id=name.replace(" ", "-"))
        for i, a in enumerate(swarm.members):  # long-haul links are slower than local ones
            for b in swarm.members[i + 1 :]:
                if swarm.region_of(a.peer.peer_id) != swarm.region_of(b.peer.peer_id):
                    wan.set_link(a.node, b.node, rate=args.wan_rate)
        try:
            await ws.wait_for_coordinates(swarm, samples=24, timeout=60)
            await ws.wait_for_regions(swarm, timeout=60)
            errors = await ws.rtt_prediction_errors(swarm)
            for grouping in ("latency", "random"):
                ws.add_averagers(
                    swarm,
                    grouping,
                    grouping=grouping,
                    cross_every=args.cross_every,
                    target_group_size=args.target_group_size,
                )
                progress = await ws.average_until(
                    swarm,
                    grouping,
                    args.max_rounds,
                    tolerance=args.tolerance,
                    numel=args.numel,
                    seed=args.seed,
                    stop_at_consensus=True,
                )
                regular = {
                    r
                    for r in range(args.max_rounds)
                    if grouping == "random" or r % args.cross_every != args.cross_every - 1
                }
                rounds = [len(v) for v in progress.results.values()]
                lines.append(
                    {
                        "config": name,
                        "regions": len(sizes),
                        "region_sizes": list(sizes.values()),
                        "peers": len(regions),
                        "grouping": grouping,
                        "consensus_s": _round(progress.consensus_s),
                        "rounds_to_consensus": max(rounds),
                        "single_region_group_fraction": round(
                            ws.single_region_fraction(swarm, progress, regular), 3
                        ),
                        "rtt_prediction_median_rel_error": round(ws.median(errors), 4),
                        "final_rel_error": float(f"{progress.final_error:.3g}"),
                        "tolerance": args.tolerance,
                        "cross_every": args.cross_every,
                        "target_group_size": args.target_group_size,
                        "numel": args.numel,
                        "wan_rate": args.wan_rate,
                    }
                )
                print(json.dumps(lines[-1]), flush=True)
        finally:
            await swarm.close()
    return lines


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), action="append")
    parser.add_argument("--numel", type=int, default=262144, help="floats per peer")
    parser.add_argument("--cross-every", type=int, default=2)
    parser.add_argument("--target-group-size", type=int, default=4)
    parser.add_argument("--max-rounds", type=int, default=16)
    parser.add_argument("--tolerance", type=float, default=1e-3)
    parser.add_argument("--rate", type=float, default=math.inf, help="bytes/s of local links")
    parser.add_argument(
        "--wan-rate", type=float, default=4e6, help="bytes/s of links between regions"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    summary = []
    for name in args.config or list(CONFIGS):
        lines = await run_config(name, args)
        by = {line["grouping"]: line["consensus_s"] for line in lines}
        if by.get("latency") and by.get("random"):
            summary.append({"config": name, "speedup": round(by["random"] / by["latency"], 2)})
        elif by.get("latency"):
            summary.append({"config": name, "speedup": None, "random": "no consensus"})
    for line in summary:
        print(json.dumps(line))


if __name__ == "__main__":
    asyncio.run(main())
