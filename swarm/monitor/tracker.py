"""A peer's counters, turned into the :class:`~swarm.net.progress.Progress` it publishes.

The training facade tells the tracker about each round (:meth:`ProgressTracker.on_round`) and the
last loss; the peer asks for a :meth:`ProgressTracker.snapshot` at each heartbeat. Rates are
averaged over the interval between two snapshots, so publishing costs nothing per step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Protocol

from swarm.monitor.resources import machine_resources
from swarm.net.progress import MAX_LOSS, MAX_LOWERED, MAX_RATE, MAX_REASON_CHARS, Progress


class Records(Protocol):
    """What the tracker reads from the peer's records of others (:class:`~swarm.averaging.
    butterfly.scoring.Reputation` has it)."""

    def lowered(self, limit: int) -> tuple[tuple[str, float, str], ...]: ...


class TrainingCounters(Protocol):
    """What the tracker reads from a training engine (:class:`~swarm.training.engine.
    TrainingEngine` has these)."""

    round: int
    step_count: int
    samples_seen: float

    @property
    def utilization(self) -> Any: ...  # .value: share of wall time computing


@dataclass(frozen=True)
class RoundFigures:
    """One finished round as the monitor sees it (from the averaging layer's result)."""

    averaged: bool
    reason: str  # why not averaged ("" when averaged)
    group: str  # short id of the group ("" when none formed)
    group_size: int  # members, this peer included (0 when none formed)
    bytes_sent: int
    bytes_received: int
    seconds: float  # the whole round as the trainer waited for it
    matchmaking_s: float
    allreduce_s: float


class ProgressTracker:
    """Counters of one peer; :meth:`snapshot` makes the published :class:`Progress`."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.engine: TrainingCounters | None = None
        self.codec = ""
        self.records: Records | None = None  # set when this peer scores updates
        self._loss: Any = None  # last loss given to step(): float or detached tensor
        self.last_round: RoundFigures | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self._mark = (self.started, 0.0, 0, 0)  # (time, samples, bytes in, bytes out)
        self._rates = (0.0, 0.0, 0.0)

    def attach(self, engine: TrainingCounters, codec: str) -> None:
        """From now on this peer is a trainer whose counters live in ``engine``."""
        self.engine = engine
        self.codec = codec[:24]

    def note_loss(self, loss: Any) -> None:
        """Remember the script's last loss (a float, a scalar tensor or None).

        A tensor is kept (detached) and read at the next heartbeat, not now: ``.item()`` on a
        CUDA tensor is a CPU-GPU sync, affordable every few seconds but not every step.
        """
        if loss is not None:
            self._loss = loss.detach() if hasattr(loss, "detach") else loss

    @property
    def loss(self) -> float | None:
        """The last loss as a finite float (None when none was given, or it is NaN/inf)."""
        raw = self._loss
        if raw is None:
            return None
        try:
            value = float(raw.item() if hasattr(raw, "item") else raw)
        except (TypeError, ValueError, RuntimeError):
            return None
        return value if math.isfinite(value) and abs(value) <= MAX_LOSS else None

    def on_round(self, figures: RoundFigures) -> None:
        self.last_round = figures
        self.bytes_sent += figures.bytes_sent
        self.bytes_received += figures.bytes_received

    def snapshot(self, *, reachability: str) -> Progress:
        """The progress to publish now; rates cover the time since the previous snapshot."""
        now = time.monotonic()
        e = self.engine
        samples = float(e.samples_seen) if e is not None else 0.0
        then, samples0, in0, out0 = self._mark
        elapsed = now - then
        if elapsed > 0.01:
            self._rates = (
                _rate(samples - samples0, elapsed),
                _rate(self.bytes_received - in0, elapsed),
                _rate(self.bytes_sent - out0, elapsed),
            )
        if elapsed >= 1.0:  # an announce right after another widens the window instead
            self._mark = (now, samples, self.bytes_received, self.bytes_sent)
        last = self.last_round
        utilization = float(e.utilization.value) if e is not None else 1.0
        return Progress(
            role="trainer" if e is not None else "helper",
            round=int(e.round) if e is not None else 0,
            step=int(e.step_count) if e is not None else 0,
            samples_per_s=self._rates[0],
            loss=self.loss,
            group_size=last.group_size if last is not None else 0,
            group=last.group if last is not None else "",
            codec=self.codec,
            bytes_in_per_s=self._rates[1],
            bytes_out_per_s=self._rates[2],
            utilization=min(1.0, max(0.0, utilization)),
            reachability=reachability,
            uptime_s=min(now - self.started, MAX_RATE),
            resources=machine_resources(),
            inner_steps=int(e.cadence.inner_steps) if e is not None else 0,
            lowered=self._lowered(),
        )

    def _lowered(self) -> tuple[tuple[str, float, str], ...]:
        """The lowest records, each reason cut to what the record holds."""
        if self.records is None:
            return ()
        return tuple(
            (p, t, why[:MAX_REASON_CHARS]) for p, t, why in self.records.lowered(MAX_LOWERED)
        )


def _rate(amount: float, seconds: float) -> float:
    return min(max(amount, 0.0) / seconds, MAX_RATE) if seconds > 0 else 0.0
