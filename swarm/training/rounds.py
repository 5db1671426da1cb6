"""What a training step and the network hand each other (no I/O): round plans and outcomes."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from swarm.training.overlap import RoundWait
from swarm.training.report import StepReport


class AveragedRound(Protocol):
    """What :func:`outcome_of` reads of a round's result (the averaging layer's
    ``RoundResult``, which this layer does not import)."""

    averaged: bool
    reason: str
    bytes_sent: int
    bytes_received: int
    refusals: tuple[Any, ...]  # each told as str(refusal)
    synced: bool
    unsent: torch.Tensor | None  # what this peer's payloads left out (see RoundOutcome)

    @property
    def group_size(self) -> int: ...


@dataclass(frozen=True)
class RoundOutcome:
    """What the training layer needs from one averaging round."""

    averaged: bool  # at least one other peer's values were averaged in
    group_size: int  # members including this peer (0 when not averaged)
    bytes_sent: int
    bytes_received: int
    reason: str = ""  # why not averaged
    refusals: tuple[str, ...] = ()  # peers clipped, capped, dropped, refused or accused, and why
    round_s: float = 0.0  # seconds from the round's start to its outcome
    synced: bool = False  # the group also averaged the synced tensors (anchors)
    # what this peer's payloads left out of its pseudo-gradient under a lossy codec (flat, in
    # slot order): the error-feedback residual, which the engine keeps in the model instead
    unsent: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @classmethod
    def failed(cls, reason: str, round_s: float = 0.0) -> RoundOutcome:
        """A round that averaged nothing, and why (this peer goes on alone)."""
        return cls(False, 0, 0, 0, reason, round_s=round_s)


def outcome_of(result: AveragedRound) -> RoundOutcome:
    """What training needs from the averaging layer's ``RoundResult``."""
    return RoundOutcome(
        averaged=result.averaged,
        group_size=result.group_size if result.averaged else 0,
        bytes_sent=result.bytes_sent,
        bytes_received=result.bytes_received,
        reason="" if result.averaged else (result.reason or "not averaged"),
        refusals=tuple(str(r) for r in result.refusals),
        synced=result.synced,
        unsent=result.unsent,
    )


@dataclass(frozen=True)
class RoundPlan:
    """A round about to run: the fp32 tensors to average in place and this peer's weight."""

    tensors: list[torch.Tensor]
    weight: float
    started: float  # perf_counter() when the round began
    background: bool = False  # start it and hand back its handle instead of waiting for it
    sync: list[torch.Tensor] | None = None  # anchors the group may also average (diloco)
    sync_every: int = 0  # about one group in this many averages ``sync`` too
    sync_codec: str | None = None  # the codec ``sync`` travels in (None: the round's)
    codec: str | None = None  # the codec ``tensors`` travel in (None: the swarm's)
    order: int | None = None  # this peer's round: orders the planned groups (see Averager)
    purpose: str = ""  # rounds of another purpose never group (e.g. "values": the parameters)
    fragment: str = ""  # the model fragment averaged (Streaming DiLoCo): others never group
    updates: bool = False  # ``tensors`` are updates (pseudo-gradients, gradients), not values
    # the engine keeps what the payloads leave out in its model (``RoundOutcome.unsent``)
    keep_unsent: bool = False
    # a round number every peer shares (part of the keys), e.g. its k-th values round: then
    # the groups bring the swarm to one model fastest (a grid across regions), not near ones
    number: int | None = None
    # skip the all-reduce when every member holds the same bits (a round of values)
    unless_equal: bool = False
    # how long to wait for planned members, if longer than the averager's default (None)
    patience_s: float | None = None

    def averaging_options(self) -> dict[str, Any]:
        """The keyword arguments of :meth:`swarm.averaging.Averager.average` for this round."""
        names = ("weight", "sync", "sync_every", "sync_codec", "codec", "order", "purpose")
        names += ("fragment", "updates", "keep_unsent", "unless_equal", "patience_s")
        numbered = {"round_": self.number, "converge": self.number is not None}
        return {name: getattr(self, name) for name in names} | numbered


DIFFERENCES_CODEC = "1bit:256"
"""The codec of :func:`differences_plan`'s round: the sign of each difference and one scale per
256, encoded by each sender and again by each part's owner, with no residual (about 1/7 of an
``int8`` round of the values). On the convergence benchmark's simulation (``sparse``, 4 peers,
seeds 0 and 1, the buffers averaged too) the models ended at a test loss of 0.5913 (the exact
mean of the models: 0.5893; each peer's own model: 0.5915); ``1bit`` with one scale per 4096
at 0.5918 for 10% fewer bytes, ``sparse:4096:1024:2`` at 0.5911 for 47% more."""


def differences_plan(
    slots: list[torch.Tensor], anchors: list[torch.Tensor], number: int, sync_codec: str
) -> RoundPlan:
    """A round that brings its members to the mean of their models as ``anchor - mean(Δ)``,
    where ``slots`` hold each member's ``Δ = θ_anchor - θ`` (``diloco`` under a sparse codec,
    whose models hold their error feedback and differ from the anchors the members share).

    The differences are a few percent of the values, so they travel in
    :data:`DIFFERENCES_CODEC` for about a seventh of an ``int8`` round of the values, as
    updates (the robust aggregator and update scoring refuse hostile ones as in training
    rounds). Members whose ``anchors`` differ average those too, in a second all-reduce in
    ``sync_codec`` (dense), so every member leaves with the same model; where every member's
    anchors are the same bits (a swarm that averaged as one group) that costs nothing. Equal
    weights: whole models, not samples."""
    return RoundPlan(
        slots,
        1.0,
        0.0,
        sync=anchors,
        sync_every=1,
        sync_codec=sync_codec,
        codec=DIFFERENCES_CODEC,
        purpose="values",
        number=number,
        updates=True,
    )


StepFlow = Generator[RoundPlan | RoundWait, Any, StepReport]
"""One step in progress: yields what it needs (see the module docstring), returns the report."""
