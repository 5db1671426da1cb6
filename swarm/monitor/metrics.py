"""Prometheus metrics of one peer, served at ``/metrics`` on the peer's HTTP port when enabled.

Each peer has its own :class:`~prometheus_client.CollectorRegistry` (several peers may share one
process, as in tests), never the global one. Counters that other parts of the peer keep anyway
(refusals, DHT operations) are read at scrape time by a collector instead of being mirrored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from swarm.monitor.tracker import RoundFigures

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, float("inf"))
REASONS = ("alone", "timeout", "no_group", "partial", "error")


def reason_label(reason: str) -> str:
    """A bounded label for a free-text failure reason (labels must not grow without end)."""
    text = reason.lower()
    if "no other peer" in text or "alone" in text:
        return "alone"
    if "timeout" in text or "timed out" in text:
        return "timeout"
    if "group" in text or "leader" in text or "matchmaking" in text:
        return "no_group"
    if "part" in text:
        return "partial"
    return "error"


@dataclass
class PeerCounts:
    """Counters the peer keeps itself, read by the collector at scrape time."""

    dht_ops: dict[str, int] = field(default_factory=dict)  # "store"/"get" -> count
    dht_failures: dict[str, int] = field(default_factory=dict)
    peers_known: int = 1
    step: int = 0
    round: int = 0
    utilization: float = 1.0


class PeerMetrics:
    """The metrics of one peer. ``refusals`` returns ``{(where, reason): count}`` when scraped."""

    def __init__(self, refusals: Callable[[], dict[tuple[str, str], int]] | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        self.counts = PeerCounts()
        self._refusals = refusals or dict
        r = self.registry
        self.rounds = Counter(
            "swarm_rounds",
            "Averaging rounds by outcome and reason",
            ["outcome", "reason"],
            registry=r,
        )
        self.bytes = Counter(
            "swarm_round_bytes", "Averaging payload bytes", ["direction"], registry=r
        )
        self.round_seconds = Histogram(
            "swarm_round_seconds", "Wall time of a round", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.matchmaking_seconds = Histogram(
            "swarm_matchmaking_seconds",
            "Time to form (or fail to form) a group",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.allreduce_seconds = Histogram(
            "swarm_allreduce_seconds", "All-reduce time", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.group_size = Gauge("swarm_group_size", "Members of the last round's group", registry=r)
        r.register(_Snapshot(self))

    def on_round(self, figures: RoundFigures) -> None:
        if figures.averaged:
            self.rounds.labels("averaged", "").inc()
        else:
            self.rounds.labels("failed", reason_label(figures.reason)).inc()
        self.bytes.labels("sent").inc(figures.bytes_sent)
        self.bytes.labels("received").inc(figures.bytes_received)
        self.round_seconds.observe(figures.seconds)
        self.matchmaking_seconds.observe(figures.matchmaking_s)
        if figures.averaged:
            self.allreduce_seconds.observe(figures.allreduce_s)
        self.group_size.set(figures.group_size)

    def count_dht(self, op: str, failed: bool) -> None:
        c = self.counts
        c.dht_ops[op] = c.dht_ops.get(op, 0) + 1
        if failed:
            c.dht_failures[op] = c.dht_failures.get(op, 0) + 1

    def render(self) -> bytes:
        """The Prometheus text exposition of this peer."""
        return generate_latest(self.registry)


class _Snapshot(Collector):
    def __init__(self, metrics: PeerMetrics):
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        c = self.metrics.counts
        ops = CounterMetricFamily("swarm_dht_operations", "DHT stores and gets", labels=["op"])
        fails = CounterMetricFamily(
            "swarm_dht_failures", "DHT operations that failed or stored nowhere", labels=["op"]
        )
        for op in ("store", "get"):
            ops.add_metric([op], c.dht_ops.get(op, 0))
            fails.add_metric([op], c.dht_failures.get(op, 0))
        refused = CounterMetricFamily(
            "swarm_refused", "Messages refused from other peers", labels=["where", "reason"]
        )
        for (where, reason), n in sorted(self.metrics._refusals().items()):
            refused.add_metric([where, reason], n)
        yield ops
        yield fails
        yield refused
        yield GaugeMetricFamily("swarm_peers_known", "Live peers of the run", value=c.peers_known)
        yield GaugeMetricFamily("swarm_step", "Local optimizer steps", value=c.step)
        yield GaugeMetricFamily("swarm_round", "Completed averaging rounds", value=c.round)
        yield GaugeMetricFamily(
            "swarm_utilization", "Share of wall time computing", value=c.utilization
        )
