"""hivemind's all-reduce beside ``allreduce.py``: the same peers, vectors and barrier, on loopback.

The reference the project measures its round time against, on the same machine and in the
same way, so that a figure from one day is not compared with one from another (round times
on these 2-core machines vary by half from day to day). Prints one JSON object per
configuration with the fields of ``allreduce.py`` that apply::

    {"impl": "hivemind 1.1.12", "n": 4, "numel": 25000000, "codec": "int8",
     "setting": "loopback", "allreduce_s": ..., "rounds": 5, "failed_rounds": 0}

Every peer is its own process with its own ``hivemind.DHT`` and ``DecentralizedAverager``
(target and minimum group size N, compression ``none`` = ``NoCompression``, ``fp16`` =
``Float16Compression``, ``int8`` = ``BlockwiseQuantization``: bitsandbytes' 8-bit blockwise).
Each round the peer starts a step that must wait for a trigger, waits until its group is
found, and reports ready; once every peer is ready this script lets them all go at once (as
``allreduce.py`` does), and ``allreduce_s`` is the median over the timed rounds (after one
warm-up) of the slowest peer's time from the trigger to its averaged tensor: matchmaking left
out, like swarm's ``allreduce_s``. hivemind averages in a background process and moves bytes
through its libp2p daemon, so this script's CPU time says nothing and is not reported.

hivemind is not a dependency of this project, and its pins (protobuf, pydantic) do not mix
with a development environment: install it in a virtual environment of its own, with the
same torch, and run this script with that environment's python::

    python -m venv /tmp/hivemind && /tmp/hivemind/bin/pip install torch==2.13.0 \\
        hivemind==1.1.12 bitsandbytes
    /tmp/hivemind/bin/python benchmarks/hivemind_allreduce.py [--configs 4:25M:none 4:25M:int8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version

from allreduce import _kill_all, _rounds_in_step, parse_numel, peer_vector
from arguments import at_least

COMPRESSIONS = ("none", "fp16", "int8")


def peer_main(args: argparse.Namespace) -> None:
    import hivemind
    import torch
    from hivemind.averaging.control import AveragingStage
    from hivemind.compression import BlockwiseQuantization, Float16Compression, NoCompression

    torch.set_num_threads(1)
    dht = hivemind.DHT(
        start=True,
        initial_peers=args.initial_peers or None,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
    )
    if not args.initial_peers:
        print(json.dumps({"maddrs": [str(m) for m in dht.get_visible_maddrs()]}), flush=True)
    compression = {
        "none": NoCompression,
        "fp16": Float16Compression,
        "int8": BlockwiseQuantization,
    }[args.codec]()
    averager = hivemind.averaging.DecentralizedAverager(
        [peer_vector(args.numel, args.seed)],
        dht,
        start=True,
        prefix="bench-allreduce",
        target_group_size=args.n,
        min_group_size=args.n,
        min_matchmaking_time=2.0,
        request_timeout=5.0,
        compression=compression,
    )
    waiting = (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP)
    try:
        for rnd in range(args.rounds + 1):
            control = averager.step(wait=False, require_trigger=True, timeout=120)
            while control.stage in waiting and not control.done():
                time.sleep(0.005)
            print(json.dumps({"ready": rnd}), flush=True)
            sys.stdin.readline()
            started = time.perf_counter()
            try:  # a step that failed while it looked for its group is done already
                control.allow_allreduce()
                averaged = control.result() is not None
            except Exception as e:  # a round that failed counts as such, like swarm's
                print(json.dumps({"error": repr(e)}), file=sys.stderr, flush=True)
                averaged = False
            row = {"round": rnd, "averaged": averaged, "allreduce_s": time.perf_counter() - started}
            print(json.dumps(row), flush=True)
    finally:
        averager.shutdown()
        dht.shutdown()


def run_config(n: int, numel: int, codec: str, rounds: int) -> dict:
    base = [sys.executable, __file__, "--peer", "--n", str(n), "--numel", str(numel)]
    base += ["--codec", codec, "--rounds", str(rounds)]

    def start(seed: int, initial: list[str]) -> subprocess.Popen:
        command = [*base, "--seed", str(seed), "--initial-peers", *initial]
        env = {**os.environ, "HIVEMIND_LOGLEVEL": "WARNING"}
        pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
        return subprocess.Popen(command, **pipes, text=True, env=env)

    procs = [start(0, [])]
    try:
        assert procs[0].stdout is not None
        maddrs = json.loads(procs[0].stdout.readline())["maddrs"]
        procs += [start(seed, maddrs) for seed in range(1, n)]
        outputs = _rounds_in_step(procs, rounds)
    finally:
        _kill_all(procs)
    rows = [
        [json.loads(line) for line in out.splitlines() if line.startswith("{")] for out in outputs
    ]
    per_peer = [[r for r in peer if r.get("round", 0) > 0] for peer in rows]
    ok = [i for i in range(rounds) if all(timed[i]["averaged"] for timed in per_peer)]
    if not ok:
        raise RuntimeError(f"no round averaged at {n}:{numel}:{codec}")
    slowest = [max(timed[i]["allreduce_s"] for timed in per_peer) for i in ok]
    return {
        "impl": f"hivemind {version('hivemind')}",
        "n": n,
        "numel": numel,
        "codec": codec,
        "setting": "loopback",
        "allreduce_s": round(statistics.median(slowest), 4),
        "rounds": len(ok),
        "failed_rounds": rounds - len(ok),
    }


def config(text: str) -> tuple[int, int, str]:
    """``N:NUMEL:CODEC`` (e.g. ``4:25M:int8``), checked before any configuration runs."""
    try:
        n, numel, codec = text.split(":")
        peers, values = int(n), parse_numel(numel)
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"expected N:NUMEL:CODEC, got {text!r}") from None
    if peers < 2 or values < 1 or codec not in COMPRESSIONS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: N >= 2, NUMEL >= 1 and CODEC one of {COMPRESSIONS}"
        )
    return peers, values, codec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # a list default is not passed through ``type``: parse it here
    default = [config("4:25M:none"), config("4:25M:int8")]
    p.add_argument("--configs", type=config, nargs="+", default=default)
    p.add_argument("--rounds", type=at_least(1), default=5)
    p.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--numel", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--codec", default="none", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.peer:
        peer_main(args)
        return
    try:
        version("hivemind")
    except PackageNotFoundError:
        sys.exit("hivemind is not installed here; see this script's docstring")
    for n, numel, codec in args.configs:
        print(json.dumps(run_config(n, numel, codec, args.rounds)), flush=True)


if __name__ == "__main__":
    main()
