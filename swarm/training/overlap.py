"""Overlapped DiLoCo rounds: the round runs while the next inner steps do; its update lands late.

Blocking DiLoCo stops training for the whole round. Here a due round snapshots this peer's
pseudo-gradient ``Δ_local = θ_anchor - θ`` into the averaging slots, keeps a copy, and starts the
all-reduce in the background. Meanwhile the peer takes an *eager* outer step with its own
``Δ_local`` as the stand-in for the average still in transit (Kale et al. 2025, "Eager updates
for overlapped communication and computation in DiLoCo"), restarts from that anchor and trains
on. When the average ``Δ̄`` arrives (at a later step, or at the next due round at the latest,
which then waits for it) the step is corrected. The Nesterov outer step is linear in ``Δ``::

    m ← β m + Δ ;  u = Δ + β m = (1 + β) Δ + β² m_old ;  θ_anchor ← θ_anchor - lr u

so replacing ``Δ_local`` by ``Δ̄`` afterwards is exact, with ``c = Δ̄ - Δ_local``::

    m ← m + c ;  θ_anchor ← θ_anchor - lr (1 + β) c ;  θ ← θ - lr (1 + β) c

(heavy-ball momentum: ``lr c`` instead of ``lr (1 + β) c``). After the landing, anchor and
momentum are exactly blocking DiLoCo's; only the inner steps that ran while the round was in
flight started from the eager anchor instead of the averaged one, and their progress is kept
(it goes into the next round's pseudo-gradient). A round that lands before any inner step ran
gives blocking DiLoCo bit for bit; a failed round needs no correction (the peer took its own
outer step, as blocking DiLoCo does alone). Merely delaying the outer step by one round instead
(the naive delayed update) lets the outer momentum overshoot: measured on the 4-peer test task
it oscillates and never reaches the blocking run's loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from swarm.training.outer import OuterState


class RoundHandle(Protocol):
    """A round started in the background: a ``concurrent.futures.Future`` or an asyncio task."""

    def done(self) -> bool: ...

    def result(self) -> Any: ...


@dataclass(frozen=True)
class RoundWait:
    """A step's request to its driver: block until ``handle`` is done and send its outcome back."""

    handle: RoundHandle
    timeout: float  # seconds; past it the driver cancels the round and reports a timeout


@dataclass
class Flight:
    """The round in flight: its handle, when it started, and this peer's weight in it."""

    handle: RoundHandle
    started: float  # perf_counter() at launch
    weight: float
    local: list[torch.Tensor] = field(default_factory=list)  # Δ_local, kept for the landing


MERGE = 0.75
"""Share of a peer's own displacement from the anchor that a landing keeps (Streaming DiLoCo's
mixing factor, alpha; measured on the 4-peer test task: 0.5 trains slower, 0.85 diverges when the
round takes the whole inner loop, 0.75 ends at the blocking loss)."""


class Overlap:
    """This peer's pseudo-gradient, kept for the landing, and the landing itself."""

    def __init__(self, outer: OuterState):
        self.outer = outer
        self._local: list[torch.Tensor] = []  # Δ_local of the round in flight

    @torch.no_grad()
    def keep_local(self) -> list[torch.Tensor]:
        """Copy the slots (``Δ_local``, just loaded) before the averager overwrites them."""
        if not self._local:
            self._local = [self.outer.new_like(s) for s in self.outer.slots]
        for mine, slot in zip(self._local, self.outer.slots, strict=True):
            mine.copy_(slot)
        return self._local

    @torch.no_grad()
    def eager_step(self, *, lr: float, beta: float, nesterov: bool) -> None:
        """The outer step with ``Δ_local`` standing in for ``Δ̄`` (the slots stay the
        averager's); the model restarts from the new anchor, as after a blocking round."""
        outer, n, local = self.outer, len(self.outer.anchor), self._local
        for anchor, delta, m, p in zip(
            outer.anchor, local[:n], outer.momentum, outer.tensors.params, strict=True
        ):
            m.mul_(beta).add_(delta)
            anchor.sub_(delta if nesterov else m, alpha=lr)
            if nesterov:
                anchor.sub_(m, alpha=lr * beta)  # u = Δ + βm
            p.copy_(anchor)
        for anchor, delta, b in zip(
            outer.buffer_anchor, local[n:], outer.tensors.buffers, strict=True
        ):
            anchor.sub_(delta)  # floating buffers: anchor - own change, as a lone round
            b.copy_(anchor)

    @torch.no_grad()
    def land(self, *, averaged: bool, lr: float, beta: float, nesterov: bool) -> None:
        """Correct the eager step to the average and merge the model with the corrected
        anchor (see the module docstring). A failed round needs no correction: the peer took
        its own outer step, as blocking DiLoCo does alone (its slots may be half-written)."""
        if not averaged:
            self._merge()
            return
        outer, n = self.outer, len(self.outer.anchor)
        scale = lr * (1 + beta) if nesterov else lr
        local = self._local
        params = zip(
            outer.anchor,
            outer.slots[:n],
            outer.momentum,
            outer.tensors.params,
            local[:n],
            strict=True,
        )
        for anchor, delta, m, p, mine in params:
            c = delta.sub_(mine)  # Δ̄ - Δ_local, in the slot (consumed)
            m.add_(c)
            c.mul_(scale)
            anchor.sub_(c)
            p.sub_(c.to(p.device, non_blocking=True))
        # floating buffers: from anchor - own change to anchor - mean change
        buffers = zip(
            outer.buffer_anchor, outer.slots[n:], outer.tensors.buffers, local[n:], strict=True
        )
        for anchor, delta, b, mine in buffers:
            c = delta.sub_(mine)
            anchor.sub_(c)
            b.sub_(c.to(b.device, non_blocking=True))
        self._merge()

    def _merge(self) -> None:
        """θ ← θ_anchor + a (θ - θ_anchor): keep a share of the progress made in flight."""
        for p, anchor in zip(self.outer.tensors.params, self.outer.anchor, strict=True):
            p.mul_(MERGE).add_(anchor.to(p.device, non_blocking=True), alpha=1 - MERGE)
