"""The training loop's state machine, shared by the sync and async facades.

``step()`` = (``gradients``: average the gradients) → ``optimizer.step()`` → (every
``inner_steps``: an averaging round). The facades differ only in how they wait for the round
(blocking on the loop thread, or ``await``); everything else lives here. Averaging works on fp32
copies (:class:`~swarm.training.outer.OuterState`), so a failed or cut round never leaves the
model half-averaged: the peer goes on alone and the step report says why.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from swarm.config import SPARSE_CODECS, SwarmConfig
from swarm.errors import CheckpointError
from swarm.training.divergence import DivergenceMonitor, as_loss
from swarm.training.outer import OuterState, outer_rule
from swarm.training.progress import StepReport, Utilization
from swarm.training.snapshot import Snapshot, pack_snapshot
from swarm.training.tensors import ModelTensors

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1


@dataclass(frozen=True)
class RoundOutcome:
    """What the training layer needs from one averaging round."""

    averaged: bool  # at least one other peer's values were averaged in
    group_size: int  # members including this peer (0 when not averaged)
    bytes_sent: int
    bytes_received: int
    reason: str = ""  # why not averaged


class RoundRunner(Protocol):
    """Averages ``tensors`` in place with the swarm (the averaging layer, adapted)."""

    async def __call__(self, tensors: list[torch.Tensor], weight: float) -> RoundOutcome: ...


@dataclass(frozen=True)
class RoundPlan:
    """A round about to run: the fp32 tensors to average in place and this peer's weight."""

    tensors: list[torch.Tensor]
    weight: float
    started: float  # perf_counter() when the round began


class TrainingEngine:
    """Mode logic, counters and state of one training peer (no networking)."""

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: SwarmConfig
    ):
        self.model = model
        self.optimizer = optimizer
        self.config = config
        dense = config.codec.split(":")[0] not in SPARSE_CODECS
        self.tensors = ModelTensors.of(model, with_buffers=dense)
        self.schema = self.tensors.schema_hash()
        self.outer = OuterState(self.tensors, keep_momentum=config.mode == "diloco")
        self.step_count = 0  # local optimizer steps
        self.round = 0  # completed averaging rounds (attempted ones count; see finish_round)
        self.steps_in_round = 0
        self.samples_in_round = 0.0
        self.utilization = Utilization()
        # Held while the model/anchor change, so a snapshot for a joiner is never torn.
        self.lock = threading.Lock()
        self._last_failure = ""
        self.divergence = DivergenceMonitor()
        self._diverging = False  # the last round was flagged (log once per episode)
        self.last_loss: float | None = None  # the loss passed to the last step

    # -- one step ---------------------------------------------------------------------------
    def count(self, samples: float | None, loss: object = None) -> bool:
        """Count a local step (and the script's loss, if passed); True when it ends a round."""
        if samples is not None and not samples >= 0:
            raise ValueError("samples must be a non-negative number")
        if loss is not None:
            self.last_loss = as_loss(loss)
            self.divergence.add(self.last_loss)
        else:
            self.last_loss = None
        self.utilization.started()
        self.step_count += 1
        self.steps_in_round += 1
        self.samples_in_round += 1.0 if samples is None else float(samples)
        return self.steps_in_round >= self.config.inner_steps

    def inner_step(self) -> None:
        with self.lock:
            self.optimizer.step()

    def begin_round(self) -> RoundPlan:
        """Fill the fp32 slots with what this mode averages."""
        with self.lock:
            mode = self.config.mode
            if mode == "diloco":
                self.outer.load_pseudo_grads()
            elif mode == "local_sgd":
                self.outer.load_values()
            else:
                self.outer.load_grads()
        return RoundPlan(self.outer.slots, max(self.samples_in_round, 1e-6), time.perf_counter())

    def finish_round(self, plan: RoundPlan, outcome: RoundOutcome) -> StepReport:
        """Apply the round's result (or go on alone) and build the step report."""
        waited = time.perf_counter() - plan.started
        self.utilization.add_wait(waited)
        cfg = self.config
        with self.lock:
            if not outcome.averaged and cfg.mode != "local_sgd":
                # A cut round may have half-written the slots: use our own values again.
                if cfg.mode == "diloco":
                    self.outer.load_pseudo_grads()
                else:
                    self.outer.load_grads()
            norm, scale = None, 1.0
            if cfg.mode == "diloco":
                # Alone: plain local training; small groups: capped momentum (outer_rule).
                k = outcome.group_size if outcome.averaged else 1
                step = outer_rule(k, lr=cfg.outer_lr, beta=cfg.outer_momentum)
                norm = None if step.solitary else self.outer.pseudo_grad_norm()
                scale = self.outer.apply_outer(step, nesterov=cfg.nesterov, norm=norm)
            elif cfg.mode == "local_sgd":
                if outcome.averaged:
                    self.outer.apply_values()
                else:
                    self.outer.reset_anchor()
            else:
                self.outer.apply_grads()
            self.round += 1
            self.steps_in_round = 0
            self.samples_in_round = 0.0
        if outcome.averaged:
            self._last_failure = ""
            logger.debug("round %d averaged with %d peers", self.round, outcome.group_size - 1)
        elif outcome.reason != self._last_failure:
            # One WARNING per kind of failure, not one per round while alone.
            logger.warning(
                "round %d not averaged: %s; training on alone", self.round, outcome.reason
            )
            self._last_failure = outcome.reason
        loss, divergence = self.divergence.end_round()
        if norm is not None and not math.isfinite(norm):
            lost = "the pseudo-gradient is not finite; the round's steps were discarded"
            divergence = "; ".join(filter(None, [divergence, lost]))
        elif scale < 1.0:
            jump = (
                f"the pseudo-gradient norm jumped to {norm:.4g}, {1 / scale:.1f}x the bound "
                "from recent rounds; scaled down to the bound"
            )
            divergence = "; ".join(filter(None, [divergence, jump]))
        if divergence and not self._diverging:
            logger.warning("round %d looks divergent: %s", self.round, divergence)
        elif not divergence and self._diverging:
            logger.info("round %d: no longer diverging", self.round)
        self._diverging = bool(divergence)
        return StepReport(
            step=self.step_count,
            round=self.round,
            round_due=True,
            averaged=outcome.averaged,
            group_size=outcome.group_size if outcome.averaged else 0,
            bytes_sent=outcome.bytes_sent,
            bytes_received=outcome.bytes_received,
            wait_s=waited,
            utilization=self.utilization.value,
            reason=outcome.reason,
            loss=loss,
            diverging=bool(divergence),
            divergence=divergence,
            pseudo_grad_norm=norm,
        )

    def local_report(self) -> StepReport:
        bad = self.last_loss is not None and not math.isfinite(self.last_loss)
        return StepReport(
            self.step_count,
            self.round,
            False,
            False,
            0,
            0,
            0,
            0.0,
            self.utilization.value,
            loss=self.last_loss,
            diverging=bad,
            divergence="the loss is not finite" if bad else "",
        )

    # -- snapshots for late joiners ---------------------------------------------------------
    def snapshot_layout(self) -> list[tuple[str, int]]:
        """``(name, numel)`` of every tensor in a snapshot of this model, in order."""
        layout = [
            (f"model.{n}", t.numel())
            for n, t in zip(self.tensors.names, self.tensors.all, strict=True)
        ]
        if self.config.mode == "diloco":
            layout += [
                (f"momentum.{n}", t.numel())
                for n, t in zip(self.tensors.param_names, self.tensors.params, strict=True)
            ]
        return layout

    def snapshot(self) -> tuple[int, bytes]:
        """(round, bytes) of the shared state: the anchor (diloco) or the model, and momentum.

        Between rounds a DiLoCo or local-SGD peer's anchor is the state every peer agreed on
        at the last round, so joiners get that (plus the averaged floating buffers) rather than
        this peer's local drift. Call from a worker thread: it copies the whole model.
        """
        with self.lock:
            values = list(
                self.tensors.params if self.config.mode == "gradients" else self.outer.anchor
            )
            values += self.outer.buffer_anchor
            if self.config.mode == "diloco":
                values += self.outer.momentum
            names = [name for name, _ in self.snapshot_layout()]
            named = list(zip(names, values, strict=True))
            return self.round, pack_snapshot(self.round, self.schema, self.config.mode, named)

    @torch.no_grad()
    def load_snapshot(self, snap: Snapshot, steps_in_round: int) -> None:
        """Adopt a downloaded state: model, anchor, momentum and round; inner state resets."""
        with self.lock:
            for name, t in zip(self.tensors.names, self.tensors.all, strict=True):
                t.copy_(snap.tensors[f"model.{name}"].view(t.shape))
            if self.config.mode == "diloco":
                for name, m in zip(self.tensors.param_names, self.outer.momentum, strict=True):
                    m.copy_(snap.tensors[f"momentum.{name}"].view(m.shape))
            self.outer.reset_anchor()
            self.round = snap.round
            # Align with the provider's phase so our next round meets theirs.
            self.steps_in_round = max(0, min(steps_in_round, self.config.inner_steps - 1))
            self.samples_in_round = 0.0

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self, averager_state: dict[str, Any] | None) -> dict[str, Any]:
        with self.lock:
            return {
                "format": CHECKPOINT_FORMAT,
                "schema": self.schema,
                "mode": self.config.mode,
                "round": self.round,
                "step": self.step_count,
                "steps_in_round": self.steps_in_round,
                "samples_in_round": self.samples_in_round,
                "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
                "optimizer": self.optimizer.state_dict(),
                "outer": self.outer.state_dict(),
                "averager": averager_state or {},
            }

    def load_state_dict(self, state: dict[str, Any]) -> dict[str, Any]:
        """Restore a checkpoint; returns the averager's part. Raises CheckpointError."""
        if state.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"unsupported checkpoint format {state.get('format')!r}")
        if state.get("schema") != self.schema:
            raise CheckpointError("the checkpoint is of another model (schema hash differs)")
        if state.get("mode") != self.config.mode:
            raise CheckpointError(
                f"the checkpoint was written in mode {state.get('mode')!r}, "
                f"this swarm runs {self.config.mode!r}"
            )
        with self.lock:
            try:
                self.model.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optimizer"])
                self._load_outer(state["outer"])
                self.round = int(state["round"])
                self.step_count = int(state["step"])
                self.steps_in_round = int(state["steps_in_round"])
                self.samples_in_round = float(state["samples_in_round"])
            except (KeyError, TypeError, ValueError, RuntimeError) as e:
                raise CheckpointError(f"the checkpoint does not match this model: {e}") from e
        averager = state.get("averager", {})
        return averager if isinstance(averager, dict) else {}

    def _load_outer(self, outer: dict[str, torch.Tensor]) -> None:
        if not isinstance(outer, dict):
            raise CheckpointError("the checkpoint's outer state is not a dict")
        self.outer.load_state_dict(outer)
