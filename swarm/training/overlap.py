"""Overlapped DiLoCo rounds: the round runs while the next inner steps do; its update lands late.

Blocking DiLoCo stops training for the whole round. Here a due round snapshots this peer's
pseudo-gradient ``Δ_local = θ_anchor - θ`` into the averaging slots, keeps a copy (and of the
anchor and momentum it starts from), and starts the all-reduce in the background. Meanwhile the
peer takes an *eager* outer step with its own ``Δ_local`` standing in for the average still in
transit (Kale et al. 2025, "Eager updates for overlapped communication and computation in
DiLoCo"), with the outer rule of the group size it averaged with last time
(:func:`~swarm.training.outer_rule.outer_rule`: a peer that was alone takes no step and simply
goes on from its local model), restarts from that anchor and trains on. When the outcome
arrives (at a later step, or at the next due round at the latest, which then waits for it):

- averaged with ``k`` peers: anchor and momentum go back to where the round started and take
  blocking DiLoCo's outer step with ``Δ̄`` (the same rule for ``k``, the same norm bound), so
  they end exactly where a blocking round would;
- not averaged (alone, failed, timed out): anchor and momentum become what a blocking lone round
  gives (no outer step: the anchor is the model at launch; the momentum fades).

Either way the eager anchor ``θ_eager`` was a guess, off by ``e = θ_eager - θ_anchor``, and the
model trained from it. The model keeps all its progress and follows a share of the anchor's
correction, ``θ ← θ - s · e``: all of it for a round that lands before any inner step ran
(blocking DiLoCo bit for bit), falling to :data:`CORRECTION` for one that took the whole inner
loop (see :func:`landing_share`).

Floating buffers (BatchNorm's running statistics) keep their progress in flight and follow none
of the correction: the forward passes in flight re-estimated them for the weights being
trained, and their new anchor (the group's mean) reaches them through the next round's change
``anchor - b``. Resetting them to the anchor, at a landing one inner loop late, threw away every
statistic of the loop: the next round's change was zero and the swarm's statistics froze while
the weights grew (4-peer CNN: running variance at 0.04x the true one, evaluation loss 20-50
against 1.0 with batch statistics). A share of the correction could also push a running
variance below zero, which the statistics themselves never reach.

Merely delaying the outer step by one round (the naive delayed update) lets the outer momentum
overshoot; measured on the 4-peer test task it oscillates and never reaches the blocking loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from swarm.training.outer import OuterState
from swarm.training.outer_rule import OuterStep


class RoundHandle(Protocol):
    """A round started in the background: a ``concurrent.futures.Future`` or an asyncio task."""

    def done(self) -> bool: ...

    def result(self) -> Any: ...


@dataclass(frozen=True)
class RoundWait:
    """A step's request to its driver: block until ``handle`` is done and send its outcome back."""

    handle: RoundHandle
    timeout: float  # seconds; past it the driver cancels the round and reports a timeout


@dataclass(frozen=True)
class Flight:
    """The round in flight: its handle and when it started."""

    handle: RoundHandle
    started: float  # perf_counter() at launch
    fragment: int = 0  # the model fragment it averages (see ``fragments`` in SwarmConfig)


CORRECTION = 0.5
"""Share of the anchor's correction ``e`` that the model follows at a landing a whole inner loop
late (see :func:`landing_share` for earlier landings).

Inner steps from ``θ_eager`` already undid part of ``e``: in a direction the inner loop shrinks
by a factor ``c`` (0: a stiff direction, forgotten at once; 1: a flat one, untouched), the model
is off by ``c · e`` from where it would be had it started at the true anchor. Following the
share ``s`` leaves ``(c - s) · e``. ``e`` grows with this peer's own pseudo-gradient minus the
group's, which the eager step amplified by about ``lr (1 + β)``, so an error left at one round
comes back at the next one multiplied by ``|c - s| · lr (1 + β)`` (``lr (1 + β)`` is 1.33 with
lr 0.7, β 0.9). Following all of it (``s = 1``, moving the progress made in flight onto the
true anchor) diverges when the round takes the whole inner loop (stiff directions, ``c ≈ 0``);
following none leaves the factor at 1.33 in flat ones (``c ≈ 1``). 1/2 bounds it by 0.67 for
every ``c``."""


def landing_share(steps_in_flight: int, steps_per_round: int) -> float:
    """Share of the anchor's correction the model follows at a landing ``steps_in_flight`` inner
    steps after the launch, of ``steps_per_round`` in a round.

    It falls linearly from 1 (no step in flight: blocking DiLoCo bit for bit) to
    :data:`CORRECTION` when the round took the whole loop. A few steps shrink ``e`` only in the
    stiffest directions (``c ≈ 1`` nearly everywhere), where a fixed 1/2 leaves about half of
    ``e`` in the model: this peer's own pseudo-gradient minus its group's, times
    ``lr (1 + β) / 2``, a different push in every model. Measured against blocking DiLoCo at
    the same steps (in-memory engines, ``tests/lockstep.py``, rounds landing 1-3 ticks late),
    the falling share stays near it: 0.88-1.15x with 16 peers in groups of 4 redrawn every
    round (speeds 4x/1x or equal, SGD or Adam), where the fixed 1/2 gave anything from 0.65x
    to 5.2x; 0.91-0.94x with 4 peers in one group (1/2: 0.80-0.94x). 64 real peers of speeds
    1x/0.25x (``benchmarks/scale.py --real``, rounds landing about 1 s into 30 s) ended at
    0.96-0.99x the equal peers' loss over 5 seeds, against 0.97-1.18x with the fixed 1/2.
    """
    if steps_in_flight <= 0:
        return 1.0
    late = min(1.0, steps_in_flight / max(1, steps_per_round))
    return 1.0 - (1.0 - CORRECTION) * late


class Overlap:
    """This peer's pseudo-gradient, kept for the landing, and the landing itself."""

    def __init__(self, outer: OuterState, keeps_unsent: bool = False):
        self.outer = outer
        # error feedback in the model (OuterState.keep_unsent, whose plain step keeps no
        # momentum): the eager step then guesses no averaged change, and the model keeps its
        # own progress on top of the guess
        self.keeps_unsent = keeps_unsent
        self._held = False  # the model holds Δ_local beyond the eager anchor
        self._local: list[torch.Tensor] = []  # Δ_local of the round in flight
        self._anchor0: list[torch.Tensor] = []  # the anchors (parameters, buffers) it started from
        self._momentum0: list[torch.Tensor] = []  # the momentum it started from

    @property
    def launch_anchors(self) -> list[torch.Tensor]:
        """The anchors (parameters, then floating buffers) the round in flight started from.

        Nothing but the round touches them until it lands, so a round that also syncs anchors
        averages these in place (see ``anchor_sync_every``): the landing then starts from the
        group's mean anchor, which pulls peers that missed rounds back to the others.
        """
        return self._anchor0

    @torch.no_grad()
    def keep_local(self) -> None:
        """Copy the slots (``Δ_local``, just loaded) before the averager overwrites them, and
        the anchors and momentum the round starts from."""
        outer = self.outer
        anchors = outer.anchor + outer.buffer_anchor
        if not self._local:
            self._local = outer.flat_like(outer.slots)
            self._anchor0 = outer.flat_like(anchors)  # a sync averages it in place
            self._momentum0 = [outer.new_like(m) for m in outer.momentum]
        for copies, sources in (
            (self._local, outer.slots),
            (self._anchor0, anchors),
            (self._momentum0, outer.momentum),
        ):
            for mine, source in zip(copies, sources, strict=True):
                mine.copy_(source)

    @torch.no_grad()
    def eager_step(self, step: OuterStep, *, nesterov: bool) -> None:
        """The outer step with ``Δ_local`` standing in for ``Δ̄`` (the slots stay the
        averager's); the model restarts from the new anchor, as after a blocking round.

        With error feedback in the model, ``Δ_local`` is mostly what earlier rounds left out
        (a sparse round delivers a few percent of it), a poor guess of ``Δ̄``: the step then
        guesses no change (the anchor stays; its plain step keeps no momentum to move it) and
        the model keeps all its local progress on top, ``θ_anchor - Δ_local``. :meth:`land`
        gives ``Δ_local`` back by the share the model follows of the anchor's correction, and
        the engine takes out what the round left out by the same share
        (:meth:`OuterState.keep_unsent`): the model keeps what it did not deliver and follows
        the group for what it did.
        """
        outer, n, local = self.outer, len(self.outer.anchor), self._local
        params = zip(outer.anchor, local[:n], outer.tensors.params, strict=True)
        self._held = self.keeps_unsent and not step.solitary
        for i, (anchor, delta, p) in enumerate(params):
            if step.solitary:
                anchor.sub_(delta)  # the model as it is: plain local training
                continue
            if self._held:  # the anchor stays where it is
                p.copy_(anchor).sub_(delta.to(p.device, non_blocking=True))
                continue
            m = outer.momentum[i]
            m.mul_(step.beta).add_(delta)
            anchor.sub_(delta if nesterov else m, alpha=step.lr)
            if nesterov:
                anchor.sub_(m, alpha=step.lr * step.beta)  # u = Δ + βm
            p.copy_(anchor)
        for anchor, delta, b in zip(
            outer.buffer_anchor, local[n:], outer.tensors.buffers, strict=True
        ):
            anchor.sub_(delta)  # floating buffers: anchor - own change, as a lone round
            b.copy_(anchor)

    @torch.no_grad()
    def land(
        self, step: OuterStep, *, nesterov: bool, steps_in_flight: int, steps_per_round: int
    ) -> tuple[float | None, float]:
        """Apply the round's outcome (see the module docstring).

        Args:
            step: the outer rule of the group the round averaged with (solitary: none).
            nesterov: Nesterov look-ahead (else heavy-ball).
            steps_in_flight: inner steps taken since the round's launch.
            steps_per_round: inner steps between two launches (see :func:`landing_share`).

        Returns:
            ``(norm, scale)`` of the averaged pseudo-gradient, as
            :meth:`OuterState.apply_outer` reports them; ``(None, 1.0)`` for a lone round.
        """
        outer, n, local = self.outer, len(self.outer.anchor), self._local
        share = landing_share(steps_in_flight, steps_per_round)
        for m, m0 in zip(outer.momentum, self._momentum0, strict=True):
            m.copy_(m0)
        if self._held:  # the model held Δ_local beyond the eager anchor (eager_step)
            for p, delta in zip(outer.tensors.params, local[:n], strict=True):
                p.add_(delta.to(p.device, non_blocking=True), alpha=share)
        params = zip(outer.anchor, self._anchor0[:n], local[:n], outer.tensors.params, strict=True)
        if step.solitary:
            for m in outer.momentum:
                m.mul_(step.beta)  # fades unapplied, as in a blocking lone round
            for anchor, a0, delta, p in params:
                launch = a0.sub_(delta)  # θ at launch: the anchor of a lone round
                p.add_((launch - anchor).to(p.device, non_blocking=True), alpha=share)
                anchor.copy_(launch)
            return None, 1.0
        for anchor, a0, kept, p in params:
            # θ - s·θ_eager: the model is then θ - s·(θ_eager - θ_anchor) = kept + s·θ_anchor
            kept.copy_(p).sub_(anchor, alpha=share)
            anchor.copy_(a0)
        buffers = (outer.buffer_anchor, self._anchor0[n:], local[n:], outer.tensors.buffers)
        for anchor, a0, kept, b in zip(*buffers, strict=True):
            anchor.copy_(a0)  # back to the buffers' anchor the round started from
            kept.copy_(b)  # the buffers as the steps in flight left them
        norm = outer.pseudo_grad_norm()
        scale = outer.apply_outer(step, nesterov=nesterov, norm=norm)  # the model = θ_anchor
        for p, kept in zip(outer.tensors.params, local[:n], strict=True):
            p.mul_(share).add_(kept.to(p.device, non_blocking=True))
        if steps_in_flight:
            for b, kept in zip(outer.tensors.buffers, local[n:], strict=True):
                b.copy_(kept.to(b.device, non_blocking=True))
        return norm, scale
