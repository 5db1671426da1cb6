"""Rounds that average the model's values themselves: ``average_parameters()``.

Such a round brings its members to one model (e.g. at the end of training), with equal weights
(whole models, not samples). The k-th such round of every peer plans the same groups: a grid
across regions, whose axes come round in turn (see :mod:`swarm.averaging.groups.converge`).
How the values travel depends on the training codec:

- dense (``none``, ``fp16``, ``int8``): the values, in that codec; members that hold the same
  bits already (a swarm that trained as one group) skip it;
- top-K, 1-bit or ``sparse``, which would ruin raw values: the values in the dense
  ``anchor_sync_codec``, as anchor syncs do;
- in ``diloco`` under those codecs, each model also holds its error feedback and differs from
  the anchor the members share: each model's difference from its anchor instead
  (:func:`~swarm.training.rounds.differences_plan`), about 1/7 of an int8 round of the values.

Floating buffers (BatchNorm statistics) that the training rounds leave local (under a sparse
codec) get a round of their own, in ``anchor_sync_codec``: a few values a channel, yet the
statistics of each peer's own model sit badly under the averaged parameters. On the convergence
benchmark's simulation (sparse, 4 peers, seeds 0 and 1) the mean of the parameters ended at a
test loss of 0.5911 and 0.6011 with each peer's own statistics, 0.5873 and 0.5917 with their
mean too (each peer's own model: 0.5889 and 0.5940).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Generator
from typing import Protocol

import torch

from swarm.config import SwarmConfig
from swarm.training.outer import OuterState
from swarm.training.rounds import RoundOutcome, RoundPlan, differences_plan
from swarm.training.tensors import ModelTensors

ValuesFlow = Generator[RoundPlan, RoundOutcome, RoundOutcome]
"""``average_parameters()`` in progress: yields the rounds to run (answered as a step's are,
:func:`swarm.training.driver.drive`), returns the values round's outcome."""


class ValuesEngine(Protocol):
    """What :func:`average_values` uses of the training engine (which imports this module)."""

    values: ValuesRounds
    values_rounds: int  # values rounds begun
    lock: threading.Lock

    def begin_values_round(self) -> RoundPlan: ...

    def finish_values_round(self, outcome: RoundOutcome) -> None: ...


def average_values(engine: ValuesEngine) -> ValuesFlow:
    """``average_parameters()`` of ``engine``: the values round, then, where the training
    rounds leave floating buffers local, the buffers' round (not alone: nobody to average
    them with); the values round's outcome, with the bytes of both.

    Raises:
        TrainingError: a round is in flight.
    """
    outcome = yield engine.begin_values_round()
    engine.finish_values_round(outcome)
    buffers = engine.values.buffers_plan(engine.values_rounds - 1)
    if buffers is None or not outcome.averaged:
        return outcome
    kept = yield buffers
    with engine.lock:
        engine.values.apply_buffers(buffers, kept)
    return dataclasses.replace(
        outcome,
        bytes_sent=outcome.bytes_sent + kept.bytes_sent,
        bytes_received=outcome.bytes_received + kept.bytes_received,
    )


class ValuesRounds:
    """Plans and applies the rounds of :mod:`swarm.training.final_average` for one model.

    Args:
        outer: the engine's outer state (its slots carry the round; its anchors follow).
        model: the model, for the floating buffers the training rounds leave local.
        config: the swarm's configuration.
        differences: average each model's difference from its anchor (``diloco`` whose
            model keeps the error feedback of a sparse codec).
    """

    def __init__(
        self, outer: OuterState, model: torch.nn.Module, config: SwarmConfig, differences: bool
    ):
        self.outer = outer
        self.differences = differences
        codec = config.averaging.codec_spec
        self.codec = codec if codec.dense_values_ok else config.anchor_sync_spec
        self.sync_codec = config.anchor_sync_spec.text
        averaged = set(map(id, outer.tensors.buffers))
        every = ModelTensors.of(model).buffers
        self.local_buffers = tuple(b for b in every if id(b) not in averaged)

    def plan(self, number: int) -> RoundPlan:
        """The plan of the ``number``-th round of the model's values (call under the engine's
        lock: it fills the slots from the model)."""
        outer = self.outer
        if self.differences:
            outer.load_pseudo_grads()
            anchors = outer.anchor + outer.buffer_anchor
            return differences_plan(outer.slots, anchors, number, self.sync_codec)
        outer.load_values()
        values = {"purpose": "values", "number": number, "unless_equal": True}
        return RoundPlan(outer.slots, 1.0, 0.0, codec=self.codec.text, **values)

    def apply(self, outcome: RoundOutcome) -> None:
        """The model (and anchors) take an averaged round's result."""
        if not outcome.averaged:
            return
        if self.differences:
            self.outer.apply_mean_difference()
        else:
            self.outer.apply_values()

    def buffers_plan(self, number: int) -> RoundPlan | None:
        """The plan of the round of the local floating buffers that goes with the
        ``number``-th values round (fp32 copies), or None where there are none."""
        if not self.local_buffers:
            return None
        copies = [b.detach().to(torch.float32, copy=True) for b in self.local_buffers]
        values = {"purpose": "buffers", "number": number, "unless_equal": True}
        return RoundPlan(copies, 1.0, 0.0, codec=self.sync_codec, **values)

    @torch.no_grad()
    def apply_buffers(self, plan: RoundPlan, outcome: RoundOutcome) -> None:
        """The buffers take an averaged buffers round's result."""
        if outcome.averaged:
            for b, averaged in zip(self.local_buffers, plan.tensors, strict=True):
                b.copy_(averaged)
