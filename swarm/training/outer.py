"""The DiLoCo outer step and the fp32 state it keeps (anchor, pseudo-gradient, momentum).

DiLoCo (Douillard et al., 2023, Algorithm 1): every ``inner_steps`` local steps, each worker
computes the pseudo-gradient ``Δ = θ_anchor - θ``, the swarm averages it, and an outer optimizer
(Nesterov SGD, lr 0.7, momentum 0.9) moves the shared anchor; every worker then restarts from it.

The anchor, the pseudo-gradient and the momentum are fp32 master copies, so fp16/bf16 models do not
lose the small outer updates to rounding. They live on the model's device, or (``outer_device=
"cpu"`` with a CUDA model) in pinned host memory, which leaves the GPU to the model: the copies to
and from the GPU then happen once per round.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from swarm.errors import CheckpointError
from swarm.training.tensors import ModelTensors


@torch.no_grad()
def outer_step(
    anchor: Sequence[torch.Tensor],
    pseudo_grads: Sequence[torch.Tensor],
    momentum: Sequence[torch.Tensor],
    *,
    lr: float,
    beta: float,
    nesterov: bool = True,
) -> None:
    """Apply one outer SGD step to ``anchor`` from the averaged pseudo-gradients, in place.

    Same update as ``torch.optim.SGD(lr, momentum=beta, nesterov=...)`` with ``Δ`` as gradient.
    ``pseudo_grads`` is used as scratch space (its values are consumed).
    """
    for theta, delta, m in zip(anchor, pseudo_grads, momentum, strict=True):
        m.mul_(beta).add_(delta)  # m ← βm + Δ
        update = delta.add_(m, alpha=beta) if nesterov else m  # Nesterov look-ahead: Δ + βm
        theta.sub_(update, alpha=lr)  # θ ← θ - lr·update


class OuterState:
    """fp32 anchors, averaging slots and outer momentum for the averaged tensors of a model.

    Floating buffers (BatchNorm statistics) are values, not trained weights: in ``diloco`` and
    ``gradients`` mode each round averages their change since the last round (``anchor - b``)
    and every peer adopts ``anchor - mean change``, which equals averaging the values when
    the peers share the anchor, yet stays harmless under top-K or 1-bit compression (averaging the
    raw values through top-K would zero most of a running variance).

    Args:
        tensors: the model's parameters and floating buffers (see :class:`ModelTensors`).
        keep_momentum: False for ``local_sgd``/``gradients``, which need no outer momentum.
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
        # What the averager sees and averages in place: one fp32 tensor per model tensor.
        self.slots = [self.new_like(t) for t in tensors.all]
        self.anchor = [self.new_like(t).copy_(t.detach()) for t in tensors.params]
        self.buffer_anchor = [self.new_like(b).copy_(b.detach()) for b in tensors.buffers]
        self.momentum = [self.new_like(a) for a in self.anchor] if keep_momentum else []

    def new_like(self, t: torch.Tensor) -> torch.Tensor:
        """A zero fp32 tensor shaped like ``t`` where this state lives (pinned when offloaded)."""
        return torch.zeros(
            t.shape, dtype=torch.float32, device=self.device, pin_memory=self.offloaded
        )

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
    def apply_outer(self, *, lr: float, beta: float, nesterov: bool) -> None:
        """Outer step on the anchor from the averaged slots; the model restarts from it."""
        outer_step(
            self.anchor, self.slots[: self._n], self.momentum, lr=lr, beta=beta, nesterov=nesterov
        )
        for p, a in zip(self.tensors.params, self.anchor, strict=True):
            p.copy_(a)
        self._apply_buffer_changes()

    @torch.no_grad()
    def apply_values(self) -> None:
        """Model ← averaged slots (local SGD); the anchors follow."""
        for t, slot in zip(self.tensors.all, self.slots, strict=True):
            t.copy_(slot)
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
        """Restore anchors and momentum; raises CheckpointError on a missing or misshaped entry."""
        pairs = [
            ("anchor", self.tensors.names, self.anchor + self.buffer_anchor),
            ("momentum", self.tensors.param_names, self.momentum),
        ]
        for prefix, names, targets in pairs:
            for name, target in zip(names, targets, strict=False):
                value = state.get(f"{prefix}.{name}")
                if not isinstance(value, torch.Tensor) or value.shape != target.shape:
                    raise CheckpointError(f"outer state {prefix}.{name} is missing or misshaped")
                target.copy_(value)
