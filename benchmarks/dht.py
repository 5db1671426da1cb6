"""DHT benchmark: bootstrap time, store/get latency and success, memory, with and without churn.

    python benchmarks/dht.py                       # 64, 256 and 1024 nodes
    python benchmarks/dht.py --nodes 1024 --ops 300

The nodes are spread over ``--processes`` worker processes (one event loop cannot fairly host a
thousand nodes); every node binds its own UDP port on loopback. Operations run one at a time,
each from a random node of one worker, so a latency is one operation's, not a queue's. After the
healthy measurement, the worker holding ~10% of the nodes is killed without warning (SIGKILL on
POSIX, TerminateProcess on Windows) and the same operations run again at once: gets of every key
stored before (those the dead nodes held included) and fresh stores with their gets.

Prints one JSON object per configuration: nodes, killed_fraction, success_rate, get_p50_ms,
get_p90_ms, store_p50_ms, store_p90_ms, bootstrap_s, bootstrap_empty (nodes whose routing table
was empty after joining, their initial peer too busy to answer in time: they join again by
themselves), budget_refusals (what the nodes refused each other for a per-host or per-subnet
budget so far: every node here shares one loopback address, the worst case for those budgets;
0 means honest traffic never met them), rss_mb_per_node (the growth of the workers' resident
memory while creating their nodes, per node), plus the operation counts and the host's 1-minute
load average (load_avg_1m).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from typing import Any

HOST = "127.0.0.1"
BUDGET_REFUSALS = (
    "datagrams_over_rate",
    "public_key_work_over_budget",
    "stores_refused_unchecked",
    "new_slots_over_rate",
)


def rss_mb() -> float:
    """This process's resident memory (Linux /proc, else the peak from ``resource``, else 0)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, AttributeError):
        pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (2**20 if sys.platform == "darwin" else 2**10)
    except ImportError:
        return 0.0


def worker_main(conn: Any, seed: int) -> None:
    asyncio.run(_serve(conn, seed))


async def _serve(conn: Any, seed: int) -> None:
    from swarm.auth import Membership
    from swarm.dht import DHTNode
    from swarm.identity import Identity

    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    nodes: list[DHTNode] = []
    while True:
        cmd, *args = await loop.run_in_executor(None, conn.recv)
        if cmd == "start":
            count, bootstrap, timeout = args
            before = rss_mb()
            for _ in range(count):
                nodes.append(
                    await DHTNode.create(
                        Identity.generate(),
                        Membership.open(),
                        host=HOST,
                        port=0,
                        request_timeout=timeout,
                    )
                )
            if bootstrap is None:  # the very first node of the swarm: others join through it
                bootstrap = f"{HOST}:{nodes[0].port}"
                joining = nodes[1:]
            else:
                joining = nodes
            unjoined = 0  # nodes left with no contact: they rejoin by themselves
            for start in range(0, len(joining), 8):
                counts = await asyncio.gather(
                    *(n.bootstrap([bootstrap]) for n in joining[start : start + 8])
                )
                unjoined += counts.count(0)
            conn.send((bootstrap, rss_mb() - before, unjoined))
        elif cmd in ("store", "get"):
            results = []
            for key, value in args[0]:
                node = rng.choice(nodes)
                started = time.perf_counter()
                try:
                    if cmd == "store":
                        ok = await node.store(key, value, time.time() + 600) > 0
                    else:
                        ok = value in [e.value for e in (await node.get(key)).values()]
                except Exception as e:  # a benchmark counts failures, it does not stop on them
                    print(f"{cmd} {key}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                    ok = False
                if not ok and cmd == "get":
                    print(f"get {key}: not found", file=sys.stderr, flush=True)
                results.append((ok, (time.perf_counter() - started) * 1000))
            conn.send(results)
        elif cmd == "counters":
            conn.send(sum(node.counters()[name] for node in nodes for name in BUDGET_REFUSALS))
        elif cmd == "stop":
            for node in nodes:
                await node.close()
            conn.send(None)
            return


class Worker:
    def __init__(self, ctx: Any, index: int):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child, index), daemon=True)
        self.proc.start()
        self.count = 0

    def ask(self, *message: Any) -> Any:
        self.conn.send(message)
        return self.conn.recv()


def spread(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def run_ops(workers: list[Worker], kind: str, items: list[tuple[str, bytes]], rng: random.Random):
    """Each item from a random worker, one worker batch at a time; returns (oks, latencies)."""
    by_worker: dict[int, list[tuple[str, bytes]]] = {}
    for item in items:
        by_worker.setdefault(rng.randrange(len(workers)), []).append(item)
    oks, latencies = [], []
    for index, batch in sorted(by_worker.items()):
        for ok, ms in workers[index].ask(kind, batch):
            oks.append(ok)
            latencies.append(ms)
    return oks, latencies


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 2)


def report(
    nodes: int,
    killed: float,
    boot_s: float,
    rss: float,
    stores,
    gets,
    unjoined: int,
    workers: list[Worker],
) -> dict[str, Any]:
    oks = stores[0] + gets[0]
    return {
        "nodes": nodes,
        "killed_fraction": round(killed, 3),
        "success_rate": round(sum(oks) / len(oks), 4),
        "get_p50_ms": pct(gets[1], 50),
        "get_p90_ms": pct(gets[1], 90),
        "store_p50_ms": pct(stores[1], 50),
        "store_p90_ms": pct(stores[1], 90),
        "bootstrap_s": round(boot_s, 2),
        "bootstrap_empty": unjoined,
        "budget_refusals": sum(w.ask("counters") for w in workers),
        "rss_mb_per_node": round(rss, 3),
        "stores": len(stores[0]),
        "gets": len(gets[0]),
        "failed_stores": len(stores[0]) - sum(stores[0]),
        "failed_gets": len(gets[0]) - sum(gets[0]),
        "load_avg_1m": load_average(),
    }


def load_average() -> float | None:
    """The host's 1-minute load average (None where the OS has none): latencies on a shared,
    busy host are queueing delays, not the DHT's."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def bench(total: int, processes: int, ops: int, kill: float, timeout: float) -> list[dict]:
    ctx = mp.get_context("spawn")
    rng = random.Random(total)
    workers = [Worker(ctx, i) for i in range(processes)]
    try:
        counts = spread(total, processes)
        started = time.perf_counter()
        bootstrap, rss0, unjoined = workers[0].ask("start", counts[0], None, timeout)
        rss = [rss0]
        for w, count in zip(workers[1:], counts[1:], strict=True):
            w.conn.send(("start", count, bootstrap, timeout))
        for w in workers[1:]:
            _, grown, failed = w.conn.recv()
            rss.append(grown)
            unjoined += failed
        boot_s = time.perf_counter() - started
        rss_per_node = sum(rss) / total

        items = [(f"bench/{i}", b"value-%d" % i) for i in range(ops)]
        stores = run_ops(workers, "store", items, rng)
        gets = run_ops(workers, "get", items, rng)
        out = [report(total, 0.0, boot_s, rss_per_node, stores, gets, unjoined, workers)]
        print(json.dumps(out[-1]), flush=True)

        if kill > 0:
            victims = max(1, round(processes * kill))
            dead = workers[-victims:]
            for w in dead:
                w.proc.kill()
                w.proc.join()
            killed = sum(counts[-victims:]) / total
            alive = workers[:-victims]
            fresh = [(f"bench/after/{i}", b"after-%d" % i) for i in range(ops)]
            old_gets = run_ops(alive, "get", items, rng)
            new_stores = run_ops(alive, "store", fresh, rng)
            new_gets = run_ops(alive, "get", fresh, rng)
            gets = (old_gets[0] + new_gets[0], old_gets[1] + new_gets[1])
            out.append(
                report(total, killed, boot_s, rss_per_node, new_stores, gets, unjoined, alive)
            )
            print(json.dumps(out[-1]), flush=True)
            workers = alive
        return out
    finally:
        for w in workers:
            if w.proc.is_alive():
                with contextlib.suppress(EOFError, OSError):
                    w.ask("stop")
                w.proc.join(timeout=10)
                if w.proc.is_alive():
                    w.proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--processes", type=int, default=10)
    parser.add_argument("--ops", type=int, default=200, help="stores (and as many gets) per run")
    parser.add_argument("--kill", type=float, default=0.1, help="fraction of nodes killed")
    parser.add_argument("--request-timeout", type=float, default=3.0)
    args = parser.parse_args()
    for total in args.nodes:
        bench(total, min(args.processes, total), args.ops, args.kill, args.request_timeout)


if __name__ == "__main__":
    main()
