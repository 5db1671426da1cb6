"""Overlapped DiLoCo rounds: the round runs while the next inner steps do; its update lands late.

Blocking DiLoCo stops training for the whole round. Here a due round snapshots this peer's
pseudo-gradient ``Δ_local = θ_anchor - θ`` into the averaging slots, keeps a copy, and starts the
all-reduce in the background. Meanwhile the peer goes on from its local model, exactly as a lone
round does (:func:`~swarm.training.outer.outer_rule`: alone, no outer step), with the anchor
moved to it. When the outcome arrives (at a later step, or at the next due round at the latest,
which then waits for it):

- averaged with ``k`` peers: the anchor goes back to where the round started, the outer step of
  blocking DiLoCo is applied to it with ``Δ̄`` (the same rule, norm bound and momentum as a
  blocking round), and the model restarts from the new anchor plus a share ``MERGE`` of the
  progress made while the round ran: ``θ ← θ_anchor + MERGE (θ - θ_launch)``. Anchor and
  momentum end exactly where blocking DiLoCo's would; a round that lands before any inner step
  ran gives blocking DiLoCo bit for bit;
- not averaged (alone, failed, timed out): nothing to correct. The peer already went on as plain
  local training, which is what the outer rule does with a lone round; the momentum fades.

Keeping all of the in-flight progress diverged on the 4-peer test task when the round spans the
whole inner loop; merely delaying the outer step by one round (the naive delayed update) lets
the outer momentum overshoot and never reached the blocking loss there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from swarm.training.outer import OuterState, OuterStep


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
    def go_on_locally(self) -> None:
        """While the round runs, train on from the local model: the anchor moves to it
        (``θ_anchor - Δ_local``), as after a lone round; momentum and model stay."""
        outer = self.outer
        for anchor, delta in zip(outer.anchor + outer.buffer_anchor, self._local, strict=True):
            anchor.sub_(delta)

    @torch.no_grad()
    def land(self, step: OuterStep, *, nesterov: bool) -> tuple[float | None, float]:
        """Apply the round's outcome (see the module docstring).

        Returns:
            ``(norm, scale)`` of the averaged pseudo-gradient, as
            :meth:`OuterState.apply_outer` reports them; ``(None, 1.0)`` for a lone round.
        """
        outer, n, local = self.outer, len(self.outer.anchor), self._local
        if step.solitary:
            for m in outer.momentum:
                m.mul_(step.beta)  # fades unapplied, as in a blocking lone round
            return None, 1.0
        for anchor, mine, p in zip(outer.anchor, local[:n], outer.tensors.params, strict=True):
            anchor.add_(mine)  # back to the anchor the round started from
            # mine ← θ - θ_launch = θ - (θ_anchor - Δ_local): the progress made in flight
            mine.add_(p.to(mine.device, non_blocking=True)).sub_(anchor)
        for anchor, mine in zip(outer.buffer_anchor, local[n:], strict=True):
            anchor.add_(mine)
        norm = outer.pseudo_grad_norm()
        scale = outer.apply_outer(step, nesterov=nesterov, norm=norm)
        for p, progress in zip(outer.tensors.params, local[:n], strict=True):
            p.add_(progress.to(p.device, non_blocking=True), alpha=MERGE)
        return norm, scale
