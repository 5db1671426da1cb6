"""Convergence vs bytes: DiLoCo with compression against per-step gradient averaging (DDP-like).

    python benchmarks/convergence.py [--quick] [--peers 4] [--steps 900] [--seeds 3]
        [--codecs none int8 topk:0.01 1bit sparse] [--plot-dir docs]

The task (``convergence_task.py``): a small CNN with BatchNorm on an endless stream of noisy,
shifted images of 10 classes; every peer draws fresh samples at every step, so nothing can be
memorized, and the inner optimizer (AdamW) follows the same warmup and cosine schedule in every
configuration. N peers run in one process (threads, each its own Swarm, loop thread and
loopback port; ``--backend sim``: the engines in one thread with an exact in-memory average):

- ``gradients`` + ``none``: the reference, gradients averaged every step in fp32 (what DDP does);
- ``diloco`` with each codec of ``--codecs`` (error feedback on, overlapped rounds: the defaults).

Every ``--eval-every`` steps each peer evaluates its own model (eval mode, its own BatchNorm
statistics) on a fixed test set. The last step starts a round (``steps`` is a multiple of
``inner_steps``); ``wait_round()`` lands it before any inner step, so each peer holds its
group's new anchor; then ``average_parameters()`` averages the models once more (under a sparse
codec: each model's difference from the shared anchor in 1-bit, the anchors in int8 only where
they differ), so that every peer ends with one model.
``final_loss`` is the mean over peers, averaged over the last ``--last-evals`` evaluation
points (the last one being after that final average), then over seeds, with its spread.

Prints one JSON object per configuration (``mode``, ``codec``, ``peers``, ``seeds``,
``final_loss`` with ``final_loss_min``/``_max``/``_std`` and ``final_loss_per_seed``,
``reference_final_loss``, ``loss_vs_reference``, ``bytes_sent_per_peer``,
``bytes_ratio_vs_reference``, ``final_average_bytes_per_peer`` and
``bytes_ratio_training_rounds`` (without the final average), ``last_point_loss`` and
``last_point_before_final_average`` (the peers' own models just before it), ``diverged``,
``averaged_share``, ``synced_share``, ``step_overhead``, ``peer_spread_per_seed`` and a few
more)
and draws loss vs samples and vs bytes (means over seeds) into PNGs when matplotlib is
installed. ``step_overhead`` is the extra time of ``swarm.step()`` over ``optimizer.step()`` on
steps that do not average. ``peer_spread_per_seed`` is, per seed, the largest difference between
two peers' losses at one evaluation: per-step gradient averaging keeps the peers' models equal,
so above 0 the reference's peers parted (a step whose round failed or split, taken apart, which
nothing but the final average undoes) and its ratio is not to be cited; DiLoCo's peers differ
by their steps since the last round, and under a sparse codec by what their rounds left out.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import threading
import time

import torch
from convergence_task import CLASSES, evaluate, make_model, sample, test_set
from torch import nn

from swarm.api import Swarm

WARMUP = 30  # steps of linear warmup before the cosine decay


def make_optimizer(model: nn.Module, args: argparse.Namespace):
    """AdamW with linear warmup and cosine decay to 10% over ``args.steps`` local steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def factor(step: int) -> float:
        cosine = 0.5 * (1 + math.cos(math.pi * min(step, args.steps) / args.steps))
        return min(1.0, (step + 1) / WARMUP) * (0.1 + 0.9 * cosine)

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def outer_options(args: argparse.Namespace) -> dict:
    """The outer optimizer's settings given on the command line (else the library's defaults)."""
    options = {"outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum}
    return {k: v for k, v in options.items() if v is not None}


def round_options(mode: str, args: argparse.Namespace) -> dict:
    """DiLoCo's rounds blocking or overlapped as given on the command line (else the library's
    default: overlapped); the reference's per-step rounds always block."""
    return {} if args.overlap is None or mode != "diloco" else {"overlap": args.overlap == "on"}


def generator(seed: int, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(1_000_003 * seed + rank)


class Recorder:
    """Evaluations of every peer at the same steps, and bytes and rounds per peer."""

    def __init__(self, n: int):
        self.losses: dict[int, list[float]] = {}  # step -> loss of each peer
        self.sent: dict[int, list[int]] = {}  # step -> bytes sent so far by each peer
        self.bytes = [0] * n
        self.final_bytes = [0] * n  # of the final average_parameters() (in self.bytes too)
        self.before_final = [math.nan] * n  # each peer's own model's loss before it
        self.rounds = [0] * n
        self.averaged = [0] * n
        self.synced = [0] * n  # rounds that also synced anchors (or, gradients: parameters)
        self.lock = threading.Lock()

    def count(self, rank: int, report) -> None:
        self.bytes[rank] += report.bytes_sent
        if report.round_due:
            self.rounds[rank] += 1
            self.averaged[rank] += report.averaged
            self.synced[rank] += report.synced

    def evaluate(self, rank: int, step: int, model: nn.Module, test) -> None:
        loss = evaluate(model, test)
        with self.lock:
            self.losses.setdefault(step, [math.nan] * len(self.bytes))[rank] = loss
            self.sent.setdefault(step, [0] * len(self.bytes))[rank] = self.bytes[rank]

    def result(self, samples_per_step: int, last: int) -> dict:
        steps = sorted(self.losses)
        curve = [
            (s * samples_per_step, statistics.mean(self.sent[s]), statistics.mean(self.losses[s]))
            for s in steps
        ]
        return {
            "curve": curve,
            "final": statistics.mean(c[2] for c in curve[-last:]),
            "final_point": curve[-1][2],
            "before_final_average": statistics.mean(self.before_final),
            "bytes": statistics.mean(self.bytes),
            "final_bytes": statistics.mean(self.final_bytes),
            "averaged_share": sum(self.averaged) / max(sum(self.rounds), 1),
            "synced_share": sum(self.synced) / max(sum(self.rounds), 1),
            "peer_spread": max(
                (max(v) - min(v) for v in self.losses.values() if all(map(math.isfinite, v))),
                default=math.nan,
            ),
        }


def run(mode: str, codec: str, seed: int, args: argparse.Namespace, test) -> dict:
    """One configuration, one seed: ``args.peers`` Swarm peers on loopback, in threads."""
    inner = 1 if mode == "gradients" else args.inner_steps
    n = args.peers
    swarms: list[Swarm | None] = [None] * n
    rec = Recorder(n)
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def peer(rank: int, initial: list[str]) -> None:
        try:
            model = make_model(seed)
            opt, schedule = make_optimizer(model, args)
            with Swarm(
                model,
                opt,
                run_id=f"bench-{mode}-{codec}-{seed}".replace(":", "-"),
                initial_peers=initial,
                listen="127.0.0.1:0",
                mode=mode,
                inner_steps=inner,
                codec=codec,
                min_group_size=2,
                target_group_size=n if mode == "gradients" else args.group_size or n,
                matchmaking_timeout_s=10.0,
                round_timeout_s=60.0,
                **outer_options(args),
                **round_options(mode, args),
            ) as swarm:
                swarms[rank] = swarm
                barrier.wait()
                g = generator(seed, rank)
                for step in range(1, args.steps + 1):
                    x, y = sample(args.batch, g)
                    nn.functional.cross_entropy(model(x), y).backward()
                    rec.count(rank, swarm.step(samples=args.batch))
                    opt.zero_grad(set_to_none=True)
                    schedule.step()
                    if step % args.eval_every == 0 and step < args.steps:
                        rec.evaluate(rank, step, model, test)
                report = swarm.wait_round()  # lands the last round before any inner step
                if report is not None:
                    rec.count(rank, report)
                rec.before_final[rank] = evaluate(model, test)
                barrier.wait()
                # (sparse codecs: the differences from the anchor in 1-bit; see the docstring)
                rec.final_bytes[rank] = swarm.average_parameters().bytes_sent
                rec.bytes[rank] += rec.final_bytes[rank]
                barrier.wait()
                rec.evaluate(rank, args.steps, model, test)
                barrier.wait()
        except BaseException as e:  # reported by the main thread
            errors.append(e)
            barrier.abort()

    start = time.perf_counter()
    first = threading.Thread(target=peer, args=(0, []))
    first.start()
    while swarms[0] is None and first.is_alive():
        time.sleep(0.05)
    threads = [first]
    if swarms[0] is not None:
        threads += [
            threading.Thread(target=peer, args=(r, [swarms[0].address])) for r in range(1, n)
        ]
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    result = rec.result(args.batch * n, args.last_evals)
    result["wall_s"] = time.perf_counter() - start
    return result


def step_overhead(args: argparse.Namespace, backend: str) -> float:
    """Extra time of swarm.step() over optimizer.step() on steps that do not average.

    The two are timed in alternation (median of 9 x 200 steps) so load from other processes
    hits both alike. With ``sim`` the engine's step path is timed without the network (it is the
    same code: a step that does not average never touches the loop thread).
    """
    from swarm.config import SwarmConfig
    from swarm.training.engine import TrainingEngine

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    x, y = sample(args.batch, generator(0, 0))
    nn.functional.cross_entropy(model(x), y).backward()
    swarm = None
    if backend == "swarm":
        swarm = Swarm(model, opt, run_id="overhead", listen="127.0.0.1:0", inner_steps=10**9)
        swarm_step = swarm.step
    else:
        engine = TrainingEngine(model, opt, SwarmConfig.build(inner_steps=10**9))

        def swarm_step() -> None:
            engine.count(None)
            engine.inner_step()
            engine.local_report()

    times: dict[str, list[float]] = {"optimizer": [], "swarm": []}
    try:
        for _ in range(9):
            for name, step in (("optimizer", opt.step), ("swarm", swarm_step)):
                t0 = time.perf_counter()
                for _ in range(200):
                    step()
                times[name].append(time.perf_counter() - t0)
    finally:
        if swarm is not None:
            swarm.close()
    return statistics.median(times["swarm"]) / statistics.median(times["optimizer"]) - 1.0


def mean_curve(runs: list[dict]) -> list[tuple[float, float, float]]:
    """The seeds' curves averaged point by point (they share their evaluation steps)."""
    return [
        tuple(statistics.mean(c[i] for c in points) for i in range(3))
        for points in zip(*(r["curve"] for r in runs), strict=True)
    ]


def plot(curves: dict[str, list], plot_dir: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: plots skipped"
    for xi, label in ((0, "samples"), (1, "bytes sent per peer")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, curve in curves.items():
            ax.plot([c[xi] for c in curve], [c[2] for c in curve], label=name, marker=".")
        ax.set_xlabel(label)
        ax.set_ylabel("test loss (mean over peers and seeds)")
        if xi == 1:
            ax.set_xscale("log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(f"{plot_dir}/convergence_loss_vs_{label.split()[0]}.png", dpi=120)
        plt.close(fig)
    return f"plots written to {plot_dir}"


def summary(name: str, runs: list[dict], reference: dict, args, overhead: float) -> dict:
    mode, codec = name.split("/", 1)
    finals = [r["final"] for r in runs]
    final, ref_final = statistics.mean(finals), reference["final"]
    sent = statistics.mean(r["bytes"] for r in runs)
    final_sent = statistics.mean(r.get("final_bytes", 0) for r in runs)
    return {
        "mode": mode,
        "codec": codec,
        "peers": args.peers,
        "group_size": args.peers if mode == "gradients" else args.group_size or args.peers,
        "steps": args.steps,
        "inner_steps": 1 if mode == "gradients" else args.inner_steps,
        "seeds": len(runs),
        "final_loss": round(final, 5),
        "final_loss_min": round(min(finals), 5),
        "final_loss_max": round(max(finals), 5),
        "final_loss_std": round(statistics.pstdev(finals), 5),
        "final_loss_per_seed": [round(f, 5) for f in finals],
        "last_point_loss": round(statistics.mean(r["final_point"] for r in runs), 5),
        # the peers' own models just before the final average (the last point is after it)
        "last_point_before_final_average": round(
            statistics.mean(r["before_final_average"] for r in runs), 5
        ),
        "reference_final_loss": round(ref_final, 5),
        "loss_vs_reference": round(final / ref_final - 1, 4),
        "bytes_sent_per_peer": int(sent),
        "bytes_ratio_vs_reference": round(reference["bytes"] / max(sent, 1), 1),
        # the final average: nothing where the peers hold one model already (dense codecs);
        # under a sparse one each peer keeps what it left out: a 1-bit round of the models'
        # differences from the anchor (and int8 of the anchors where they differ)
        "final_average_bytes_per_peer": int(final_sent),
        "bytes_ratio_training_rounds": round(reference["bytes"] / max(sent - final_sent, 1), 1),
        # chance is ln(classes): a final loss above it, or not finite, is a divergence
        "diverged": any(not f < math.log(CLASSES) for f in finals),
        "averaged_share": round(statistics.mean(r["averaged_share"] for r in runs), 3),
        # the reference's rounds sync parameters only where its peers' differ (a round missed):
        # its bytes, and every ratio to them, then include about one vector per synced round
        "synced_share": round(statistics.mean(r["synced_share"] for r in runs), 4),
        "peer_spread_per_seed": [round(r["peer_spread"], 4) for r in runs],
        "step_overhead": round(overhead, 4),
        "backend": args.backend,
        "overlap": args.overlap or "default",
        "wall_s": round(sum(r["wall_s"] for r in runs), 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one seed, fewer steps (minutes)")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--inner-steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--outer-lr", type=float, help="default: the library's (0.7)")
    p.add_argument("--outer-momentum", type=float, help="default: the library's (0.9)")
    p.add_argument("--eval-every", type=int, default=60)
    p.add_argument("--last-evals", type=int, default=3, help="evaluations the final loss averages")
    p.add_argument("--test-size", type=int, default=2048)
    p.add_argument(
        "--group-size",
        type=int,
        help="DiLoCo's target group size (default: --peers, one group); the reference's "
        "gradients are always averaged over every peer",
    )
    p.add_argument("--codecs", nargs="+", default=["none", "int8", "topk:0.01", "1bit", "sparse"])
    p.add_argument("--plot-dir", default=".")
    p.add_argument("--backend", choices=["swarm", "sim"], default="swarm")
    p.add_argument(
        "--overlap",
        choices=["on", "off"],
        help="DiLoCo's rounds overlapped or blocking (default: the library's, overlapped; the sim"
        " backend's rounds always block)",
    )
    args = p.parse_args()
    if args.quick:
        args.steps, args.seeds = 300, 1
    if args.group_size is not None and not (
        2 <= args.group_size <= args.peers and args.backend == "swarm"
    ):
        p.error("--group-size takes 2 to --peers, with --backend swarm")
    if args.steps % args.inner_steps or args.steps % args.eval_every:
        p.error("--steps must be a multiple of --inner-steps and of --eval-every")
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    test = test_set(args.test_size)
    if args.backend == "swarm":
        runner = run
    else:
        from convergence_sim import run_simulated as runner
    overhead = step_overhead(args, args.backend)
    configs = [("gradients", "none")] + [("diloco", c) for c in args.codecs]
    results = {
        f"{mode}/{codec}": [runner(mode, codec, s, args, test) for s in range(args.seeds)]
        for mode, codec in configs
    }
    reference = {
        "final": statistics.mean(r["final"] for r in results["gradients/none"]),
        "bytes": statistics.mean(r["bytes"] for r in results["gradients/none"]),
    }
    for name, runs in results.items():
        print(json.dumps(summary(name, runs, reference, args, overhead)), flush=True)
    curves = {name: mean_curve(runs) for name, runs in results.items()}
    print(json.dumps({"note": plot(curves, args.plot_dir)}), flush=True)


if __name__ == "__main__":
    main()
