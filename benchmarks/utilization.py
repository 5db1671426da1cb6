"""Compute utilization of DiLoCo peers with blocking vs overlapped rounds, and the loss they reach.

Prints one JSON object per line and configuration::

    {"setting": "loopback"|"tbf100"|"tbf10", "peers": N, "params": P, "codec": ..., "overlap": bool,
     "fragments": F, "inner_steps": H, "step_s": ..., "round_s": ..., "utilization": ...,
     "final_loss": ..., "blocking_final_loss": ..., "gpu_mem_overhead_bytes_per_param": null}

Every peer is its own process (this script with ``--peer``) training an MLP on a fixed synthetic
regression task (its own shard) with ``Swarm``; they start training together once every one has
joined (downloaded the state: at 10 Mbit/s that takes a while). The width is chosen so that one
round's transfer takes about as long as the ``inner_steps`` of compute between rounds
(``--inner-steps`` also takes ``auto``, fitted to the link, or a period such as ``10s``: the
steps each peer used are reported as ``inner_steps_used``). Each setting runs once
with ``overlap=False`` and then with ``overlap=True`` once per ``--fragments`` count (Streaming
DiLoCo: ``F`` fragments take turns, a round of ``1/F`` of the model every ``inner_steps / F``
steps), all for the same number of steps; ``blocking_final_loss`` is the first run's loss
(whole-model blocking DiLoCo).

- ``step_s``: median compute seconds of one step (forward, backward, ``swarm.step()`` minus
  the time it blocked on the swarm), median over peers;
- ``round_s``: median seconds of a round from its start to its outcome;
- ``utilization``: compute time / wall time over the timed rounds (after ``--warmup`` rounds),
  i.e. 1 - time blocked on the swarm / wall time, mean over peers;
- ``final_loss``: the mean over peers of the full-data loss after the last round has landed;
- ``agreed_loss``: the same at the peers' anchors, the state they agree on (what a joiner
  downloads). Equal to ``final_loss`` for whole-model rounds; with fragments every fragment but
  the last one averaged still carries the local steps taken since its round;
- ``averaged_share``: share of the peers' timed rounds that averaged with another peer, and
  ``mean_group_size`` their mean group size (0 counted for a round not averaged): overlapped
  peers that drift out of step find fewer partners;
- ``drain_s``: mean seconds a peer waited at the end for its last round to land
  (``wait_round()``). It is counted in ``utilization``, and a run pays it once; the 30 timed
  rounds of the default keep it a few percent of the run (with 8 it was a tenth).
  ``steady_utilization`` leaves it out: the utilization of the training itself, which a run of
  thousands of rounds approaches;

On loopback all peers share this machine's cores, so a background round also slows the compute
of the steps it overlaps. ``tbf100`` (Linux, as root) puts every peer in its own network
namespace behind 100 Mbit/s ``tc tbf`` links both ways, the setting of ``allreduce.py`` (its
namespace code is reused, not copied); ``tbf10`` does the same at 10 Mbit/s, a home uplink.

    python benchmarks/utilization.py [--peers 4] [--width 1024] [--inner-steps 20|auto|10s]
        [--rounds 30] [--settings loopback tbf100 tbf10] [--codec int8] [--min-group 2]
        [--fragments 1 2] [--log-level INFO]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from netns import rate_limited_namespaces, tbf_available  # noqa: E402

DIM, ITEMS = 64, 8192
TBF_SETTINGS = {"tbf100": 100_000_000, "tbf10": 10_000_000}  # setting -> link rate, bits/s


def peer_main(args: argparse.Namespace) -> None:
    import torch

    logging.basicConfig(
        level=args.log_level, format=f"%(relativeCreated)d peer{args.rank} %(name)s: %(message)s"
    )

    from swarm.api import Swarm

    torch.manual_seed(0)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ITEMS, DIM, generator=g)
    y = torch.tanh(x @ torch.randn(DIM, 1, generator=g) / 4)
    model = torch.nn.Sequential(
        torch.nn.Linear(DIM, args.width),
        torch.nn.Tanh(),
        torch.nn.Linear(args.width, args.width),
        torch.nn.Tanh(),
        torch.nn.Linear(args.width, 1),
    )
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    swarm = Swarm(
        model,
        optimizer,
        run_id="utilization",
        initial_peers=args.initial_peers,
        listen=args.listen,
        inner_steps=args.inner_steps,
        codec=args.codec,
        overlap=args.overlap == "on",
        fragments=args.fragments[0],
        min_group_size=args.min_group or args.peers,
        target_group_size=args.peers,
        matchmaking_timeout_s=30.0,
        round_timeout_s=300.0,
    )
    try:
        print(json.dumps({"address": swarm.address}), flush=True)
        deadline = time.monotonic() + 60
        while len(swarm.known_peers()) < args.peers and time.monotonic() < deadline:
            time.sleep(0.2)
        # every peer has joined (downloaded the state) before anyone trains: a joiner's download
        # would otherwise fall in the first peers' timed rounds
        print(json.dumps({"ready": True}), flush=True)
        sys.stdin.readline()
        mine = torch.arange(args.rank, ITEMS, args.peers)
        sample = torch.Generator().manual_seed(100 + args.rank)
        step_times, round_times, waited = [], [], 0.0
        groups: list[int] = []  # group size of each timed round (0: not averaged)
        chosen: list[int] = []  # inner steps in use at each timed round
        start = time.perf_counter()
        due = 0  # rounds due so far; the timed ones follow the first ``--warmup``
        while due < args.warmup + args.rounds:
            timed = due >= args.warmup
            t0 = time.perf_counter()
            idx = mine[torch.randint(len(mine), (args.batch,), generator=sample)]
            torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
            report = swarm.step(samples=args.batch)
            optimizer.zero_grad()
            if timed:
                step_times.append(time.perf_counter() - t0 - report.wait_s)
                waited += report.wait_s
            if report.round_due:
                due += 1
                if timed:
                    round_times.append(report.round_s)
                    groups.append(report.group_size)
                    chosen.append(report.inner_steps)
                elif due == args.warmup:
                    start, waited = time.perf_counter(), 0.0
        t0 = time.perf_counter()
        last = swarm.wait_round()
        drain = time.perf_counter() - t0
        waited += drain
        if last is not None:
            round_times.append(last.round_s)
            groups.append(last.group_size)
        wall = time.perf_counter() - start
        with torch.no_grad():
            loss = torch.nn.functional.mse_loss(model(x), y).item()
            agreed = copy.deepcopy(model)  # at the anchors: the state the peers agree on
            for p, anchor in zip(agreed.parameters(), swarm.engine.outer.anchor, strict=True):
                p.copy_(anchor)
            agreed_loss = torch.nn.functional.mse_loss(agreed(x), y).item()
        print(
            json.dumps(
                {
                    "params": params,
                    "step_s": statistics.median(step_times),
                    "round_s": statistics.median(round_times) if round_times else None,
                    "utilization": max(0.0, 1 - waited / wall),
                    "steady_utilization": max(0.0, 1 - (waited - drain) / (wall - drain)),
                    "final_loss": loss,
                    "agreed_loss": agreed_loss,
                    "drain_s": drain,
                    "groups": groups,
                    "inner_steps": statistics.median(chosen) if chosen else None,
                }
            ),
            flush=True,
        )
        time.sleep(2.0)  # let the others finish their last round with us
    finally:
        swarm.close()


def inner_steps_arg(text: str) -> int | str:
    """``--inner-steps``: a count, ``auto`` or a duration, as ``SwarmConfig`` takes it."""
    from swarm.round_schedule import parse_inner_steps

    try:
        return parse_inner_steps(text, 1, 1, 1)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run(args: argparse.Namespace, setting: str, overlap: str, fragments: int, places) -> list[dict]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    common = [sys.executable, __file__, "--peer", "--overlap", overlap]
    common += ["--peers", str(args.peers), "--width", str(args.width), "--codec", args.codec]
    common += ["--inner-steps", str(args.inner_steps), "--rounds", str(args.rounds)]
    common += ["--warmup", str(args.warmup), "--batch", str(args.batch)]
    common += ["--min-group", str(args.min_group), "--fragments", str(fragments)]
    common += ["--log-level", args.log_level]
    procs: list[subprocess.Popen] = []
    address = ""
    try:
        for rank, (prefix, ip) in enumerate(places):
            extra = ["--rank", str(rank), "--listen", f"{ip}:0"]
            if rank:
                extra += ["--initial-peers", address]
            procs.append(
                subprocess.Popen(
                    [*prefix, *common, *extra],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env=env,
                )
            )
            if rank == 0:
                if not (line := procs[0].stdout.readline()):
                    raise RuntimeError(f"peer 0 exited before listening ({setting})")
                address = json.loads(line)["address"]
        for rank, proc in enumerate(procs):  # the start barrier: go once every peer has joined
            while '"ready"' not in (line := proc.stdout.readline()):
                if not line:
                    raise RuntimeError(f"peer {rank} exited before joining ({setting})")
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outputs = [p.communicate(timeout=1800)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    rows = [
        json.loads(line) for out in outputs for line in out.splitlines() if '"final_loss"' in line
    ]
    if len(rows) != args.peers:
        raise RuntimeError(
            f"{args.peers - len(rows)} peer(s) did not report ({setting}, {overlap}, {fragments})"
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--listen", default="127.0.0.1:0", help=argparse.SUPPRESS)
    p.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    p.add_argument("--overlap", default="on", help=argparse.SUPPRESS)
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument(
        "--inner-steps",
        type=inner_steps_arg,
        default=20,
        help='steps between rounds: a count, "auto" (fitted to the link) or a duration ("10s")',
    )
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--codec", default="int8")
    p.add_argument("--min-group", type=int, default=0, help="min_group_size (default: every peer)")
    p.add_argument("--settings", nargs="+", default=["loopback", "tbf100"])
    p.add_argument("--log-level", default="WARNING", help="the peers' logging level (stderr)")
    p.add_argument(
        "--fragments", type=int, nargs="+", default=[1], help="overlapped runs' fragment counts"
    )
    args = p.parse_args()
    if args.rounds < 1 or args.warmup < 0:
        p.error("--rounds must be >= 1, --warmup >= 0")
    if any(f < 1 for f in args.fragments):
        p.error("every --fragments count must be >= 1")
    from swarm.round_schedule import parse_inner_steps

    for fragments in args.fragments:
        try:
            parse_inner_steps(args.inner_steps, fragments, 1, 10**9)
        except ValueError as e:
            p.error(str(e))
    if args.peer:
        peer_main(args)
        return
    for setting in args.settings:
        if setting in TBF_SETTINGS and (why := tbf_available()):
            print(f"skipping {setting}: {why}", file=sys.stderr)
            continue
        blocking = None
        for overlap, fragments in [("off", 1), *(("on", f) for f in args.fragments)]:
            if setting in TBF_SETTINGS:
                with rate_limited_namespaces(args.peers, TBF_SETTINGS[setting]) as places:
                    rows = run(args, setting, overlap, fragments, places)
            else:
                places = [([], f"127.0.0.{i + 1}") for i in range(args.peers)]
                rows = run(args, setting, overlap, fragments, places)
            final = statistics.mean(r["final_loss"] for r in rows)
            blocking = final if overlap == "off" else blocking
            rounds = [r["round_s"] for r in rows if r["round_s"] is not None]
            groups = [g for r in rows for g in r["groups"]]
            print(
                json.dumps(
                    {
                        "setting": setting,
                        "peers": args.peers,
                        "params": rows[0]["params"],
                        "codec": args.codec,
                        "overlap": overlap == "on",
                        "fragments": fragments,
                        "inner_steps": args.inner_steps,
                        "inner_steps_used": statistics.median(
                            r["inner_steps"] for r in rows if r["inner_steps"] is not None
                        ),
                        "step_s": round(statistics.median(r["step_s"] for r in rows), 4),
                        "round_s": round(statistics.median(rounds), 3) if rounds else None,
                        "utilization": round(statistics.mean(r["utilization"] for r in rows), 3),
                        "steady_utilization": round(
                            statistics.mean(r["steady_utilization"] for r in rows), 3
                        ),
                        "final_loss": float(f"{final:.4g}"),
                        "agreed_loss": float(
                            f"{statistics.mean(r['agreed_loss'] for r in rows):.4g}"
                        ),
                        "blocking_final_loss": float(f"{blocking:.4g}"),
                        "gpu_mem_overhead_bytes_per_param": None,
                        "drain_s": round(statistics.mean(r["drain_s"] for r in rows), 3),
                        "averaged_share": round(sum(g > 0 for g in groups) / len(groups), 3),
                        "mean_group_size": round(statistics.mean(groups), 2),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
