"""Churn: 8 peers train while 20% of them are SIGKILLed and restarted every 60 s, against calm.

    python benchmarks/churn.py                      # 8 peers, 240 s per run, kills every 60 s
    python benchmarks/churn.py --quick              # 6 peers, 60 s, kills every 15 s

Each peer is a process (tests/churn_worker.py) training the MLP 784-256-10 of
benchmarks/mlp_task.py (Adam 3e-3, batch 64, fresh generated data) with the default mode and
codec (``diloco``, int8), ``inner_steps=16`` and ``target_group_size=4``, on loopback. A killed
peer is restarted 3 s later through the live peers (a late join with a state download). Prints
one JSON object with ``peers``, ``kill_fraction``, ``kill_every_s``, ``duration_s``, ``kills``,
``averaged_share``, ``nan_rounds``, ``max_gap_without_average_s``, ``final_loss_mean``,
``final_loss_max``, ``calm_final_loss_mean``, ``join_to_first_average_s_max``.
Goals: ``final_loss_mean`` <= 1.02 x ``calm_final_loss_mean``, ``final_loss_max`` <= 1.05 x it,
``nan_rounds`` = 0 and ``join_to_first_average_s_max`` <= 10.

The final losses compare the runs at the same wall time, so they include what churn costs in
throughput (and the machine's own swings in it). ``equal_round``, ``final_loss_max_equal_round``
and ``calm_final_loss_mean_equal_round`` compare them at the last round both reached instead
(the same samples per peer; tests/churn_run.py ``losses_at_equal_rounds``).
``calm_loud_lines`` and ``loud_lines`` count what the peers logged above INFO before the end
(the calm run's goal: none); the lines themselves go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from churn_run import losses_at_equal_rounds, run_swarm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", type=int, default=8)
    p.add_argument("--kill-fraction", type=float, default=0.2)
    p.add_argument("--kill-every", type=float, default=60.0)
    p.add_argument("--duration", type=float, default=240.0)
    p.add_argument("--inner-steps", type=int, default=16)
    p.add_argument("--round-timeout", type=float, default=15.0)
    p.add_argument("--quick", action="store_true", help="6 peers, 60 s, kills every 15 s")
    args = p.parse_args()
    if args.quick:
        args.peers, args.duration, args.kill_every = 6, 60.0, 15.0
    settings = {
        "peers": args.peers,
        "duration_s": args.duration,
        "kill_every_s": args.kill_every,
        "round_timeout_s": args.round_timeout,
        "worker_args": [
            "--task",
            "mlp",
            "--inner-steps",
            str(args.inner_steps),
            "--target-group",
            "4",
            "--matchmaking-timeout",
            "5",
        ],
    }
    calm = run_swarm(kill_fraction=0.0, **settings)
    churn = run_swarm(kill_fraction=args.kill_fraction, **settings)
    calm_at_round, churned_at_round, at_round = losses_at_equal_rounds(calm, churn)
    row = {
        "peers": args.peers,
        "kill_fraction": args.kill_fraction,
        "kill_every_s": args.kill_every,
        "duration_s": args.duration,
        "kills": churn["kills"],
        "averaged_share": round(churn["averaged_share"], 3),
        "nan_rounds": churn["nan_rounds"],
        "max_gap_without_average_s": round(churn["max_gap_without_average_s"], 1),
        "final_loss_mean": round(churn["final_loss_mean"], 4),
        "final_loss_max": round(churn["final_loss_max"], 4),
        "calm_final_loss_mean": round(calm["final_loss_mean"], 4),
        "join_to_first_average_s_max": churn["join_to_first_average_s_max"]
        and round(churn["join_to_first_average_s_max"], 1),
        "equal_round": at_round,
        "final_loss_max_equal_round": round(max(churned_at_round), 4),
        "calm_final_loss_mean_equal_round": round(calm_at_round, 4),
        "calm_loud_lines": len(calm["loud_lines"]),
        "loud_lines": len(churn["loud_lines"]),
    }
    for name, run in (("calm", calm), ("churn", churn)):
        for line in run["loud_lines"]:
            print(f"{name} run: {line}", file=sys.stderr)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
