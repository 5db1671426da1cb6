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
    anchor_loss, ...         the same for the worst honest peer's last averaged parameters,
                             without the steps it trained alone since (with ``--non-iid`` those
                             fit its own two classes, and its final_loss says little)
    per_seed, ...            the same figures seed by seed (how far one run is from the mean)
    rounds_to_downweight     rounds until every honest peer that scored an attacker holds its
                             record below 0.5 (the worst seed; null: not in every seed)
    honest_excluded          honest peers whose record fell below 0.5 in the median view of
                             the honest peers that scored them, in some round (the worst seed;
                             the view that names attackers, and the weight most of the swarm
                             gives them)
    honest_lowered_in_a_view honest peers whose record fell below 0.5 in some one honest view,
                             in any round (the worst seed): that scorer's parts weigh them less
    honest_clip_rate         honest contributions scaled below 0.5, over all update rounds
    overhead                 wall time of the defended run without attackers against the same
                             run with the defences off (plain mean, no scoring), over
                             ``--calm-seeds`` seeds (one run's wall time moves by 10-15%)
    overhead_per_seed        the same seed by seed (how far one pair of runs is from the mean)
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
from arguments import at_least
from poison_run import run

from swarm.averaging import Fault
from swarm.averaging.faults import SLOW_POISON


def summary(rows: list[dict]) -> dict:
    """The mean over seeds of runs of one configuration."""
    keys = ("final_loss", "anchor_loss", "wall_s", "cpu_s")
    out = {k: statistics.fmean(r[k] for r in rows) for k in keys}
    out["per_seed"] = [round(r["final_loss"], 4) for r in rows]
    out["walls"] = [r["wall_s"] for r in rows]
    out["honest_clip_rate"] = statistics.fmean(r["honest_clip_rate"] for r in rows)
    downs = [r["rounds_to_downweight"] for r in rows]
    out["rounds_to_downweight"] = None if None in downs else max(downs)
    out["honest_excluded"] = max(len(r["honest_excluded"]) for r in rows)
    out["honest_lowered_in_a_view"] = max(len(r["honest_downweighted"]) for r in rows)
    return out


async def mean_runs(seeds: int, **configs: dict) -> dict[str, dict]:
    """Each configuration's :func:`summary`, the runs taking turns seed by seed, so that a busier
    stretch of the machine falls on every configuration alike (``overhead`` is a ratio of two
    of them)."""
    rows: dict[str, list[dict]] = {name: [] for name in configs}
    for seed in range(seeds):
        for name, kw in configs.items():
            rows[name].append(await run(seed=seed, **kw))
    return {name: summary(r) for name, r in rows.items()}


async def main(args: argparse.Namespace) -> None:
    common = {"rounds": args.rounds, "non_iid": args.non_iid}
    for peers, attackers in args.configs:
        calm_kw = {"peers": peers, "attackers": 0, "fault": Fault.NONE, **common}
        calm_runs = await mean_runs(
            args.calm_seeds or args.seeds,
            honest={**calm_kw, "peers": peers - attackers},
            calm=calm_kw,
            off={**calm_kw, "aggregator": "mean", "score_updates": False},
            clip={**calm_kw, "score_updates": False},
        )
        honest, calm, off, clip = (calm_runs[k] for k in ("honest", "calm", "off", "clip"))
        base = {"peers": peers, "rounds": args.rounds, "seeds": args.seeds}
        base["non_iid"] = args.non_iid
        print(
            json.dumps(
                {
                    "attack": "none",
                    **base,
                    "seeds": args.calm_seeds or args.seeds,
                    "attackers": 0,
                    "final_loss": calm["final_loss"],
                    "honest_only_final_loss": honest["final_loss"],
                    "anchor_loss": calm["anchor_loss"],
                    "honest_only_anchor_loss": honest["anchor_loss"],
                    "per_seed": calm["per_seed"],
                    "honest_only_per_seed": honest["per_seed"],
                    "honest_excluded": calm["honest_excluded"],
                    "honest_lowered_in_a_view": calm["honest_lowered_in_a_view"],
                    "honest_clip_rate": calm["honest_clip_rate"],
                    "overhead": calm["wall_s"] / off["wall_s"],
                    "overhead_per_seed": [
                        round(a / b, 3) for a, b in zip(calm["walls"], off["walls"], strict=True)
                    ],
                    "overhead_cpu": calm["cpu_s"] / off["cpu_s"],
                    "scoring_overhead": calm["wall_s"] / clip["wall_s"],
                    "scoring_overhead_cpu": calm["cpu_s"] / clip["cpu_s"],
                }
            ),
            flush=True,
        )
        for fault in args.attacks:
            kw = {"peers": peers, "attackers": attackers, "fault": fault, **common}
            runs = await mean_runs(args.seeds, got=kw, bare={**kw, "score_updates": False})
            got, bare = runs["got"], runs["bare"]
            row = {
                "attack": fault.value,
                **base,
                "attackers": attackers,
                "final_loss": got["final_loss"],
                "honest_only_final_loss": honest["final_loss"],
                "undefended_final_loss": bare["final_loss"],
                "anchor_loss": got["anchor_loss"],
                "honest_only_anchor_loss": honest["anchor_loss"],
                "ratio": got["final_loss"] / honest["final_loss"],
                "per_seed": got["per_seed"],
                "undefended_per_seed": bare["per_seed"],
                "rounds_to_downweight": got["rounds_to_downweight"],
                "honest_excluded": got["honest_excluded"],
                "honest_lowered_in_a_view": got["honest_lowered_in_a_view"],
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
    p.add_argument("--rounds", type=at_least(1), default=40)
    p.add_argument("--seeds", type=at_least(1), default=3)
    p.add_argument(
        "--calm-seeds", type=at_least(0), default=0, help="seeds of the calm row (0: --seeds)"
    )
    p.add_argument("--non-iid", action="store_true")
    p.add_argument("--attacks", type=Fault, nargs="*", default=list(SLOW_POISON))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    asyncio.run(main(args))
