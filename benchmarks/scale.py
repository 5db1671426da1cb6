"""Scale (issue 32): grouping and matchmaking of many peers under churn, and their DHT traffic.

    python benchmarks/scale.py --sim [--peers 1024] [--churn-per-min 0.1] [--minutes 5] [--seed 0]
    python benchmarks/scale.py --real --peers 64 --churn-per-min 0 --minutes 5
    python benchmarks/scale.py --soak 60 --peers 16

``--sim`` runs the discrete-event simulation of tests/scale_sim.py (its docstring says what is
simulated and how) after a 600 s warm-up. In short:

- real code: every due peer computes its group from its OWN view with the library's planner
  (``regions.plan_groups``), whose CPU time is measured (``planner_ms_per_peer_round``,
  perf_counter on this machine: a real figure); every peer's coordinate is the library's
  Vivaldi, fed with simulated pings by the prober's rule; the settings are the library's
  defaults (groups of 2-8, a cross round every 4th, region_rtt 50 ms, matchmaking timeout 15 s,
  heartbeat 10 s, record TTL 30 s, probes every 5 s);
- simulated: the clock, a WAN of five regions (RTTs 5-200 ms), churn (each peer stays an
  exponential time of mean ``1 / churn_per_min`` minutes and is replaced; half leave with a
  leave marker, half are killed), DHT delays and record propagation, and the matchmaking (a
  model of matchmaking.py, tests/scale_sim_match.py). ``averaged_share``, ``matchmaking_p50_s``
  and ``matchmaking_p99_s`` are simulated figures.

``dht_msgs_per_peer_per_min`` counts UDP datagrams (requests and answers) sent, averaged over the
peers. Model, from the code: per minute a peer stores its record ``60 / heartbeat_s`` times (the
heartbeat) plus at most ``60 / probe_period_s`` times (the prober publishes its coordinate after a
probe round that moved it 5 ms or more), and reads the peer list once per round (the plan's own
read), the prober and the heartbeat reading only when no read is younger than the probe period or
``READ_S_PER_RECORD`` per peer, whichever is longer (``T``): ``ceil(round_s / T)`` reads per
round; per round its matchmaking
stores its declaration (once, at most once more per follower when it leads, once "busy" when
grouped) and polls the group key (the simulation counts the polls); every 600 s
(``refresh_interval``) the routing table is refreshed. Each operation costs what it costs on real
DHT nodes of this project: first, ``--dht-nodes`` nodes (default: as many as ``--peers``) start in
this process on loopback (16 subnets of 127.0.0.0/8), each stores a peer record of realistic size
(coordinate and progress: about 650 bytes with its signature), and the datagrams and bytes every
node sends are counted over sequential stores and gets from random nodes (Kademlia with alpha = 3
requests in flight, a store to the k = 20 closest nodes, a get ending at a quorum of 5 holders and
following up to 12 more answer pages from 2 of them; about log2(N) hops). The same calibration
measures how many records one read of the peer list returns: the simulation's views hold no more
(``read_cap``). ``dht_kb_per_peer_per_min`` is the bytes, and ``dht_busiest_node_mb_per_min`` what
the node that sends the most (a holder of the peer list) sends when every peer does this.

Prints one JSON line for the calibration (``setting``: ``dht``), one per round (``sim-round``:
due peers, those averaged in a group of >= 2, group sizes, planner CPU) and one for the run
(``sim``): ``peers``, ``churn_per_min``, ``duration_s``, ``averaged_share`` (due rounds that
averaged in a group of >= 2), ``matchmaking_p50_s``, ``matchmaking_p99_s``,
``dht_msgs_per_peer_per_min``, ``group_size_min``/``group_size_max`` (closed groups, against
``size_bounds``), ``planner_ms_per_peer_round``, and the figures behind them (outcomes by
reason, idle share, view sizes, prediction error of the coordinates).

What-ifs (not the code's behaviour): ``--no-read-cap`` (views hold every record),
``--view-quantum-s Q`` (every peer plans from the records as they stood at the last multiple
of Q seconds). ``--calibration FILE`` saves the calibration, or reuses a saved one.
``--real`` runs ``--peers`` real peers in this process (tests/many_peers.py: real DHT, transport,
averager and DiLoCo engine behind the WAN emulator, emulated compute; its docstring says how)
with speeds ``--speeds`` and uplinks ``--uplinks`` cycled over the peers, and prints one
``real`` line with the fields of issue 32 (``averaged_share``, ``matchmaking_p50_s``/``p99``,
``utilization_fast``/``slow``, ``round_s_p50`` and ``round_s_p50_slow_member`` (rounds of groups
with a peer of the slowest uplink), ``consensus_spread``, ``anchor_spread``,
``dht_msgs_per_peer_per_min``, ``rss_mb_per_peer``, ``final_loss`` and ``equal_final_loss``:
the same peers all at the mean speed, the same total compute), then one ``real-peer`` line per
peer. ``--finish-rounds N``: after training every peer calls ``average_parameters()`` N times,
as a run that should end with one model does; ``consensus_spread`` is then measured after them,
``consensus_spread_trained`` before, and ``finish_group_sizes`` counts their group sizes (1:
averaged with nobody). ``trained_loss`` and ``trained_mean_model_loss`` are the test loss of the
peers' models when training stopped and of their plain mean (``equal_...``: the reference's),
which split a loss ratio into training and the finishing rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from dht_nodes import swarm_of
from scale_sim import RoundStats, SimConfig, World

from swarm.address import PeerAddress
from swarm.averaging.groups.coordinates import Coordinate
from swarm.averaging.groups.group import Declaration
from swarm.averaging.groups.regions import GroupingConfig
from swarm.dht import DHTNode
from swarm.dht.targets import StoreTargets
from swarm.identity import Identity
from swarm.net.progress import Progress, Resources
from swarm.net.record import PeerRecord
from swarm.peer import READ_S_PER_RECORD, peers_key

RUN_ID = "scale-calibration"
REFRESH_INTERVAL_S = 600.0  # DHTNode's default refresh_interval
OPS = 30  # operations of each kind measured


# ---- the DHT calibration (real nodes)


class Datagrams:
    """Datagrams and bytes every node sends, counted at its UDP transport."""

    def __init__(self, nodes: list[DHTNode]):
        self.by_node = [[0, 0] for _ in nodes]
        for counts, node in zip(self.by_node, nodes, strict=True):
            transport = node.protocol.transport  # type: ignore[union-attr]
            send = transport.sendto

            def sendto(data: bytes, addr: Any = None, _send=send, _counts=counts) -> None:
                _counts[0] += 1
                _counts[1] += len(data)
                _send(data, addr)

            transport.sendto = sendto

    def snapshot(self) -> list[tuple[int, int]]:
        return [(c[0], c[1]) for c in self.by_node]


def realistic_record(identity: Identity, node: DHTNode, rng: random.Random) -> bytes:
    """A trainer's record as it sits in the DHT: coordinate and progress in ``extra``."""
    resources = Resources(
        "AMD Ryzen 9 7950X 16-Core Processor", 32, 64 << 30, "NVIDIA RTX 4090", 24 << 30
    )
    progress = Progress(
        "trainer", 1234, 123_456, 312.5, 2.345, 8, "ab12cd34", "int8",
        1.2e6, 1.3e6, 0.93, "public", 3600.0, resources, 500,
    )  # fmt: skip
    coordinate = Coordinate(tuple(rng.uniform(-0.1, 0.1) for _ in range(4)), 0.004, 0.12)
    record = PeerRecord.create(
        identity,
        address=PeerAddress(node.protocol.source_node.ip, node.port),  # type: ignore[union-attr]
        run_id=RUN_ID,
        device="cuda:NVIDIA GeForce RTX 4090",
        bandwidth=12.5e6,
        extra={"vc": coordinate.to_wire(), "rc": [3, -1, 0, 0], "pg": progress.to_wire()},
    )
    return record.serialize()


async def _measure(
    nodes: list[DHTNode], counter: Datagrams, op: Any, rng: random.Random
) -> dict[str, float]:
    """Datagrams and bytes (all nodes) per call of ``op(node, i)``, the busiest node's share."""
    before = counter.snapshot()
    results = []
    for i in range(OPS):
        results.append(await op(rng.choice(nodes), i))
        await asyncio.sleep(0.05)  # stragglers of the last op land before the next starts
    after = counter.snapshot()
    sent = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)]
    busiest = max(sent, key=lambda s: s[1])
    return {
        "datagrams": sum(s[0] for s in sent) / OPS,
        "bytes": sum(s[1] for s in sent) / OPS,
        "busiest_node_bytes": busiest[1] / OPS,
        "result": statistics.mean(results) if results else 0.0,
    }


async def calibrate(count: int, seed: int) -> dict[str, Any]:
    """Datagrams per operation on ``count`` real DHT nodes, each holding a peer record."""
    rng = random.Random(seed)
    identities = [Identity.generate() for _ in range(count)]
    hosts = [f"127.0.{1 + s}.{1 + h}" for s in range(16) for h in range(4)]  # 16 subnets
    started = time.perf_counter()
    async with swarm_of(count, hosts=hosts, identities=identities) as nodes:
        boot_s = time.perf_counter() - started
        counter = Datagrams(nodes)
        for node in nodes:  # every store costed with its lookup (no reuse of recent targets)
            node.targets = StoreTargets(ttl=0.0)
        key = peers_key(RUN_ID)
        records = [realistic_record(i, n, rng) for i, n in zip(identities, nodes, strict=True)]
        expires = time.time() + 600
        for start in range(0, count, 32):
            batch = range(start, min(start + 32, count))
            await asyncio.gather(*(nodes[i].store(key, records[i], expires) for i in batch))
        await asyncio.sleep(0.5)
        index = {id(n): i for i, n in enumerate(nodes)}

        async def store_record(node: DHTNode, i: int) -> int:
            return await node.store(key, records[index[id(node)]], time.time() + 600 + i)

        async def get_records(node: DHTNode, _: int) -> int:
            return len(await node.get(key))

        mm_key = f"{RUN_ID}/mm/calibration"
        declaration = Declaration(PeerRecord.parse(records[0]), time.time() + 60).serialize()

        async def store_declaration(node: DHTNode, i: int) -> int:
            return await node.store(f"{mm_key}/{i % 4}", declaration, time.time() + 60)

        async def get_declarations(node: DHTNode, i: int) -> int:
            return len(await node.get(f"{mm_key}/{i % 4}"))

        async def refresh(node: DHTNode, _: int) -> int:
            await node.refresh_buckets()
            return 0

        for warm in range(4):  # cookies and RTT estimates settle (a running swarm has them)
            await get_records(rng.choice(nodes), warm)
        figures = {
            "peer_list_store": await _measure(nodes, counter, store_record, rng),
            "peer_list_get": await _measure(nodes, counter, get_records, rng),
            "declaration_store": await _measure(nodes, counter, store_declaration, rng),
            "declaration_get": await _measure(nodes, counter, get_declarations, rng),
            "refresh": await _measure(nodes, counter, refresh, rng),
        }
    return {"nodes": count, "bootstrap_s": round(boot_s, 1), **figures}


def calibration_line(cal: dict[str, Any]) -> dict[str, Any]:
    line: dict[str, Any] = {
        "setting": "dht",
        "nodes": cal["nodes"],
        "bootstrap_s": cal["bootstrap_s"],
    }
    for op in (
        "peer_list_store",
        "peer_list_get",
        "declaration_store",
        "declaration_get",
        "refresh",
    ):
        line[f"{op}_datagrams"] = round(cal[op]["datagrams"], 1)
        line[f"{op}_kb"] = round(cal[op]["bytes"] / 1e3, 1)
    line["peer_list_records_read"] = round(cal["peer_list_get"]["result"], 1)
    return line


# ---- the simulation


def dht_per_peer_per_min(
    cal: dict[str, Any], rounds: list[RoundStats], sim: SimConfig, peers: int
) -> dict[str, float]:
    """The message model of the module docstring, with the calibrated cost of each operation."""
    peer, avg = sim.peer, sim.averaging
    due = sum(r.due for r in rounds) or 1  # (a due peer without a key stores nothing)
    rounds_per_min = 60.0 / sim.round_s
    # the prober's and the heartbeat's reads, spaced by the swarm's size (Peer.known_peers)
    background_read_s = max(min(avg.probe_period_s, peer.heartbeat_s), READ_S_PER_RECORD * peers)
    per_min = {
        "peer_list_store": 60.0 / peer.heartbeat_s + 60.0 / avg.probe_period_s,
        "peer_list_get": rounds_per_min * math.ceil(sim.round_s / background_read_s),
        "declaration_store": rounds_per_min * sum(r.stores for r in rounds) / due,
        "declaration_get": rounds_per_min * sum(r.gets for r in rounds) / due,
        "refresh": 60.0 / REFRESH_INTERVAL_S,
    }
    datagrams = sum(n * cal[op]["datagrams"] for op, n in per_min.items())
    kilobytes = sum(n * cal[op]["bytes"] for op, n in per_min.items()) / 1e3
    # every peer's reads of the peer list meet the same few holders: the busiest one's load
    busiest = peers * sum(per_min[op] * cal[op]["busiest_node_bytes"] for op in per_min) / 1e6
    return {
        "dht_msgs_per_peer_per_min": round(datagrams, 1),
        "dht_kb_per_peer_per_min": round(kilobytes, 1),
        "dht_busiest_node_mb_per_min": round(busiest, 1),
    }


def option_pair(pair: str) -> str:
    """argparse ``type`` of ``--option``: refuses what is not ``NAME=VALUE``."""
    name, eq, _ = pair.partition("=")
    if not eq or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, not {pair!r}")
    return pair


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else math.nan


def round_line(r: RoundStats, grouping: GroupingConfig) -> dict[str, Any]:
    """One round: due peers, those averaged in a group of >= 2, group sizes, planner CPU."""
    return {
        "setting": "sim-round",
        "round": r.round,
        "kind": "cross" if grouping.is_cross_round(r.round) else "near",
        "due": r.due,
        "averaged": r.averaged,
        "idle": r.idle,
        "left_mid_round": r.left_mid_round,
        "group_size_min": min(r.group_sizes, default=0),
        "group_size_max": max(r.group_sizes, default=0),
        "matchmaking_p50_s": round(_pct(r.matchmaking_s, 0.5), 2),
        "planner_ms_per_peer": round(1e3 * statistics.mean(r.planner_s), 2) if r.planner_s else 0,
        "view_size_min": min(r.view_sizes, default=0),
        "view_size_max": max(r.view_sizes, default=0),
    }


def run_sim(args: argparse.Namespace) -> None:
    dht_nodes = args.dht_nodes or args.peers
    saved = Path(args.calibration) if args.calibration else None
    if saved is not None and saved.exists():  # a calibration of an earlier run (what-ifs)
        cal = json.loads(saved.read_text())
        dht_nodes = cal["nodes"]
    else:
        cal = asyncio.run(calibrate(dht_nodes, args.seed))
        if saved is not None:
            saved.write_text(json.dumps(cal))
    print(json.dumps(calibration_line(cal)), flush=True)
    records_read = cal["peer_list_get"]["result"]
    read_cap = None if records_read >= dht_nodes - 0.5 or args.no_read_cap else int(records_read)
    sim = SimConfig(
        peers=args.peers,
        churn_per_min=args.churn_per_min,
        minutes=args.minutes,
        seed=args.seed,
        round_s=args.round_s,
        start_spread_s=args.start_spread_s,
        read_cap=read_cap,
        view_quantum_s=args.view_quantum_s,
        read_ahead=not args.no_read_ahead,
    )
    started = time.perf_counter()
    world = World(sim)
    rounds = world.run()
    wall_s = time.perf_counter() - started
    for r in rounds:
        print(json.dumps(round_line(r, world.grouping)), flush=True)
    due = sum(r.due for r in rounds)
    sizes = [s for r in rounds for s in r.group_sizes]
    planned = [s for r in rounds for s in r.planned_sizes]
    matchmaking = [s for r in rounds for s in r.matchmaking_s]
    planner = [s for r in rounds for s in r.planner_s]
    views = [s for r in rounds for s in r.view_sizes]
    reasons: dict[str, int] = {}
    for r in rounds:
        for reason, n in r.reasons.items():
            reasons[reason] = reasons.get(reason, 0) + n
    line = {
        "setting": "sim",
        "peers": args.peers,
        "churn_per_min": args.churn_per_min,
        "duration_s": round(60.0 * args.minutes),
        "averaged_share": round(sum(r.averaged for r in rounds) / max(due, 1), 4),
        "matchmaking_p50_s": round(_pct(matchmaking, 0.5), 2),
        "matchmaking_p99_s": round(_pct(matchmaking, 0.99), 2),
        **dht_per_peer_per_min(cal, rounds, sim, args.peers),
        "group_size_min": min(sizes, default=0),
        "group_size_max": max(sizes, default=0),
        "planned_size_min": min(planned, default=0),
        "planned_size_max": max(planned, default=0),
        "size_bounds": [sim.averaging.min_group_size, sim.averaging.target_group_size],
        "planner_ms_per_peer_round": round(1e3 * statistics.mean(planner), 2) if planner else 0,
        "planner_ms_p99": round(1e3 * _pct(planner, 0.99), 1) if planner else 0,
        "rounds": len(rounds),
        "due_peer_rounds": due,
        "idle_share": round(sum(r.idle for r in rounds) / max(due, 1), 4),
        "left_mid_round": sum(r.left_mid_round for r in rounds),
        "read_cap": read_cap,
        "view_size_min": min(views, default=0),
        "view_size_max": max(views, default=0),
        "rtt_prediction_median_rel_error": round(world.prediction_error(sim.end), 3),
        "outcomes": dict(sorted(reasons.items(), key=lambda kv: -kv[1])),
        "round_s": sim.round_s,
        "start_spread_s": sim.start_spread_s,
        "view_quantum_s": sim.view_quantum_s,
        "seed": args.seed,
        "wall_s": round(wall_s, 1),
    }
    print(json.dumps(line), flush=True)


def main() -> None:
    from scale_real import run_real, run_soak

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    setting = parser.add_mutually_exclusive_group(required=True)
    setting.add_argument("--sim", action="store_true", help="the discrete-event simulation")
    setting.add_argument("--real", action="store_true", help="real peers in one process")
    setting.add_argument(
        "--soak", type=float, metavar="MINUTES", help="--real for MINUTES, sampling memory"
    )
    parser.add_argument("--peers", type=int, help="default: 1024 --sim, 64 --real, 16 --soak")
    parser.add_argument("--churn-per-min", type=float, default=0.1)
    parser.add_argument("--minutes", type=float, default=5.0, help="measured, after a warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--round-s", type=float, default=SimConfig.round_s)
    parser.add_argument("--start-spread-s", type=float, default=SimConfig.start_spread_s)
    parser.add_argument(
        "--dht-nodes", type=int, default=0, help="real DHT nodes calibrated (0: as many as peers)"
    )
    parser.add_argument(
        "--calibration", help="a JSON file: the DHT calibration to reuse, or where to save it"
    )
    parser.add_argument(
        "--no-read-cap",
        action="store_true",
        help="views hold every record even where a real read returns fewer (what-if)",
    )
    parser.add_argument(
        "--view-quantum-s",
        type=float,
        default=None,
        help="what-if: plan from the records as of the last multiple of this (all peers alike)",
    )
    parser.add_argument(
        "--no-read-ahead",
        action="store_true",
        help="the planner reads when its round starts (the code before RoundLookout)",
    )
    real = parser.add_argument_group("--real")
    real.add_argument("--speeds", default="1,0.5,0.25", help="compute speeds, cycled over peers")
    real.add_argument("--uplinks", default="100,50,20,10", help="uplinks in Mbit/s, cycled")
    real.add_argument("--inner-steps", default="3s", help="the peers' inner_steps")
    real.add_argument("--step-s", type=float, default=0.1, help="a 1x step (emulated compute)")
    real.add_argument("--hidden", type=int, default=64, help="the MLP's hidden width")
    real.add_argument(
        "--option",
        type=option_pair,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="another Swarm option for every peer (e.g. probe_period_s=15), repeatable",
    )
    real.add_argument("--no-equal", action="store_true", help="skip the equal-peers reference")
    real.add_argument(
        "--finish-rounds", type=int, default=0, help="average_parameters() calls after training"
    )
    real.add_argument(
        "--processes",
        type=int,
        default=1,
        help="split the peers over this many processes (Linux): one event loop per process",
    )
    args = parser.parse_args()
    if args.peers is None:
        args.peers = 1024 if args.sim else 16 if args.soak else 64
    if not 1 <= args.processes <= args.peers:
        parser.error(f"--processes must be between 1 and --peers ({args.peers})")
    if args.finish_rounds < 0:
        parser.error("--finish-rounds must be 0 or more")
    if args.sim:
        run_sim(args)
    elif args.soak:
        asyncio.run(run_soak(args))
    else:
        asyncio.run(run_real(args))


if __name__ == "__main__":
    main()
