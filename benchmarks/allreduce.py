"""Butterfly all-reduce of N peer processes on loopback: time, bytes and memory per round.

Prints one JSON object per line and configuration::

    {"n": peers, "numel": elements, "codec": ..., "setting": "loopback",
     "matchmaking_s": ..., "allreduce_s": ..., "bytes_sent_per_peer": ...,
     "rss_before_mb": ..., "peak_rss_mb": ..., "round_growth_vectors": ...,
     "kept_vectors": ..., "transient_vectors": ..., "cpu_s_per_round": ...,
     "loop_cpu_s_per_round": ..., "worker_cpu_s_per_round": ...,
     "efficiency": null, "rounds": ...}

Every peer is its own process (this script with ``--peer``) bound to its own 127.0.0.x address,
with one :class:`~swarm.averaging.Averager` (``grouping="fixed"``, min = target = N, gather
window ``--gather-window``, 50 ms by default: peers whose first DHT reads missed each other
start two leaders, and the larger leader merges into the smaller, so a short window no longer
splits the group). Each runs a warm-up round, then ``--rounds`` timed rounds of one float32
tensor, every round started by all peers at once (this script is their barrier): a base shared
by every peer plus 10% of noise of its own (:func:`peer_vector`).
``allreduce_s`` and ``matchmaking_s`` are the medians over the timed rounds of the slowest peer
of each round; ``bytes_sent_per_peer`` is the mean payload a peer streamed per round;
``peak_rss_mb`` is the largest peak resident set of any peer process (tensors included),
``rss_before_mb`` the largest before the first round (its vector made), and
``round_growth_vectors`` the largest growth of one peer over its own ``rss_before_mb``, in
vectors (the goal for a streaming round is at most 1.5); on Linux, ``kept_vectors`` what a peer
holds resident between rounds once they ran (its error-feedback residuals, state like an
optimizer's, and the freed pages glibc keeps) and ``transient_vectors`` the growth within the
first timed round over the live memory just before it (``VmHWM`` after ``clear_refs``, the
free heap pages given back first: the median round time then comes from the others);
``round_s`` the median of the slowest peer's matchmaking + all-reduce; ``cpu_s_per_round`` the CPU
seconds of all peer processes together per timed round, and on Linux ``loop_cpu_s_per_round``
and ``worker_cpu_s_per_round`` its parts on the peers' event loops and in their other threads
(:mod:`thread_cpu`; ``raw`` peers report none). Rounds
in which some peer did not average (matchmaking split the peers) are left out and counted in
``failed_rounds``.

``efficiency`` = ideal / measured with ideal = 2 (N-1)/N x payload bytes / link rate, i.e. the
bytes a peer streams in a round over its link rate. On loopback there is no link rate: all peers
share this machine's cores, and the figure that limits a round is CPU (AEAD, copies, reduction),
so it is reported as null.

``tbf100`` (Linux, as root): every peer runs in its own network namespace, joined to the others
through a veth pair on one bridge; both directions of each veth are limited by ``tc ... tbf`` to
100 Mbit/s, like a home connection with a symmetric 100 Mbit/s line. The namespaces are removed
afterwards, also on errors.

``raw`` (a codec name only this script knows) is the ceiling of the setting, not swarm: every
peer opens two plain TCP connections to every other (as many as a butterfly's streams and
replies) and writes, on all of them at once, as many bytes as ``none`` streams in a round,
spread evenly; ``allreduce_s`` is the slowest peer's time until it has read everything, with no
encryption, no reduction and no waiting for anyone's average. Swarm adds those and the coupling
of a butterfly (an owner's average goes out only as fast as its slowest sender), while its
replies start before its streams end, which can put it above ``raw`` on short rounds.

    python benchmarks/allreduce.py [--n 2 4 8] [--numel 4M 25M] [--rounds 5]
        [--codecs none fp16 int8 topk 1bit raw] [--settings loopback tbf100]
        [--configs 4:25M:none 4:25M:raw]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from netns import rate_limited_namespaces, tbf_available
from rss import RoundMemory, peak_rss_mb
from thread_cpu import LoopAndWorkers

ROOT = Path(__file__).resolve().parent.parent
CODECS = {"none": "none", "fp16": "fp16", "int8": "int8", "topk": "topk:0.01", "1bit": "1bit"}
TBF_RATE_BITS = 100_000_000


def parse_numel(text: str) -> int:
    units = {"K": 1_000, "M": 1_000_000}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


# ---- one peer process


def print_usage(
    cpu_start: float,
    rounds: int,
    rss_before_mb: float,
    memory: RoundMemory | None = None,
    threads: LoopAndWorkers | None = None,
) -> None:
    """This peer process's last line: its resident set before the first round (the peak so far,
    its vector included), its peak, CPU seconds per timed round and, where /proc tells, what
    it keeps between rounds, the largest growth within a timed round and its CPU seconds on the
    event loop and in the other threads."""
    cpu = (time.process_time() - cpu_start) / max(rounds, 1)
    usage = {"rss_before_mb": rss_before_mb, "peak_rss_mb": peak_rss_mb(), "cpu_s_per_round": cpu}
    if memory is not None:
        usage.update(memory.usage())
    if threads is not None:
        usage.update(threads.usage(rounds))
    print(json.dumps(usage), flush=True)


RAW_PORT = 47_311
RAW_WRITE = 1 << 20


def raw_bytes_per_link(n: int, numel: int) -> int:
    """What ``raw`` writes on each of a peer's 2 (n - 1) connections: the float32 bytes a
    ``none`` butterfly streams per peer, 2 (n - 1) / n x 4 numel, spread evenly."""
    return 4 * numel // n


async def raw_peer_main(args: argparse.Namespace) -> None:
    """``raw``: plain TCP all-to-all rounds; a line on stdin starts each (the barrier)."""
    peers = args.initial_peers  # every peer's host, in rank order (this one included)
    me, per_link = args.seed, raw_bytes_per_link(args.n, args.numel)
    expected = per_link * 2 * (args.n - 1)  # per round
    # counted over all rounds: a faster peer's bytes may arrive before this one's round starts
    received, target, everything = 0, expected, asyncio.Event()

    async def read_all(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal received
        while data := await reader.read(RAW_WRITE):
            received += len(data)
            if received >= target:
                everything.set()
        writer.close()

    server = await asyncio.start_server(read_all, peers[me], RAW_PORT)
    block = bytes(RAW_WRITE)

    async def write_all(host: str) -> None:
        for _ in range(50):  # the others' servers may start a moment later
            try:
                _, writer = await asyncio.open_connection(host, RAW_PORT)
                break
            except OSError:
                await asyncio.sleep(0.1)
        else:
            raise RuntimeError(f"cannot connect to {host}")
        left = per_link
        while left > 0:
            writer.write(block[: min(left, RAW_WRITE)])
            left -= min(left, RAW_WRITE)
            await writer.drain()
        writer.close()
        await writer.wait_closed()

    loop = asyncio.get_running_loop()
    others = [host for i, host in enumerate(peers) if i != me]
    rss_before = peak_rss_mb()
    cpu_start = 0.0
    for rnd in range(args.rounds + 1):
        if rnd == 1:  # after the warm-up round
            cpu_start = time.process_time()
        print(json.dumps({"ready": rnd}), flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)
        target = expected * (rnd + 1)
        if received >= target:  # already here (or nothing to receive: a single peer)
            everything.set()
        else:
            everything.clear()
        started = time.perf_counter()
        await asyncio.gather(*(write_all(host) for host in others for _ in range(2)))
        await everything.wait()
        row = {"round": rnd, "averaged": True, "reason": "", "matchmaking_s": 0.0}
        row.update(allreduce_s=time.perf_counter() - started, bytes_sent=per_link * len(others) * 2)
        print(json.dumps(row), flush=True)
    print_usage(cpu_start, args.rounds, rss_before)
    await asyncio.sleep(0.5)  # the others' last connections end
    server.close()
    await server.wait_closed()


async def peer_main(args: argparse.Namespace) -> None:
    import torch

    from swarm.averaging import Averager, AveragingConfig
    from swarm.config import PeerConfig
    from swarm.peer import Peer

    torch.set_num_threads(1)
    config = PeerConfig(
        run_id="bench-allreduce",
        listen=args.listen,
        initial_peers=tuple(args.initial_peers),
        heartbeat_s=args.heartbeat,
        metrics=args.status == "on",
    )
    peer = await Peer.start(config)
    peer.monitoring = args.status == "on"  # progress in the record, join/leave watch
    scraper = (
        asyncio.create_task(scrape_forever(f"http://{peer.address}/metrics", args.scrape_interval))
        if args.status == "on" and args.scrape_interval > 0
        else None
    )
    print(json.dumps({"address": str(peer.address)}), flush=True)
    averager = Averager(
        peer,
        AveragingConfig(
            codec=CODECS.get(args.codec, args.codec),
            min_group_size=args.n,
            target_group_size=args.n,
            matchmaking_timeout_s=5.0,
            round_timeout_s=305.0,
            gather_window_s=args.gather_window,
            grouping="fixed",
            threads=2,
            aggregator=args.aggregator,
        ),
    )
    try:
        deadline = time.monotonic() + 60
        while len(await peer.known_peers()) < args.n and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        tensor = peer_vector(args.numel, args.seed)
        rss_before = peak_rss_mb()
        memory, threads = RoundMemory(), LoopAndWorkers()
        cpu_start = 0.0
        for rnd in range(args.rounds + 1):
            if rnd == 1:  # after the warm-up round
                cpu_start = time.process_time()
                threads.start()
            print(json.dumps({"ready": rnd}), flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            if rnd == 1:  # one timed round only: the heap trim before it costs page faults
                memory.start()
            started = time.perf_counter()
            result = await averager.average([tensor], weight=1.0)
            if rnd == 1:
                memory.end()
            if args.status == "on":  # what the training facade does after every round
                peer.record_round(result.figures(time.perf_counter() - started))
            row = {
                "round": rnd,
                "averaged": result.averaged,
                "reason": result.reason,
                "matchmaking_s": result.matchmaking_s,
                "allreduce_s": result.allreduce_s,
                "bytes_sent": result.bytes_sent,
            }
            print(json.dumps(row), flush=True)
        print_usage(cpu_start, args.rounds, rss_before, memory, threads)
        await asyncio.sleep(0.5)  # let the others read their last replies
    finally:
        if scraper is not None:
            scraper.cancel()
            await asyncio.gather(scraper, return_exceptions=True)
        await averager.close()
        await peer.close()


def peer_vector(numel: int, seed: int, spread: float = 0.1, span: int = 1 << 20):
    """A base vector shared by every peer plus ``spread`` of the peer's own noise, made in
    place (a temporary of the vector's size would raise the peak RSS measured before the
    round). Real peers average correlated values; independent ones would put every honest
    average sqrt(N / (N - 1)) of a member's own values away from them, which owner checks
    rightly find implausible."""
    import torch

    tensor = torch.randn(numel, generator=torch.Generator().manual_seed(1 << 30))
    own, noise = torch.Generator().manual_seed(seed), torch.empty(span)
    for start in range(0, numel, span):
        piece = tensor[start : start + span]
        mine = noise[: piece.numel()].normal_(generator=own)
        piece.add_(mine, alpha=spread)
    return tensor


async def scrape_forever(url: str, interval: float) -> None:
    """A Prometheus server's part: GET /metrics every ``interval`` seconds."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        while True:
            await asyncio.sleep(interval)
            async with session.get(url) as response:
                await response.read()


# ---- the coordinator


def run_config(
    n: int,
    numel: int,
    codec: str,
    rounds: int,
    gather_window: float,
    setting: str = "loopback",
    extra: tuple[str, ...] = (),
) -> dict:
    """One configuration; ``extra`` are more peer-process flags (e.g. ``--status off``)."""
    if setting == "tbf100":
        with rate_limited_namespaces(n, TBF_RATE_BITS) as places:
            return _run_config(n, numel, codec, rounds, gather_window, setting, places, extra)
    places = [([], f"127.0.0.{60 + i}") for i in range(n)]
    return _run_config(n, numel, codec, rounds, gather_window, setting, places, extra)


def _run_config(
    n: int,
    numel: int,
    codec: str,
    rounds: int,
    gather_window: float,
    setting: str,
    places: list[tuple[list[str], str]],
    extra: tuple[str, ...] = (),
) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    if codec == "raw":
        outputs = _run_raw(n, numel, rounds, places, env)
        return _summary(n, numel, codec, setting, rounds, outputs)
    common = [
        sys.executable,
        __file__,
        "--peer",
        *("--n", str(n), "--numel", str(numel), "--codec", codec, "--rounds", str(rounds)),
        *("--gather-window", str(gather_window)),
        *extra,
    ]
    procs: list[subprocess.Popen] = []
    try:
        first = subprocess.Popen(
            [*places[0][0], *common, "--listen", f"{places[0][1]}:0", "--seed", "0"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        procs.append(first)
        assert first.stdout is not None
        address = json.loads(first.stdout.readline())["address"]
        for i in range(1, n):
            procs.append(
                subprocess.Popen(
                    [
                        *places[i][0],
                        *common,
                        "--listen",
                        f"{places[i][1]}:0",
                        "--seed",
                        str(i),
                        "--initial-peers",
                        address,
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env=env,
                )
            )
        outputs = _rounds_in_step(procs, rounds)
    finally:
        _kill_all(procs)
    return _summary(n, numel, codec, setting, rounds, outputs)


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _run_raw(
    n: int, numel: int, rounds: int, places: list[tuple[list[str], str]], env: dict[str, str]
) -> list[str]:
    """The ``raw`` ceiling's peer processes; this process is their barrier between rounds."""
    hosts = [host for _, host in places]
    procs: list[subprocess.Popen] = []
    try:
        for i, (prefix, _) in enumerate(places):
            cmd = [*prefix, sys.executable, __file__, "--peer", "--codec", "raw"]
            cmd += ["--n", str(n), "--numel", str(numel), "--rounds", str(rounds)]
            cmd += ["--seed", str(i), "--initial-peers", *hosts]
            procs.append(
                subprocess.Popen(
                    cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
                )
            )
        return _rounds_in_step(procs, rounds)
    finally:
        _kill_all(procs)


def _rounds_in_step(procs: list[subprocess.Popen], rounds: int) -> list[str]:
    """Start every round of the peer processes together (each prints ``{"ready": ...}`` and
    waits for a line on its stdin); their whole outputs. Without it, a peer that finished the
    last round late (at 250M values on 2 cores, by many seconds) misses the others' matchmaking."""
    lines: list[list[str]] = [[] for _ in procs]
    for _ in range(rounds + 1):
        for i, p in enumerate(procs):  # everyone finished the last round and is ready
            assert p.stdout is not None
            while '"ready"' not in (line := p.stdout.readline()):
                if not line:
                    raise RuntimeError("a peer process exited")
                lines[i].append(line)
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
    return [
        "".join(done) + p.communicate(timeout=600)[0] for done, p in zip(lines, procs, strict=True)
    ]


def _summary(n: int, numel: int, codec: str, setting: str, rounds: int, outputs: list[str]) -> dict:
    rows = [
        [json.loads(line) for line in out.splitlines() if line.startswith("{")] for out in outputs
    ]
    per_round = [[r for r in peer_rows if "round" in r and r["round"] > 0] for peer_rows in rows]
    if any(len(r) != rounds for r in per_round):
        raise RuntimeError("a peer process did not report every round")
    # a round counts when every peer averaged in it (a split matchmaking fails the round)
    ok = [i for i in range(rounds) if all(rs[i]["averaged"] for rs in per_round)]
    if not ok:
        why = [
            f"round {i + 1}: "
            + " | ".join(f"{rs[i]['averaged']} {rs[i]['reason']}" for rs in per_round)
            for i in range(rounds)
        ]
        raise RuntimeError("every round failed (each peer: averaged, reason):\n" + "\n".join(why))
    slowest = [max(rs[i]["allreduce_s"] for rs in per_round) for i in ok]
    whole = [max(rs[i]["matchmaking_s"] + rs[i]["allreduce_s"] for rs in per_round) for i in ok]
    matchmaking = [max(rs[i]["matchmaking_s"] for rs in per_round) for i in ok]
    sent = statistics.mean(rs[i]["bytes_sent"] for rs in per_round for i in ok)
    usage = [r for peer_rows in rows for r in peer_rows if "peak_rss_mb" in r]
    rss = max(r["peak_rss_mb"] for r in usage)
    before = max(r["rss_before_mb"] for r in usage)
    growth = max(r["peak_rss_mb"] - r["rss_before_mb"] for r in usage)
    vector_mib = numel * 4 / 2**20
    kept = [r["kept_mb"] for r in usage if r.get("kept_mb") is not None]
    transient = [r["transient_mb"] for r in usage if r.get("transient_mb") is not None]
    cpu = sum(r["cpu_s_per_round"] for peer_rows in rows for r in peer_rows if "peak_rss_mb" in r)
    loop = [r.get("loop_cpu_s_per_round") for r in usage]
    workers = [r.get("worker_cpu_s_per_round") for r in usage]
    return {
        "n": n,
        "numel": numel,
        "codec": codec,
        "setting": setting,
        "matchmaking_s": round(statistics.median(matchmaking), 4),
        "allreduce_s": round(statistics.median(slowest), 4),
        "round_s": round(statistics.median(whole), 4),
        "bytes_sent_per_peer": int(sent),
        "rss_before_mb": round(before, 1),
        "peak_rss_mb": round(rss, 1),
        # the largest growth of one peer over its RSS before the first round, in vectors
        "round_growth_vectors": round(growth / vector_mib, 2),
        # what a peer keeps between rounds (error-feedback residuals, reused buffers) and the
        # largest growth within one timed round over the RSS just before it (Linux only)
        "kept_vectors": round(max(kept) / vector_mib, 2) if kept else None,
        "transient_vectors": round(max(transient) / vector_mib, 2) if transient else None,
        "cpu_s_per_round": round(cpu, 4),  # all peer processes together, timed rounds only
        # of it, on the peers' event loops and in their other threads (Linux only)
        "loop_cpu_s_per_round": round(sum(loop), 4) if None not in loop else None,
        "worker_cpu_s_per_round": round(sum(workers), 4) if None not in workers else None,
        "efficiency": (
            round(sent * 8 / TBF_RATE_BITS / statistics.median(slowest), 3)
            if setting == "tbf100"
            else None
        ),
        "rounds": len(ok),
        "failed_rounds": rounds - len(ok),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--numel", nargs="+", default=["4M", "25M"])
    p.add_argument("--codecs", nargs="+", default=list(CODECS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--settings", nargs="+", default=["loopback"])
    p.add_argument("--gather-window", type=float, default=0.05, help="matchmaking gather window")
    p.add_argument("--configs", nargs="*", default=[], help="explicit N:NUMEL:CODEC triples")
    # peer-process options (internal)
    p.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--codec", default="none", help=argparse.SUPPRESS)
    p.add_argument(
        "--aggregator",
        default=os.environ.get("SWARM_BENCH_AGGREGATOR", "centered_clip"),
        choices=["centered_clip", "mean"],
        help="how part owners reduce (the peers inherit it)",
    )
    p.add_argument("--listen", default="127.0.0.1:0", help=argparse.SUPPRESS)
    p.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--status", choices=["on", "off"], default="on", help=argparse.SUPPRESS)
    p.add_argument("--heartbeat", type=float, default=5.0, help=argparse.SUPPRESS)
    p.add_argument("--scrape-interval", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    os.environ["SWARM_BENCH_AGGREGATOR"] = args.aggregator  # for the peer processes
    if args.peer:
        args.n, args.numel = args.n[0], parse_numel(args.numel[0])
        asyncio.run(raw_peer_main(args) if args.codec == "raw" else peer_main(args))
        return
    settings = [x for x in args.settings if x in ("loopback", "tbf100")]
    for unknown in set(args.settings) - set(settings):
        print(f"unknown setting {unknown!r}: use loopback or tbf100", file=sys.stderr)
    if "tbf100" in settings and (why := tbf_available()) is not None:
        print(f"tbf100 skipped: {why}", file=sys.stderr)
        settings.remove("tbf100")
    if args.configs:
        configs = [c.split(":") for c in args.configs]
        configs = [(int(n), parse_numel(m), c) for n, m, c in configs]
    else:
        configs = list(itertools.product(args.n, [parse_numel(m) for m in args.numel], args.codecs))
    for setting in settings:
        for n, numel, codec in configs:
            row = run_config(n, numel, codec, args.rounds, args.gather_window, setting)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
