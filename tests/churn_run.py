"""Run a swarm of churn_worker processes, SIGKILL and restart some on a schedule, measure.

Shared by tests/test_churn.py and benchmarks/churn.py. The first peers start training together
once all are up (a go-file); the run's clock starts then and ends ``duration_s`` later by
killing every process. Killed peers are restarted ``restart_delay_s`` later through the live
peers' addresses (a late join with a state download). A peer's final loss is its mean test loss
over its rounds of the last few seconds (see :func:`final_loss`); :func:`losses_at_equal_rounds`
compares two runs at the same round instead (the same samples per peer).

With ``warm_restarts`` the replacements are started before the clock and wait, with torch
imported and the model built, for the file that lists the addresses to join through. On two
cores shared by every trainer a cold start takes 5-10 s of Python and torch imports; on a
restarted home PC it takes about one, so the cold figure would measure this machine's load, not
the swarm's rejoin.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from processes import OutputProcess

WORKER = str(Path(__file__).resolve().parent / "churn_worker.py")
# the workers' log lines, the time first, and those above INFO among them (see Life.loud_lines)
LOG_FORMAT = "%(created).3f %(levelname)s %(name)s: %(message)s"
LOUD = re.compile(r"^(\d+\.\d+) (WARNING|ERROR|CRITICAL) ")


@dataclass
class Life:
    """One incarnation of a peer: from its start to its kill or its end."""

    proc: OutputProcess
    slot: int
    restarted: bool
    killed_at: float | None = None
    lines: list[str] = field(default_factory=list)

    def loud_lines(self, until: float) -> list[str]:
        """What it logged above INFO before ``until`` (time.time()): the run's end kills every
        process one after another, and the last ones see the first ones go."""
        loud = []
        for line in self.lines:
            m = LOUD.match(line)
            if m and float(m.group(1)) <= until:
                loud.append(line)
        return loud

    def events(self, kind: str) -> list[dict]:
        # raw_decode: an event's line once carried more text behind its JSON (stdout and stderr
        # share the pipe; 8 workers, 240 s): the event is read, the rest left
        decode = json.JSONDecoder().raw_decode
        return [decode(x[len(kind) + 1 :])[0] for x in self.lines if x.startswith(kind + " ")]


def start_peer(slot: int, seed: int, peers: list[str], stop_at: float, args: list[str]) -> Life:
    argv = [sys.executable, WORKER, "--seed", str(seed), "--stop-at", repr(stop_at), *args]
    if peers:
        argv += ["--initial-peers", *peers]
    return Life(OutputProcess(argv), slot, restarted=bool(seed >= 1000))


@dataclass
class Standby:
    """A replacement process waiting, imports done, for the addresses to join through."""

    life: Life
    peers_file: Path

    @classmethod
    def start(cls, folder: Path, seed: int, stop_at: float, args: list[str]) -> Standby:
        peers_file = folder / f"peers-{seed}"
        life = start_peer(-1, seed, [], stop_at, [*args, "--peers-file", str(peers_file)])
        return cls(life, peers_file)

    def activate(self, slot: int, peers: list[str]) -> Life:
        staged = self.peers_file.with_suffix(".tmp")
        staged.write_text("\n".join(peers))
        staged.replace(self.peers_file)  # whole or absent: the worker polls for it
        self.life.slot = slot
        return self.life


def address(life: Life, timeout: float = 120.0) -> str:
    m = life.proc.wait_for(r'^JOINED .*"address": "([^"]+)"', timeout)
    return m.group(1)


def run_swarm(
    *,
    peers: int,
    duration_s: float,
    kill_fraction: float,
    kill_every_s: float,
    worker_args: list[str],
    round_timeout_s: float,
    restart_delay_s: float = 3.0,
    seed: int = 0,
    final_window_s: float = 5.0,
    warm_restarts: bool = False,
) -> dict:
    """Train ``peers`` peers for ``duration_s`` with churn (``kill_fraction`` 0: a calm run)."""
    folder = Path(tempfile.mkdtemp(prefix="churn-"))
    go = folder / "go"
    args = [*worker_args, "--round-timeout", str(round_timeout_s), "--go-file", str(go)]
    rng = random.Random(seed)
    stop_at = time.time() + duration_s + 600.0  # a safety net: the run ends by killing them
    per_kill = max(1, round(kill_fraction * peers)) if kill_fraction > 0 else 0
    # The last kill leaves a restarted peer time to join and average before the end.
    last_kill_s = duration_s - max(kill_every_s / 2, 2 * round_timeout_s)
    kill_events = math.ceil(last_kill_s / kill_every_s) - 1 if per_kill else 0
    standbys = [
        Standby.start(folder, 1000 * (g + 1) + i, stop_at, args)
        for g in range(max(0, kill_events) if warm_restarts else 0)
        for i in range(per_kill)
    ]
    lives = [start_peer(0, 0, [], stop_at, args)]
    first = address(lives[0])
    lives += [start_peer(i, i, [first], stop_at, args) for i in range(1, peers)]
    live = {life.slot: life for life in lives}
    addresses = {0: first}
    for life in lives[1:]:
        addresses[life.slot] = address(life)
    for standby in standbys:
        standby.life.proc.wait_for(r"^STANDBY", 120.0)
    ready = time.time()  # every first peer is up: the run's clock starts here
    go.touch()
    end = ready + duration_s
    kills, generation = 0, 0
    next_kill = ready + kill_every_s
    try:
        while per_kill and next_kill < ready + last_kill_s:
            time.sleep(max(0.0, next_kill - time.time()))
            victims = rng.sample(sorted(live), per_kill)
            for slot in victims:
                life = live.pop(slot)
                life.proc.kill()
                life.killed_at = time.time()
                addresses.pop(slot, None)
                kills += 1
            time.sleep(restart_delay_s)
            generation += 1
            for slot in victims:
                known = list(addresses.values())
                if standbys:
                    life = standbys.pop(0).activate(slot, known)
                else:
                    life = start_peer(slot, 1000 * generation + slot, known, stop_at, args)
                lives.append(life)
                live[slot] = life
            for slot in victims:
                addresses[slot] = address(live[slot])
            next_kill += kill_every_s
        time.sleep(max(0.0, end - time.time()))
        end = time.time()  # a slow restart may have run late
    finally:
        for standby in standbys:  # unused: the schedule ran late
            standby.life.proc.kill()
        for life in lives:
            life.proc.kill()
            life.lines = list(life.proc.lines)
        shutil.rmtree(folder, ignore_errors=True)
    return metrics(lives, list(live.values()), kills, ready, end, final_window_s)


def final_loss(life: Life, end: float, window_s: float) -> float:
    """A peer's test loss at the end: the mean over its rounds in the last ``window_s``.

    One round's test loss moves by a few percent from round to round near convergence (Adam's
    noise on small batches), so a single round would compare noise with noise. A peer with no
    round in the window counts with the model it holds: as downloaded, or after its last round.
    """
    losses = [(r["t"], r["loss"]) for r in life.events("ROUND") if r["t"] <= end]
    recent = [x for t, x in losses if t >= end - window_s]
    if recent:
        return math.nan if None in recent else statistics.fmean(recent)
    held = [j.get("loss") for j in life.events("JOINED")] + [x for _, x in losses]
    return held[-1] if held and held[-1] is not None else math.nan


def metrics(
    lives: list[Life],
    final: list[Life],
    kills: int,
    ready: float,
    end: float,
    final_window_s: float = 5.0,
) -> dict:
    """The figures of a run (field names as benchmarks/churn.py prints them).

    Rounds count from ``ready`` on: before it the first peers are still starting and the first
    one has nobody to average with.
    """
    rounds = [r for life in lives for r in life.events("ROUND") if ready <= r["t"] <= end]
    gaps, joins = [], []
    for life in lives:
        joined = life.events("JOINED")
        if not joined:
            continue
        start = joined[0]["started"] if life.restarted else max(ready, joined[0]["t"])
        averaged = [r["t"] for r in life.events("ROUND") if r["averaged"]]
        stop = life.killed_at or end
        marks = [start, *averaged, stop]
        gaps += [b - a for a, b in itertools.pairwise(marks)]
        if life.restarted and averaged:
            joins.append(averaged[0] - start)
        elif life.restarted:
            joins.append(stop - start)
    finals = [final_loss(life, end, final_window_s) for life in final]
    return {
        "round_losses": [
            [[r["round"], r["loss"]] for r in life.events("ROUND") if r["t"] <= end]
            for life in final
        ],
        "kills": kills,
        "rounds": len(rounds),
        "averaged_share": sum(r["averaged"] for r in rounds) / max(1, len(rounds)),
        "nan_rounds": sum(r["nan"] for r in rounds),
        "diverging_rounds": sum(r["diverging"] for r in rounds),
        "max_gap_without_average_s": max(gaps, default=math.inf),
        "final_losses": finals,
        "final_loss_mean": statistics.fmean(finals) if finals else math.nan,
        "final_loss_max": max(finals, default=math.nan),
        "join_to_first_average_s_max": max(joins) if joins else None,
        # logged above INFO by any peer before the end (honest peers, all of them: a calm run
        # should log none; with churn the killed peers' partners may)
        "loud_lines": [f"peer {life.slot}: {x}" for life in lives for x in life.loud_lines(end)],
    }


def losses_at_equal_rounds(
    calm: dict, churn: dict, window_share: float = 0.25
) -> tuple[float, list[float], int]:
    """The calm run's mean test loss and each churned final peer's, at the same rounds.

    A run's clock is wall time, and on two cores shared by every trainer the runs of the churn
    test end anywhere between 140 and 240 rounds: that alone moves the final loss by +-4%,
    as much as the effect measured. So this compares the runs at the last round both reached,
    ``R``, each peer's loss being its mean over rounds ``R - window_share * R`` to ``R`` (the test
    loss waves by about 3% from one round to the next, in step across averaging peers). A round
    is ``inner_steps`` local steps of every peer, so equal rounds are equal samples per peer;
    what churn costs per sample shows, what it costs the machine's throughput does not (the
    benchmark measures that at equal wall time).

    Returns:
        (calm mean loss, churned peers' losses, R). A peer with no round in the window counts
        with its last one before it (NaN when it has none).
    """
    runs = calm["round_losses"] + churn["round_losses"]
    end = min((max(r for r, _ in rounds) for rounds in runs if rounds), default=0)
    start = end - max(1, round(window_share * end))

    def loss(rounds: list[list]) -> float:
        recent = [x for r, x in rounds if start < r <= end]
        if not recent:
            recent = [x for r, x in rounds if r <= start][-1:]
        if not recent or None in recent:
            return math.nan
        return statistics.fmean(recent)

    calm_losses = [loss(rounds) for rounds in calm["round_losses"]]
    return statistics.fmean(calm_losses), [loss(r) for r in churn["round_losses"]], end
