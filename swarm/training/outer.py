"""The fp32 state of the DiLoCo outer step: anchors, pseudo-gradient slots and momentum.

DiLoCo (Douillard et al., 2023, Algorithm 1): every ``inner_steps`` local steps, each worker
computes the pseudo-gradient ``Δ = θ_anchor - θ``, the swarm averages it, and an outer optimizer
(Nesterov SGD, lr 0.7, momentum 0.9) moves the shared anchor; every worker then restarts from it.

The anchor, the pseudo-gradient and the momentum are fp32 master copies, so fp16/bf16 models do not
lose the small outer updates to rounding. They live on the model's device, or (``outer_device=
"cpu"`` with a CUDA model) in pinned host memory, which leaves the GPU to the model: the copies to
and from the GPU then happen once per round.

How the anchor moves each round is :mod:`swarm.training.outer_rule`'s.
"""

from __future__ import annotations

import copy
import logging
import math
import statistics
from collections import deque
from collections.abc import Sequence

import torch

from swarm.errors import CheckpointError
from swarm.training.outer_rule import (
    NORM_BOUND,
    NORM_HISTORY,
    NORM_MIN_HISTORY,
    RESTART_BELOW,
    OuterStep,
    momentum_cosine,
    outer_step,
)
from swarm.training.tensors import ModelTensors, piece

logger = logging.getLogger(__name__)


def has_momentum(outer_state: object) -> bool:
    """Whether a saved outer state (:meth:`OuterState.state_dict`) holds any momentum."""
    return isinstance(outer_state, dict) and any(
        isinstance(k, str) and k.startswith("momentum.") for k in outer_state
    )


class OuterState:
    """fp32 anchors, averaging slots and outer momentum for the averaged tensors of a model.

    Floating buffers (BatchNorm statistics) are values, not trained weights: in ``diloco`` and
    ``gradients`` mode each round averages their change since the last round (``anchor - b``)
    and every peer adopts ``anchor - mean change``, which equals averaging the values when
    the peers share the anchor, yet stays harmless under top-K or 1-bit compression (averaging the
    raw values through top-K would zero most of a running variance).

    Args:
        tensors: the model's parameters and floating buffers (see :class:`ModelTensors`).
        keep_momentum: False for ``local_sgd``/``gradients``, which need no outer momentum,
            and for the plain step of ``diloco`` with error feedback in the model.
        device: where the fp32 state lives; None = the model's device. ``cpu`` with a CUDA
            model keeps it in pinned host memory (the averager's residuals follow the slots).
    """

    def __init__(
        self,
        tensors: ModelTensors,
        *,
        keep_momentum: bool = True,
        device: torch.device | str | None = None,
    ):
        self.tensors = tensors
        self.device = torch.device(device) if device is not None else tensors.device
        # off the model's GPU: pinned, so copies to and from it can run asynchronously
        self.offloaded = self.device != tensors.device and tensors.device.type == "cuda"
        # What the averager sees and averages in place: one fp32 tensor per model tensor, all
        # views of one buffer, which the averager reads and writes as its flat vector (a
        # gathered copy would be one more fp32 copy of the model); the anchors likewise, for
        # the rounds that sync them.
        self.slots = self.flat_like(tensors.all)
        anchors = self.flat_like(tensors.all)
        for a, t in zip(anchors, tensors.all, strict=True):
            a.copy_(t.detach())
        self.anchor, self.buffer_anchor = (
            anchors[: len(tensors.params)],
            anchors[len(tensors.params) :],
        )
        self.momentum = [self.new_like(a) for a in self.anchor] if keep_momentum else []
        self.norms: deque[float] = deque(maxlen=NORM_HISTORY)  # recent averaged ‖Δ‖
        self.restarts = 0  # rounds whose momentum restarted (see RESTART_BELOW)

    def view(self, pieces: tuple[tuple[int, int, int], ...]) -> OuterState:
        """The state of pieces of the tensors (a fragment: ``(index into tensors.all, start,
        end)`` of each flattened tensor, in order): views of the same slots, anchors and
        momentum, not copies, with a norm history of its own (each fragment's pseudo-gradient
        has its own scale)."""
        n = len(self.anchor)
        params = [(i, s, e) for i, s, e in pieces if i < n]
        buffers = [(i - n, s, e) for i, s, e in pieces if i >= n]
        part = copy.copy(self)
        part.tensors = self.tensors.pieces(pieces)
        part.slots = [piece(self.slots[i], s, e) for i, s, e in pieces]
        part.anchor = [piece(self.anchor[i], s, e) for i, s, e in params]
        part.buffer_anchor = [piece(self.buffer_anchor[j], s, e) for j, s, e in buffers]
        part.momentum = (
            [piece(self.momentum[i], s, e) for i, s, e in params] if self.momentum else []
        )
        part.norms = deque(maxlen=NORM_HISTORY)
        return part

    def flat_like(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Zero fp32 tensors shaped like ``tensors``, laid end to end in one buffer where this
        state lives (pinned when offloaded)."""
        numel = sum(t.numel() for t in tensors)
        flat = torch.zeros(
            numel, dtype=torch.float32, device=self.device, pin_memory=self.offloaded
        )
        out, at = [], 0
        for t in tensors:
            out.append(flat[at : at + t.numel()].view(t.shape))
            at += t.numel()
        return out

    def new_like(self, t: torch.Tensor) -> torch.Tensor:
        """A zero fp32 tensor shaped like ``t`` where this state lives (pinned when offloaded)."""
        return self.flat_like([t])[0]

    def _difference(
        self,
        out: Sequence[torch.Tensor],
        anchors: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
    ) -> None:
        """out ← anchors - values, with ``values`` on the model's device."""
        if not self.offloaded:
            for o, a, t in zip(out, anchors, values, strict=True):
                torch.sub(a, t, out=o)
            return
        for o, t in zip(out, values, strict=True):
            o.copy_(t, non_blocking=True)
        # A CPU-GPU sync point, once per round: the copies must land before the CPU reads them.
        torch.cuda.synchronize(self.tensors.device)
        for o, a in zip(out, anchors, strict=True):
            torch.sub(a, o, out=o)

    @property
    def _n(self) -> int:
        return len(self.anchor)

    @torch.no_grad()
    def reset_anchor(self) -> None:
        """Take the model's current values as the anchors (after a load or a download)."""
        for a, t in zip(self.anchor + self.buffer_anchor, self.tensors.all, strict=True):
            a.copy_(t)

    @torch.no_grad()
    def stage_params(self) -> None:
        """Parameter anchors ← the model's parameters: in ``gradients`` mode, where they serve
        nothing else, so that a round can sync them (see :meth:`adopt_synced_params`)."""
        for a, p in zip(self.anchor, self.tensors.params, strict=True):
            a.copy_(p)

    @torch.no_grad()
    def adopt_synced_params(self) -> None:
        """Model's parameters ← their anchors, which a round synced (``gradients`` mode)."""
        for p, a in zip(self.tensors.params, self.anchor, strict=True):
            p.copy_(a)

    @torch.no_grad()
    def load_pseudo_grads(self) -> None:
        """slots ← θ_anchor - θ for parameters and buffers alike (DiLoCo)."""
        self._difference(self.slots, self.anchor + self.buffer_anchor, self.tensors.all)

    @torch.no_grad()
    def load_values(self) -> None:
        """slots ← the model's current parameters and floating buffers (local SGD)."""
        for slot, t in zip(self.slots, self.tensors.all, strict=True):
            slot.copy_(t)

    @torch.no_grad()
    def load_grads(self) -> None:
        """slots ← parameter gradients (zeros where none) and buffer changes (DDP-like)."""
        for slot, p in zip(self.slots[: self._n], self.tensors.params, strict=True):
            if p.grad is None:
                slot.zero_()
            else:
                slot.copy_(p.grad)
        self._load_buffer_changes()

    def _load_buffer_changes(self) -> None:
        self._difference(self.slots[self._n :], self.buffer_anchor, self.tensors.buffers)

    def _apply_buffer_changes(self) -> None:
        for a, b, slot in zip(
            self.buffer_anchor, self.tensors.buffers, self.slots[self._n :], strict=True
        ):
            a.sub_(slot)
            b.copy_(a)

    @torch.no_grad()
    def pseudo_grad_norm(self) -> float:
        """‖Δ‖ over the parameter slots (one CPU-GPU sync per round)."""
        slots = self.slots[: self._n]
        if not slots:
            return 0.0
        return float(torch.linalg.vector_norm(torch.stack([s.norm() for s in slots])).item())

    def norm_bound(self) -> float:
        """Largest ‖Δ‖ applied as it is (inf until enough rounds were seen, and while most
        recent rounds moved nothing: a bound of 0 would cut every later round to nothing)."""
        if len(self.norms) < NORM_MIN_HISTORY:
            return math.inf
        return NORM_BOUND * statistics.median(self.norms) or math.inf

    @torch.no_grad()
    def apply_outer(self, step: OuterStep, *, nesterov: bool, norm: float | None = None) -> float:
        """Apply ``step`` to the anchor from the averaged slots; the model restarts from it.

        Args:
            step: what :func:`outer_rule` decided for this round.
            nesterov: Nesterov look-ahead (else heavy-ball).
            norm: ‖Δ‖ of the slots if already known.

        Returns:
            The factor the pseudo-gradient was scaled by: 1.0 unless the norm bound cut it, 0.0
            when it was not finite (nothing applied; the model went back to the anchor).
        """
        if step.solitary:
            # Plain local training: the anchor takes the model; momentum fades, unapplied.
            for m in self.momentum:
                m.mul_(step.beta)
            for a, p in zip(self.anchor, self.tensors.params, strict=True):
                a.copy_(p)
            self._apply_buffer_changes()
            return 1.0
        norm = self.pseudo_grad_norm() if norm is None else norm
        if not math.isfinite(norm):
            # Never move the anchor by NaN/Inf: the model restarts from the last agreed state.
            for p, a in zip(self.tensors.params, self.anchor, strict=True):
                p.copy_(a)
            for b, a in zip(self.tensors.buffers, self.buffer_anchor, strict=True):
                b.copy_(a)
            return 0.0
        scale = 1.0
        bound = self.norm_bound()
        if norm > bound:
            scale = bound / norm
            for slot in self.slots[: self._n]:
                slot.mul_(scale)
        self.norms.append(min(norm, bound))
        restart = self._restart_if_opposed(self.slots[: self._n], min(norm, bound), step)
        if restart is not None:
            self.restarts += 1
            logger.debug("outer momentum restarted: its cosine with Δ̄ was %.3f", restart)
        outer_step(
            self.anchor,
            self.slots[: self._n],
            self.momentum,
            lr=step.lr,
            beta=step.beta,
            nesterov=nesterov and restart is None,  # restarted: m = Δ, the step lr·Δ
        )
        for p, a in zip(self.tensors.params, self.anchor, strict=True):
            p.copy_(a)
        self._apply_buffer_changes()
        return scale

    @torch.no_grad()
    def _restart_if_opposed(
        self, deltas: Sequence[torch.Tensor], norm: float, step: OuterStep
    ) -> float | None:
        """Zero the momentum if it points against ``deltas`` (of norm ``norm``; see
        :data:`RESTART_BELOW`): the cosine that made it restart, or None."""
        if not self.momentum or step.solitary or step.beta == 0:
            return None
        cosine = momentum_cosine(self.momentum, deltas, norm)
        if cosine >= RESTART_BELOW:
            return None
        for m in self.momentum:
            m.zero_()
        return cosine

    @torch.no_grad()
    def keep_unsent(self, unsent: torch.Tensor | None, share: float) -> None:
        """Move the parameters by ``-share`` times what this peer's round left out of their
        pseudo-gradient (``unsent``: the averager's flat error-feedback residual, parameters
        first in slot order), which the next round then carries through the model instead of
        the residual (the averager adds none back: ``keep_unsent`` rounds).

        Error feedback kept in the model: after the round the model is ``θ_anchor - r`` rather
        than ``θ_anchor``, so its inner steps go on from the progress it made instead of making
        it again, and its next pseudo-gradient ``θ_anchor - θ`` carries ``r`` as the residual
        would have. Used where the slots hold parameters alone (sparse codecs average no
        floating buffers).
        """
        if unsent is None or not share or unsent.numel() != sum(s.numel() for s in self.slots):
            return
        offset = 0
        for p in self.tensors.params:
            r = unsent[offset : offset + p.numel()].view_as(p)
            p.sub_(r.to(device=p.device, dtype=p.dtype), alpha=share)
            offset += p.numel()

    @torch.no_grad()
    def apply_values(self) -> None:
        """Model ← averaged slots (local SGD); the anchors follow."""
        for t, slot in zip(self.tensors.all, self.slots, strict=True):
            t.copy_(slot)
        self.reset_anchor()

    @torch.no_grad()
    def apply_mean_difference(self) -> None:
        """Model ← anchors - averaged slots (a round of pseudo-gradients ``θ_anchor - θ``
        averaged as values: the mean of the members' models where they share the anchors);
        the anchors follow."""
        for p, a, slot in zip(self.tensors.params, self.anchor, self.slots[: self._n], strict=True):
            torch.sub(a, slot, out=slot)
            p.copy_(slot)
        self._apply_buffer_changes()
        self.reset_anchor()

    @torch.no_grad()
    def apply_grads(self) -> None:
        """Gradients ← averaged slots; floating buffers ← anchor - mean change."""
        for p, slot in zip(self.tensors.params, self.slots[: self._n], strict=True):
            if p.grad is None:
                p.grad = slot.to(device=p.device, dtype=p.dtype, copy=True)
            else:
                p.grad.copy_(slot)
        self._apply_buffer_changes()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Anchors and momentum by tensor name (CPU copies)."""
        state: dict[str, torch.Tensor] = {}
        names = self.tensors.names
        for name, a in zip(names, self.anchor + self.buffer_anchor, strict=True):
            state[f"anchor.{name}"] = a.detach().cpu()
        for name, m in zip(self.tensors.param_names, self.momentum, strict=False):
            state[f"momentum.{name}"] = m.detach().cpu()
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore anchors and momentum; raises CheckpointError on a missing or misshaped entry.

        A state with no momentum at all (a plain step's, see :func:`outer_rule`) restores zero
        momentum; one this state does not keep is ignored."""
        pairs = [("anchor", self.tensors.names, self.anchor + self.buffer_anchor)]
        if has_momentum(state):
            pairs.append(("momentum", self.tensors.param_names, self.momentum))
        elif self.momentum:
            logger.info("the saved state holds no outer momentum (a plain step's): it starts at 0")
            for m in self.momentum:
                m.zero_()
        for prefix, names, targets in pairs:
            for name, target in zip(names, targets, strict=False):
                value = state.get(f"{prefix}.{name}")
                if not isinstance(value, torch.Tensor) or value.shape != target.shape:
                    raise CheckpointError(f"outer state {prefix}.{name} is missing or misshaped")
                target.copy_(value)
