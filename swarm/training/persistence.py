"""What a training peer saves and serves: snapshots for late joiners and checkpoints.

:class:`PersistentState` is the part of :class:`~swarm.training.engine.TrainingEngine` that turns
its state into bytes and back: the snapshot a provider serves a joiner (the agreed anchor, not
this peer's drift) and the checkpoint ``Swarm.save`` writes. Loads check everything first and
write nothing on a failure.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from swarm.config import Mode, SwarmConfig
from swarm.errors import CheckpointError, TrainingError
from swarm.training.cadence import Cadence
from swarm.training.checkpoint import OPTIONAL_COUNTS, check_checkpoint
from swarm.training.outer import OuterState, has_momentum
from swarm.training.overlap import Flight
from swarm.training.snapshot import Snapshot, pack_snapshot
from swarm.training.tensors import ModelTensors

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1


class PersistentState:
    """Snapshots and checkpoints of a training engine (mixed into it; its state below)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    config: SwarmConfig
    mode: Mode
    tensors: ModelTensors
    outer: OuterState
    schema: str
    lock: threading.Lock
    _landed: threading.Condition
    _flight: Flight | None
    round: int
    step_count: int
    steps_in_round: int
    samples_in_round: float
    values_rounds: int
    offer_from_round: int | None
    cadence: Cadence

    def snapshot_layout(self) -> list[tuple[str, int]]:
        """``(name, numel)`` of every tensor in a snapshot of this model, in order."""
        layout = [
            (f"model.{n}", t.numel())
            for n, t in zip(self.tensors.names, self.tensors.all, strict=True)
        ]
        if self.mode.has_outer_step:
            layout += [
                (f"momentum.{n}", t.numel())
                for n, t in zip(self.tensors.param_names, self.tensors.params, strict=True)
            ]
        return layout

    def snapshot(self) -> tuple[int, bytes]:
        """(round, bytes) of the shared state: the anchor (diloco) or the model, and momentum.

        Between rounds a DiLoCo or local-SGD peer's anchor is the state every peer agreed on
        at the last round, so joiners get that (plus the averaged floating buffers) rather than
        this peer's local drift. While a round is in flight the peers are about to move their
        anchors, so this waits (bounded) for it to land and serves the state after it. Call
        from a worker thread: it copies the whole model.
        """
        bound = min(self.config.averaging.round_timeout_s, self.config.state_timeout_s / 4)
        with self._landed:
            if not self._landed.wait_for(lambda: self._flight is None, bound):
                # the joiner adopts the state of the round before, as if it had asked a moment
                # earlier: nothing for anyone to act on (seen with churn, on busy cores)
                logger.info(
                    "serving round %d's state: the round in flight did not land", self.round
                )
            values = list(
                self.tensors.params if self.mode.averages_gradients else self.outer.anchor
            )
            values += self.outer.buffer_anchor
            if self.mode.has_outer_step:
                # a plain step keeps no momentum: its snapshot's momentum is zero (one layout for
                # every codec, and what a peer that joins with a momentum should start from)
                values += self.outer.momentum or [
                    torch.zeros(1).expand(p.numel()) for p in self.tensors.params
                ]
            names = [name for name, _ in self.snapshot_layout()]
            named = list(zip(names, values, strict=True))
            return self.round, pack_snapshot(self.round, self.schema, self.mode.value, named)

    @torch.no_grad()
    def load_snapshot(self, snap: Snapshot, steps_in_round: int) -> None:
        """Adopt a downloaded state: model, anchor, momentum (where this peer keeps one) and
        round; inner state resets."""
        self._no_flight("load a downloaded state")
        with self.lock:
            for name, t in zip(self.tensors.names, self.tensors.all, strict=True):
                t.copy_(snap.tensors[f"model.{name}"].view(t.shape))
            if self.outer.momentum:
                for name, m in zip(self.tensors.param_names, self.outer.momentum, strict=True):
                    m.copy_(snap.tensors[f"momentum.{name}"].view(m.shape))
            self.outer.reset_anchor()
            self.round = self.offer_from_round = snap.round
            # Align with the provider's phase so our next round meets theirs.
            self.steps_in_round = max(0, min(steps_in_round, self.cadence.interval - 1))
            self.samples_in_round = 0.0

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self, averager_state: dict[str, Any] | None) -> dict[str, Any]:
        with self.lock:
            return {
                "format": CHECKPOINT_FORMAT,
                "schema": self.schema,
                "mode": self.mode.value,
                "round": self.round,
                "step": self.step_count,
                "steps_in_round": self.steps_in_round,
                "samples_in_round": self.samples_in_round,
                "values_rounds": self.values_rounds,
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
        if state.get("mode") != self.mode.value:
            raise CheckpointError(
                f"the checkpoint was written in mode {state.get('mode')!r}, "
                f"this swarm runs {self.mode.value!r}"
            )
        self._no_flight("load a checkpoint")
        # All-or-nothing: everything is checked before the first value is written.
        t = self.tensors
        outer = {f"anchor.{n}": x.shape for n, x in zip(t.names, t.all, strict=True)}
        # a plain step saves no momentum (a peer that keeps one starts it at zero) and ignores
        # a saved one, checked all the same
        if has_momentum(state.get("outer")):
            for n, p in zip(t.param_names, t.params, strict=True):
                outer[f"momentum.{n}"] = p.shape
        check_checkpoint(state, model=self.model, optimizer=self.optimizer, outer=outer)
        with self.lock:
            try:
                self.optimizer.load_state_dict(state["optimizer"])  # checks, then replaces
                self.model.load_state_dict(state["model"])
                self._load_outer(state["outer"])
                self.round = self.offer_from_round = int(state["round"])
                self.step_count = int(state["step"])
                self.steps_in_round = int(state["steps_in_round"])
                self.samples_in_round = float(state["samples_in_round"])
                # the finishing rounds' grid axis follows it; older checkpoints lack it
                self.values_rounds = int(
                    state.get("values_rounds", OPTIONAL_COUNTS["values_rounds"])
                )
            except (KeyError, TypeError, ValueError, RuntimeError) as e:
                raise CheckpointError(f"the checkpoint does not match this model: {e}") from e
        averager = state.get("averager", {})
        return averager if isinstance(averager, dict) else {}

    def _no_flight(self, doing: str) -> None:
        if self._flight is not None:
            raise TrainingError(f"a round is in flight: land it (wait_round) before you {doing}")

    def _load_outer(self, outer: dict[str, torch.Tensor]) -> None:
        if not isinstance(outer, dict):
            raise CheckpointError("the checkpoint's outer state is not a dict")
        self.outer.load_state_dict(outer)
