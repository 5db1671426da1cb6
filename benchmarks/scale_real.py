"""``benchmarks/scale.py --real`` and ``--soak``: many real peers in one process (issue 32).

The peers, links, compute and churn are tests/many_peers.py's (its docstring says how); these
runners print the JSON lines (see benchmarks/scale.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from many_peers import PeerSpec, RunConfig, mixed_specs, run
from many_procs import run_processes


async def run_real(args: argparse.Namespace) -> None:
    """``--real``: tests/many_peers.py with ``--peers`` unequal peers, then (unless
    ``--no-equal``) the same peers all at the mean speed (the same total compute)."""
    specs = mixed_specs(args.peers, _floats(args.speeds), _floats(args.uplinks))
    options = {"inner_steps": args.inner_steps, **_options(args.option)}
    config = RunConfig(
        specs, args.minutes * 60, step_s=args.step_s, churn_per_min=args.churn_per_min,
        seed=args.seed, warmup_s=30.0, options=options, hidden=args.hidden,
        finish_rounds=args.finish_rounds,
    )  # fmt: skip
    figures = await _run(config, args.processes)
    per_peer = figures.pop("per_peer")
    if not args.no_equal:
        mean_speed = statistics.fmean(s.speed for s in specs)
        equal = [PeerSpec(mean_speed, s.uplink_mbit, s.region) for s in specs]
        reference = await _run(dataclasses.replace(config, specs=equal), args.processes)
        figures["equal_final_loss"] = reference["final_loss"]
        figures["equal_samples"] = reference["samples"]
        for name in ("consensus_spread_trained", "trained_loss", "trained_mean_model_loss"):
            figures[f"equal_{name}"] = reference[name]
    print(json.dumps({"setting": "real", **figures}), flush=True)
    for peer in per_peer:
        print(json.dumps({"setting": "real-peer", **peer}), flush=True)


async def _run(config: RunConfig, processes: int) -> dict:
    if processes > 1:
        return await asyncio.to_thread(run_processes, config, processes)
    return await run(config)


async def run_soak(args: argparse.Namespace) -> None:
    """``--soak MINUTES``: ``--peers`` real peers with churn for MINUTES;
    memory growth is the slope of the process's resident memory after the first 10 minutes,
    per peer (every peer shares the process)."""
    peers = args.peers
    specs = mixed_specs(peers, _floats(args.speeds), _floats(args.uplinks))
    config = RunConfig(
        specs, args.soak * 60, step_s=args.step_s, churn_per_min=args.churn_per_min,
        seed=args.seed, warmup_s=30.0, sample_every_s=30.0, hidden=args.hidden,
        options={"inner_steps": args.inner_steps, **_options(args.option)},
    )  # fmt: skip
    figures = await run(config)
    figures.pop("per_peer")
    samples = figures.pop("over_time")
    late = [s for s in samples if s["t_s"] >= 600 and s["rss_mb"] is not None]
    slope = None
    if len(late) >= 2:
        ts = [s["t_s"] / 3600 for s in late]
        ys = [s["rss_mb"] for s in late]
        slope = statistics.linear_regression(ts, ys).slope / peers
    first, last = samples[0], samples[-1]
    print(json.dumps({"setting": "soak-sample", "samples": samples}), flush=True)
    soak = {
        "setting": "soak",
        "rss_growth_mb_per_hour": slope,
        "rss_mb_start": first["rss_mb"],
        "rss_mb_end": last["rss_mb"],
        "fds_start": first["fds"],
        "fds_end": last["fds"],
        "tasks_start": first["tasks"],
        "tasks_end": last["tasks"],
    }
    print(json.dumps({**soak, **figures}), flush=True)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def _options(pairs: list[str]) -> dict[str, object]:
    """``NAME=VALUE`` pairs: numbers as numbers, true/false as booleans (not none: it names a
    codec)."""
    words = {"true": True, "false": False}
    out: dict[str, object] = {}
    for pair in pairs:
        name, _, text = pair.partition("=")
        if text.lower() in words:
            out[name] = words[text.lower()]
            continue
        try:
            out[name] = int(text)
        except ValueError:
            try:
                out[name] = float(text)
            except ValueError:
                out[name] = text
    return out
