"""Slow poison over training: ``python benchmarks/byzantine.py --training``.

Real peers on one event loop (tests/poison_run.py) train a small task for ``--rounds`` DiLoCo
rounds; the last ``attackers`` of them send a slow-poison update every round (ALIE, IPM, free
riding, a stale update, the update turned around inside the clip radius). One JSON object per
attack and configuration, the figures the mean over ``--seeds`` runs::

    attack, peers, attackers, rounds, seeds,
    final_loss               the worst honest peer's test loss at the end (mean over seeds)
    honest_only_final_loss   the same for the honest peers alone (peers - attackers, no attack)
    undefended_final_loss    the attack with update scoring off (CenteredClip alone)
    ratio                    final_loss / honest_only_final_loss
    per_seed, ...            the same figures seed by seed (how far one run is from the mean)
    rounds_to_downweight     rounds until every honest peer that scored an attacker holds its
                             record below 0.5 (the worst seed; null: not in every seed)
    honest_excluded          honest peers whose record fell below 0.5 in some honest view
    honest_clip_rate         honest contributions scaled below 0.5, over all update rounds
    overhead                 wall time of the defended run without attackers against the same
                             run with the defences off (plain mean, no scoring)
    overhead_cpu             the same for the CPU time of the run's process (every peer's):
                             wall time here waits on matchmaking more than on the defences
    scoring_overhead(_cpu)   the same against CenteredClip without scoring (calm row only)

``--non-iid`` gives each peer two of the ten classes; ``--attacks`` with no name runs only the
calm row.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from poison_run import run

from swarm.averaging import Fault
from swarm.averaging.faults import SLOW_POISON


async def mean_run(seeds: int, **kw) -> dict:
    rows = [await run(seed=s, **kw) for s in range(seeds)]
    out = {k: statistics.fmean(r[k] for r in rows) for k in ("final_loss", "wall_s", "cpu_s")}
    out["per_seed"] = [round(r["final_loss"], 4) for r in rows]
    out["honest_clip_rate"] = statistics.fmean(r["honest_clip_rate"] for r in rows)
    downs = [r["rounds_to_downweight"] for r in rows]
    out["rounds_to_downweight"] = None if None in downs else max(downs)
    out["honest_excluded"] = max(len(r["honest_downweighted"]) for r in rows)
    return out


async def main(args: argparse.Namespace) -> None:
    common = {"rounds": args.rounds, "non_iid": args.non_iid}
    for peers, attackers in args.configs:
        honest = await mean_run(
            args.seeds, peers=peers - attackers, attackers=0, fault=Fault.NONE, **common
        )
        calm = await mean_run(args.seeds, peers=peers, attackers=0, fault=Fault.NONE, **common)
        off = await mean_run(
            args.seeds,
            peers=peers,
            attackers=0,
            fault=Fault.NONE,
            aggregator="mean",
            score_updates=False,
            **common,
        )
        clip = await mean_run(
            args.seeds, peers=peers, attackers=0, fault=Fault.NONE, score_updates=False, **common
        )
        base = {"peers": peers, "rounds": args.rounds, "seeds": args.seeds}
        base["non_iid"] = args.non_iid
        print(
            json.dumps(
                {
                    "attack": "none",
                    **base,
                    "attackers": 0,
                    "final_loss": calm["final_loss"],
                    "honest_only_final_loss": honest["final_loss"],
                    "per_seed": calm["per_seed"],
                    "honest_only_per_seed": honest["per_seed"],
                    "honest_excluded": calm["honest_excluded"],
                    "honest_clip_rate": calm["honest_clip_rate"],
                    "overhead": calm["wall_s"] / off["wall_s"],
                    "overhead_cpu": calm["cpu_s"] / off["cpu_s"],
                    "scoring_overhead": calm["wall_s"] / clip["wall_s"],
                    "scoring_overhead_cpu": calm["cpu_s"] / clip["cpu_s"],
                }
            ),
            flush=True,
        )
        for fault in args.attacks:
            kw = {"peers": peers, "attackers": attackers, "fault": fault, **common}
            got = await mean_run(args.seeds, **kw)
            bare = await mean_run(args.seeds, score_updates=False, **kw)
            row = {
                "attack": fault.value,
                **base,
                "attackers": attackers,
                "final_loss": got["final_loss"],
                "honest_only_final_loss": honest["final_loss"],
                "undefended_final_loss": bare["final_loss"],
                "ratio": got["final_loss"] / honest["final_loss"],
                "per_seed": got["per_seed"],
                "undefended_per_seed": bare["per_seed"],
                "rounds_to_downweight": got["rounds_to_downweight"],
                "honest_excluded": got["honest_excluded"],
                "honest_clip_rate": got["honest_clip_rate"],
                "overhead": calm["wall_s"] / off["wall_s"],
                "overhead_cpu": calm["cpu_s"] / off["cpu_s"],
            }
            print(json.dumps(row), flush=True)


def configs(text: str) -> tuple[int, int]:
    peers, attackers = text.split(":")
    return int(peers), int(attackers)


def cli(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--training", action="store_true")
    p.add_argument("--configs", type=configs, nargs="+", default=[(6, 1), (8, 2)])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--non-iid", action="store_true")
    p.add_argument("--attacks", type=Fault, nargs="*", default=list(SLOW_POISON))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    asyncio.run(main(args))
