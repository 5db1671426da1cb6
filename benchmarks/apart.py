"""The cost of keeping listed pairs apart in a plan of many peers (free identities' lists).

Plans 1024 peers with the real planner (random coordinates in a 300 ms square, groups of 4),
lets ``listers`` of them each list 8 random peers, and times
:func:`swarm.averaging.groups.apart.separate`. Prints one JSON line per setting with
``peers``, ``listers``, ``pairs``, ``pairs_in_groups_before``, ``pairs_in_groups_after`` and
``separate_ms`` (the median of ``--repeats``).

    python benchmarks/apart.py [--peers 1024] [--repeats 5]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import random
import statistics
import time

from swarm.averaging.groups.apart import separate
from swarm.averaging.groups.coordinates import Coordinate
from swarm.averaging.groups.regions import GroupingConfig, GroupPlan, plan_groups
from swarm.identity import PeerID

CONFIG = GroupingConfig(min_group_size=2, target_group_size=4, cross_every=3, region_rtt=0.05)


def _within(plan: GroupPlan, pairs: set[frozenset[PeerID]]) -> int:
    return sum(
        frozenset(pq) in pairs for g in plan.groups.values() for pq in itertools.combinations(g, 2)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(0)
    peers = [PeerID(hashlib.sha256(b"peer %d" % i).digest()) for i in range(args.peers)]
    view = {p: Coordinate((rng.uniform(0, 0.3), rng.uniform(0, 0.3)), 0.001, 0.1) for p in peers}
    plan = plan_groups(view, 5, CONFIG)
    for listers in (16, 256, args.peers):
        pairs = {
            frozenset((p, q))
            for p in rng.sample(peers, listers)
            for q in rng.sample(peers, 8)
            if p != q
        }
        times = []
        for _ in range(args.repeats):
            began = time.perf_counter()
            out = separate(plan, pairs)
            times.append(time.perf_counter() - began)
        print(
            json.dumps(
                {
                    "peers": args.peers,
                    "listers": listers,
                    "pairs": len(pairs),
                    "pairs_in_groups_before": _within(plan, pairs),
                    "pairs_in_groups_after": _within(out, pairs),
                    "separate_ms": round(statistics.median(times) * 1e3, 1),
                }
            )
        )


if __name__ == "__main__":
    main()
