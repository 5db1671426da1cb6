"""``SwarmOptimizer``: the swarm as a ``torch.optim.Optimizer``, for code that calls the optimizer.

LR schedulers, ``torch.amp.GradScaler``, PyTorch Lightning and the Hugging Face ``Trainer`` all call
``optimizer.step()`` themselves; wrapping the optimizer makes that call the swarm step::

    inner = torch.optim.AdamW(model.parameters(), lr=3e-4)
    optimizer = SwarmOptimizer(inner, model=model, run_id="my-run", initial_peers=[...])
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10_000)  # inner lr
    scaler = torch.amp.GradScaler()
    for x, y in loader:
        scaler.scale(loss_fn(model(x), y)).backward()
        scaler.step(optimizer)      # the swarm step; skipped when the gradients overflowed
        scaler.update()
        optimizer.zero_grad()
        scheduler.step()
    optimizer.close()

The wrapper shares the inner optimizer's ``param_groups`` and ``state``, so schedulers and the
scaler see (and change) the inner optimizer. It adds nothing to the training step beyond what
:meth:`swarm.api.Swarm.step` does.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

from swarm.api import Swarm
from swarm.errors import ConfigError
from swarm.training.report import StepReport

logger = logging.getLogger(__name__)


class OuterLR(torch.optim.Optimizer):
    """Holds the outer learning rate so that a torch LR scheduler can drive it.

    Its one parameter group's ``lr`` is read before every swarm step; ``step()`` is called by
    :class:`SwarmOptimizer` after each averaging round (so a scheduler stepped per round sees a
    step before it). It updates no tensor itself.
    """

    def __init__(self, lr: float):
        super().__init__([torch.zeros(0)], {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        return None


class SwarmOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` so that ``step()`` is the swarm step (inner step, then rounds).

    Args:
        optimizer: the local (inner) optimizer over ``model``'s parameters.
        model: the module being trained (the swarm averages its parameters and buffers).
        swarm: an existing :class:`~swarm.api.Swarm` built on ``model`` and ``optimizer``;
            without it one is created from ``options``, and closed by :meth:`close`.
        samples_per_step: samples in one step's batch, used to weight rounds when the caller
            (a scheduler, Lightning, a Trainer) cannot pass ``samples``. Default: 1 per step.
        skip_non_finite: check the gradients before each step and skip a step (not counted,
            nothing averaged) whose gradients hold NaN or Inf. ``GradScaler`` already skips such
            steps without calling ``step()``; this guards code without a scaler. The check is one
            device-to-host sync per step: turn it off if that shows up in a profile.
        **options: ``run_id``, ``initial_peers`` and any :class:`~swarm.config.SwarmConfig` or
            :class:`~swarm.config.PeerConfig` field, as for :class:`~swarm.api.Swarm`.

    Attributes:
        outer: an :class:`OuterLR` to give an LR scheduler for the outer (DiLoCo) learning rate;
            step that scheduler when ``last_report.round_due`` is true.
        last_report: the :class:`~swarm.training.report.StepReport` of the last step.
        skipped_steps: steps skipped because of non-finite gradients.

    Raises:
        ConfigError: ``optimizer`` does not train ``model``'s parameters, or bad options.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        model: torch.nn.Module,
        swarm: Swarm | None = None,
        samples_per_step: float | None = None,
        skip_non_finite: bool = True,
        **options: Any,
    ):
        if isinstance(optimizer, SwarmOptimizer):
            raise ConfigError("the optimizer is already a SwarmOptimizer")
        mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if not {id(p) for p in model.parameters() if p.requires_grad} <= mine:
            raise ConfigError("the optimizer must train every trainable parameter of the model")
        if samples_per_step is not None and not samples_per_step > 0:
            raise ConfigError("samples_per_step must be positive")
        super().__init__([{"params": list(g["params"])} for g in optimizer.param_groups], {})
        # From here on param_groups, state and defaults are the inner optimizer's (properties).
        self.optimizer = optimizer
        self._own_swarm = swarm is None
        self.swarm = swarm if swarm is not None else Swarm(model, optimizer, **options)
        if self.swarm.engine.optimizer is not optimizer:
            raise ConfigError("the swarm was built on another optimizer")
        self.samples_per_step = samples_per_step
        self.skip_non_finite = skip_non_finite
        self.outer = OuterLR(self.swarm.engine.config.outer_lr)
        self.last_report: StepReport | None = None
        self.skipped_steps = 0

    # Share, not copy: schedulers and GradScaler must act on the inner optimizer, also after its
    # load_state_dict() replaced its param_groups (accelerate does that to place the state).
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._inner_or_own("param_groups")

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._set_inner_or_own("param_groups", value)

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._inner_or_own("state")

    @state.setter
    def state(self, value: Any) -> None:
        self._set_inner_or_own("state", value)

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._inner_or_own("defaults")

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._set_inner_or_own("defaults", value)

    def _inner_or_own(self, name: str) -> Any:
        inner = self.__dict__.get("optimizer")
        return getattr(inner, name) if inner is not None else self.__dict__[f"_own_{name}"]

    def _set_inner_or_own(self, name: str, value: Any) -> None:
        inner = self.__dict__.get("optimizer")
        if inner is not None:
            setattr(inner, name, value)
        else:  # torch.optim.Optimizer.__init__, before the inner optimizer is attached
            self.__dict__[f"_own_{name}"] = value

    def step(  # type: ignore[override]
        self, closure: Callable[[], Any] | None = None, samples: float | None = None
    ) -> Any:
        """One swarm step: the inner ``optimizer.step()``, and an averaging round when due.

        Args:
            closure: re-evaluates the model and returns the loss (as for any optimizer); it is
                called once, before the step.
            samples: samples in this step's batch (default: ``samples_per_step``, else 1).

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.skip_non_finite and not self._grads_finite():
            self.skipped_steps += 1
            logger.warning(
                "step skipped: gradients hold NaN or Inf (%d so far)", self.skipped_steps
            )
            return loss
        self._apply_outer_lr()
        report = self.swarm.step(samples if samples is not None else self.samples_per_step)
        self.last_report = report
        if report.round_due:
            self.outer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer state, outer state (anchor, momentum), counters and outer lr.

        The model's weights are not included (save them with the model, or use
        :meth:`swarm.api.Swarm.save` for one file with everything).
        """
        state = self.swarm.engine.state_dict(None)
        del state["model"]
        state["outer_lr"] = self.outer.param_groups[0]["lr"]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; all-or-nothing (raises CheckpointError, changes nothing)."""
        engine = self.swarm.engine
        full = {**state_dict, "model": engine.model.state_dict()}
        outer_lr = full.pop("outer_lr", None)
        engine.load_state_dict(full)
        if isinstance(outer_lr, (int, float)) and outer_lr > 0:
            self.outer.param_groups[0]["lr"] = float(outer_lr)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "swarm", None) is not None:
            raise ConfigError("the swarm's tensors are fixed when it starts: add groups before")
        super().add_param_group(param_group)

    def wait_round(self) -> StepReport | None:
        """Land the round still in flight (overlapped DiLoCo); call it before evaluating or
        saving the model at the end of training. None when no round runs."""
        return self.swarm.wait_round()

    def close(self) -> None:
        """Leave the swarm (when this wrapper created it)."""
        if self._own_swarm:
            self.swarm.close()

    def __enter__(self) -> SwarmOptimizer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _grads_finite(self) -> bool:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return True
        # One flag per tensor, then one sync for all of them.
        return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())

    def _apply_outer_lr(self) -> None:
        lr = self.outer.param_groups[0]["lr"]
        engine = self.swarm.engine
        if lr != engine.config.outer_lr:
            if not lr > 0:
                raise ConfigError(f"the outer learning rate must stay positive, got {lr}")
            engine.config = dataclasses.replace(engine.config, outer_lr=float(lr))
