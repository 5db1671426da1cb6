"""The figures of a many-peer run (tests/many_peers.py), from what each process harvested."""

from __future__ import annotations

import math
import os
import statistics
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from poison_run import BATCH, CLASSES, DIM, test_loss
from torch import nn

if TYPE_CHECKING:
    from many_peers import PeerRun, RunConfig

try:
    import resource  # POSIX only: no memory figure elsewhere
except ImportError:
    resource = None


@dataclass
class Harvest:
    """What one process measured: its hosts (their swarms dropped), the live peers' flat models
    and anchors and test losses at the end, and the process's own counters."""

    runs: list[PeerRun]
    models: list[torch.Tensor]
    anchors: list[torch.Tensor]
    losses: list[float]
    join_s: list[float]
    datagrams: int
    loop_cpu_share: float
    rss_mb: float
    parameters: int
    over_time: list[dict[str, float | None]] = field(default_factory=list)
    # the models and anchors when training stopped, before any finishing round
    trained: list[torch.Tensor] = field(default_factory=list)
    trained_anchors: list[torch.Tensor] = field(default_factory=list)


def figures(config: RunConfig, options: dict[str, Any], harvests: list[Harvest]) -> dict[str, Any]:
    """The run's figures (benchmarks/scale.py's field names) over every process's hosts."""
    runs = [r for h in harvests for r in h.runs]
    fast = [r for r in runs if r.spec.speed >= 1.0]
    slow = [r for r in runs if r.spec.speed < 1.0]
    mm = sorted(x for r in runs for x in r.matchmaking_s)
    slowest_uplink = min(r.spec.uplink_mbit for r in runs)
    groups_with_slow: set[str] = set()
    for r in runs:
        if r.spec.uplink_mbit == slowest_uplink:
            groups_with_slow.update(grp for grp, _ in r.rounds)
    rounds = [(grp, s) for r in runs for grp, s in r.rounds]
    with_slow = [s for grp, s in rounds if grp in groups_with_slow]
    without = [s for grp, s in rounds if grp not in groups_with_slow]
    minutes = config.duration_s / 60
    join_s = sorted(x for h in harvests for x in h.join_s)
    specs = config.specs
    out = {
        "peers": len(runs),
        "processes": len(harvests),
        "parameters": harvests[0].parameters,
        "inner_steps": options["inner_steps"],
        "compute_spread": max(s.speed for s in specs) / min(s.speed for s in specs),
        "uplink_spread_mbit": [
            min(s.uplink_mbit for s in specs),
            max(s.uplink_mbit for s in specs),
        ],
        "churn_per_min": config.churn_per_min,
        "duration_s": config.duration_s,
        "averaged_share": _share(sum(r.averaged for r in runs), sum(r.due for r in runs)),
        "averaged_share_min": min(_share(r.averaged, r.due) for r in runs),
        "matchmaking_p50_s": _quantile(mm, 0.5),
        "matchmaking_p99_s": _quantile(mm, 0.99),
        "utilization_fast": _utilization(fast),
        "utilization_fast_min": min((_utilization([r]) for r in fast), default=None),
        "utilization_slow": _utilization(slow),
        "speed_kept_fast_min": min((speed_kept(r, config.step_s) for r in fast), default=None),
        "round_s_p50": _quantile(sorted(without), 0.5),
        "round_s_p50_slow_member": _quantile(sorted(with_slow), 0.5),
        "consensus_spread": _spread([m for h in harvests for m in h.models]),
        # with finishing rounds: the spread when training stopped, and their group sizes
        "consensus_spread_trained": _spread([m for h in harvests for m in h.trained]),
        "anchor_spread_trained": _spread([a for h in harvests for a in h.trained_anchors]),
        "finish_rounds": config.finish_rounds,
        "finish_group_sizes": _count(str(x) for r in runs for x in r.finished),
        "finish_reasons": _count(x for r in runs for x in r.finish_reasons),
        # per finishing round, the peers that averaged with someone
        "finish_averaged_by_round": [
            sum(len(r.finished) > k and r.finished[k] > 1 for r in runs)
            for k in range(config.finish_rounds)
        ],
        "anchor_spread": _spread([a for h in harvests for a in h.anchors]),
        "dht_msgs_per_peer_per_min": sum(h.datagrams for h in harvests) / len(runs) / minutes,
        "rss_mb_per_peer": sum(h.rss_mb for h in harvests) / len(runs),
        "join_s_p50": _quantile(join_s, 0.5),
        "join_s_max": max(join_s),
        "final_loss": statistics.fmean(x for h in harvests for x in h.losses),
        # when training stopped: the peers' own models, and the plain mean of them
        "trained_loss": _mean_loss([m for h in harvests for m in h.trained], config.hidden),
        "trained_mean_model_loss": _loss_of_mean(
            [m for h in harvests for m in h.trained], config.hidden
        ),
        "samples": sum(r.samples for r in runs),
        "nan": any(r.nan for r in runs),
        "restarts": sum(r.restarts for r in runs),
        "reasons": _count(x for r in runs for x in r.reasons),
        # above about 0.8 an event loop is the bottleneck: figures then measure the harness
        "loop_cpu_share": max(h.loop_cpu_share for h in harvests),
        "per_peer": [
            {
                "speed": r.spec.speed,
                "uplink_mbit": r.spec.uplink_mbit,
                "due": r.due,
                "averaged": r.averaged,
                "utilization": round(_utilization([r]) or 0.0, 3),
                "speed_kept": round(speed_kept(r, config.step_s), 3),
                "samples": r.samples,
            }
            for r in runs
        ],
    }
    samples = [x for h in harvests for x in h.over_time]
    return {**out, "over_time": samples} if samples else out


def speed_kept(run: PeerRun, step_s: float) -> float:
    """The emulated step time over the time ``run``'s steps took, waits for rounds left out:
    under 1 when the shared loop could not keep up with the emulated speed."""
    stepping = run.window_s - run.waited_s
    nominal = run.samples / BATCH * step_s / run.spec.speed
    return nominal / stepping if stepping > 0 else 0.0


def flat(tensors: Any) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def _spread(vectors: list[torch.Tensor]) -> float:
    """Max over peers of ||v - mean|| / ||mean||."""
    mean = torch.stack(vectors).mean(0)
    return max(float((v - mean).norm() / mean.norm()) for v in vectors)


def _utilization(runs: list[PeerRun]) -> float | None:
    wall = sum(r.window_s for r in runs)
    return 1.0 - sum(r.waited_s for r in runs) / wall if wall else None


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def mlp(hidden: int) -> nn.Module:
    """The many-peer runs' model (initialized from the global torch seed)."""
    return nn.Sequential(nn.Linear(DIM, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES))


def _flat_loss(flat: torch.Tensor, hidden: int) -> float:
    """The test loss of :func:`mlp` holding the parameters ``flat``."""
    model = mlp(hidden)
    nn.utils.vector_to_parameters(flat, model.parameters())
    return test_loss(model)


def _mean_loss(flats: list[torch.Tensor], hidden: int) -> float | None:
    return statistics.fmean(_flat_loss(f, hidden) for f in flats) if flats else None


def _loss_of_mean(flats: list[torch.Tensor], hidden: int) -> float | None:
    return _flat_loss(torch.stack(flats).mean(0), hidden) if flats else None


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


def rss_mb() -> float:
    """This process's peak resident memory (MB; NaN where unknown)."""
    if resource is None:
        return math.nan
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10)


def current_rss_mb() -> float | None:
    """This process's resident memory now (MB): Linux's /proc, else the peak (POSIX), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, AttributeError):
        peak = rss_mb()
        return None if math.isnan(peak) else peak


def open_fds() -> int | None:
    """Descriptors open in this process (Linux and macOS; None elsewhere)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder))
        except OSError:
            continue
    return None
