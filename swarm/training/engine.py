"""The training loop's state machine, shared by the sync and async facades.

``step()`` = (``gradients``: average the gradients) → ``optimizer.step()`` → (every
``inner_steps``: an averaging round; with ``fragments`` F, every ``inner_steps / F`` steps a round
of the next fragment, :mod:`swarm.training.fragments`). :meth:`TrainingEngine.step` writes that
sequence once, as a generator that yields what it needs from the network; one driver answers
it for both facades, which differ only in how they wait (:mod:`swarm.training.driver`). It
yields

- a :class:`RoundPlan` with ``background`` False: run the round now, send its outcome back;
- a :class:`RoundPlan` with ``background`` True (``diloco`` with ``overlap``): start the round
  and send back its handle at once; a later step lands it (:mod:`swarm.training.overlap`);
- a :class:`~swarm.training.overlap.RoundWait`: a round is due while the last one still runs:
  wait for that one and send its outcome back.

Averaging works on fp32 copies (:class:`~swarm.training.outer.OuterState`), so a failed or cut
round never leaves the model half-averaged: the peer goes on alone and the step report says why.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Generator
from typing import Any

import torch

from swarm.config import Mode, SwarmConfig
from swarm.errors import TrainingError
from swarm.round_schedule import round_period
from swarm.training.cadence import Cadence
from swarm.training.divergence import DivergenceMonitor, as_loss, with_outer_step
from swarm.training.final_average import ValuesRounds
from swarm.training.fragments import split
from swarm.training.outer import OuterState
from swarm.training.outer_rule import OuterStep, outer_rule
from swarm.training.overlap import Flight, Overlap, RoundHandle, RoundWait, landing_share
from swarm.training.persistence import PersistentState
from swarm.training.report import RoundFailures, StepReport, Utilization
from swarm.training.rounds import RoundOutcome, RoundPlan, StepFlow
from swarm.training.tensors import ModelTensors

logger = logging.getLogger(__name__)


def _outcome(handle: RoundHandle) -> RoundOutcome:
    """The outcome of a round whose handle is done."""
    try:
        return handle.result()
    except (asyncio.CancelledError, concurrent.futures.CancelledError):
        return RoundOutcome.failed("round cancelled")


class TrainingEngine(PersistentState):
    """Mode logic, counters and state of one training peer (no networking)."""

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: SwarmConfig
    ):
        self.model = model
        self.optimizer = optimizer
        self.config = config
        self.mode = Mode(config.mode)
        sparse = config.averaging.codec_spec.sparse
        self.tensors = ModelTensors.of(model, with_buffers=not sparse)
        # anchors (gradients: the parameters) sync in a dense codec (see anchor_sync_every)
        self._sync_every = config.anchor_sync_period if self.mode is not Mode.LOCAL_SGD else 0
        self._stages_params = bool(self._sync_every) and self.mode is Mode.GRADIENTS
        self._sync_codec = config.anchor_sync_spec.text
        # error feedback kept in the model (see OuterState.keep_unsent)
        self._keep_unsent = sparse and self.mode is Mode.DILOCO
        self.schema = self.tensors.schema_hash()
        # the plain step of error feedback in the model keeps no momentum (outer_rule)
        self.outer = OuterState(
            self.tensors,
            keep_momentum=self.mode.has_outer_step and not self._keep_unsent,
            device=config.outer_device,
        )
        # Streaming DiLoCo: F fragments taking turns (see fragment), each with its outer state
        self.fragments = split(self.tensors, config.fragments)
        self._outers = (
            [self.outer.view(f.pieces) for f in self.fragments]
            if len(self.fragments) > 1
            else [self.outer]
        )
        self._overlaps = [Overlap(o, self._keep_unsent) for o in self._outers]
        self.values = ValuesRounds(self.outer, model, config, differences=self._keep_unsent)
        self._flight: Flight | None = None  # the round running in the background (overlap)
        self._deferred = False  # a clock round fell due in flight: it starts when that lands
        self._fragment: int | None = None  # of the round under way (see fragment)
        # what a round averages: written into the fp32 slots before it
        self._slots_loader = {
            Mode.DILOCO: OuterState.load_pseudo_grads,
            Mode.LOCAL_SGD: OuterState.load_values,
            Mode.GRADIENTS: OuterState.load_grads,
        }[self.mode]
        self.step_count = 0  # local optimizer steps
        self.round = 0  # completed averaging rounds (attempted ones count; see finish_round)
        self.values_rounds = 0  # values rounds begun (the k-th of every peer plans alike)
        self.steps_in_round = 0
        self.samples_in_round = 0.0
        self.samples_seen = 0.0  # all samples trained on, for the published samples/s
        self.utilization = Utilization()
        period = round_period(config.inner_steps)
        self.cadence = Cadence(
            None if config.auto_inner_steps or period else int(config.inner_steps),
            fragments=config.fragments,
            lowest=config.min_inner_steps,
            highest=config.max_inner_steps,
            overlapped=bool(config.overlap),
            start=config.min_inner_steps,
            period_s=period,
        )
        # Held while the model/anchor change, so a snapshot for a joiner is never torn.
        self.lock = threading.Lock()
        self._landed = threading.Condition(self.lock)  # notified when a round in flight lands
        self.failures = RoundFailures()
        self._last_group_size = 1  # of the last round (its outer rule guesses the next eager step)
        self.divergence = DivergenceMonitor()
        self._diverging = False  # the last round was flagged (log once per episode)
        self.last_loss: float | None = None  # the loss passed to the last step
        # from this round on the state is worth offering to joiners; None until the peer starts
        # a swarm, adopts or loads a state, or trains its own (StateProvider declines till then)
        self.offer_from_round: int | None = None

    # -- one step ---------------------------------------------------------------------------
    def step(self, samples: float | None = None, loss: object = None) -> StepFlow:
        """One ``swarm.step()``: the local step, and the averaging round when one is due.

        Yields what it needs from the network (see the module docstring) and returns the
        :class:`StepReport`. With ``overlap``, a due round starts in the background and this
        step returns at once; the round lands at the first later step that finds it done, or
        at the next due round, which waits for it (``wait_s`` in that step's report). On the
        wall clock (``inner_steps="30s"``) nothing waits: a round due while the last one runs
        starts at the first step after that one lands.

        Args:
            samples: samples in this step's batch (weights the round); default 1.
            loss: this step's loss (float or one-element tensor), for divergence reports.

        Raises:
            ValueError: ``samples`` is negative or not a number.
        """
        due = self.count(samples, loss)
        if self.mode.averages_gradients:
            # every step is a round, and optimizer.step() applies the averaged gradients
            plan = self.begin_round()
            report = self.finish_round(plan, (yield plan))
            self.inner_step()
            return report
        self.inner_step()
        flight = self._flight
        if due and flight is not None and self.cadence.period_s and not flight.handle.done():
            # on the wall clock the next round could only start when this one lands: train on
            # meanwhile and start it at the first step that finds this one landed
            self._deferred, due = True, False
        landed = None
        if self._flight is not None and (due or self._flight.handle.done()):
            landed = yield from self.land()
        if self._deferred and self._flight is None:
            self._deferred, due = False, True
        if not due:
            return landed or self.local_report()
        plan = self.begin_round()
        if not self.config.overlap:
            return self.finish_round(plan, (yield plan))
        fragment = self.fragment
        self.launch()
        # the live anchors move in flight (eager step): a sync averages those the round started
        # from, kept for the landing
        sync = self._overlaps[fragment].launch_anchors if plan.sync is not None else None
        patience = self.cadence.member_patience()  # it waits for its members while this trains
        handle = yield dataclasses.replace(plan, background=True, sync=sync, patience_s=patience)
        self._flight = Flight(handle, plan.started, fragment)
        if handle.done() and landed is None:  # already over (run in place, or alone): land it
            landed = yield from self.land()
            return dataclasses.replace(landed, round_started=True)
        report = landed or self.local_report()
        return dataclasses.replace(report, in_flight=self.in_flight, round_started=True)

    def wait_round(self) -> Generator[RoundWait, Any, StepReport | None]:
        """Wait for the round in flight and land it (before a save, a final average or an
        evaluation of the swarm's model); returns its report, or None when no round runs."""
        if self._flight is None:
            return None
        return (yield from self.land())

    def seconds_to_due(self) -> float | None:
        """About how long until the next round falls due (None: unknown, or every step is a
        round); a round in flight that the next one waits for does not count."""
        if self.mode.averages_gradients:
            return None
        return self.cadence.seconds_to_due(self.steps_in_round)

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
        self.cadence.step(self.utilization.waited)
        self.step_count += 1
        self.steps_in_round += 1
        self.samples_in_round += 1.0 if samples is None else float(samples)
        self.samples_seen += 1.0 if samples is None else float(samples)
        return self.cadence.due(self.steps_in_round)

    @property
    def fragment(self) -> int:
        """The fragment of the round under way (frozen at its start), or else the next one's: its
        count mod F, or on the clock its order mod F, which peers whose counts differ share."""
        if self._fragment is not None:
            return self._fragment
        return turn(self.round, self.cadence.clock_order(), len(self.fragments))

    def _load_slots(self) -> None:
        self._slots_loader(self._outers[self.fragment])

    def inner_step(self) -> None:
        with self.lock:
            self.optimizer.step()

    def begin_round(self) -> RoundPlan:
        """Fill the fp32 slots (of this round's fragment) with what this mode averages."""
        clock = self.cadence.clock_order()
        self._fragment = turn(self.round, clock, len(self.fragments))  # the order's instant
        outer = self._outers[self._fragment]
        with self.lock:
            self._load_slots()
            if self._stages_params:
                outer.stage_params()
        return RoundPlan(
            outer.slots,
            max(self.samples_in_round, 1e-6),
            time.perf_counter(),
            sync=outer.anchor + outer.buffer_anchor if self._sync_every else None,
            sync_every=self._sync_every,
            sync_codec=self._sync_codec,
            order=self.cadence.plan_order(self.round, clock),
            fragment=self.fragments[self.fragment].label,
            updates=not self.mode.averages_values,
            keep_unsent=self._keep_unsent,
        )

    def finish_round(self, plan: RoundPlan, outcome: RoundOutcome) -> StepReport:
        """Apply the round's result (or go on alone) and build the step report."""
        waited = time.perf_counter() - plan.started
        self.utilization.add_wait(waited)
        cfg = self.config
        outer = self._outers[self.fragment]
        with self.lock:
            norm, scale = None, 1.0
            if self.mode.averages_values:
                if outcome.averaged:
                    outer.apply_values()
                else:
                    outer.reset_anchor()
            else:
                if not outcome.averaged:
                    # A cut round may have half-written the slots: use our own values again.
                    self._load_slots()
                if self.mode.has_outer_step:
                    # Alone: plain local training; small groups: capped momentum (outer_rule).
                    step = self._outer_rule(outcome)
                    norm = None if step.solitary else outer.pseudo_grad_norm()
                    scale = outer.apply_outer(step, nesterov=cfg.nesterov, norm=norm)
                    if self._keep_unsent:  # none where own values applied: alone, not finite
                        outer.keep_unsent(outcome.unsent, float(outcome.averaged and scale > 0))
                else:
                    if outcome.synced:  # (only where members' parameters differed)
                        outer.adopt_synced_params()
                    outer.apply_grads()
            self.round += 1
            self._fragment = None
            self.steps_in_round = 0
            self.samples_in_round = 0.0
        return self._round_report(outcome, waited, outcome.round_s or waited, norm, scale)

    def begin_values_round(self) -> RoundPlan:
        """The plan of a one-off round that averages the model's values themselves (see
        :mod:`swarm.training.final_average`).

        Raises:
            TrainingError: a round is in flight.
        """
        self._no_flight("average the parameters")
        number, self.values_rounds = self.values_rounds, self.values_rounds + 1
        with self.lock:
            return self.values.plan(number)

    def finish_values_round(self, outcome: RoundOutcome) -> None:
        """Apply a values round (the model and anchors take the average)."""
        with self.lock:
            self.values.apply(outcome)

    def _outer_rule(self, outcome: RoundOutcome) -> OuterStep:
        self._last_group_size = outcome.group_size if outcome.averaged else 1
        return self._rule_for_last_group()

    def _rule_for_last_group(self) -> OuterStep:
        """:func:`outer_rule` for the size of the group this peer last averaged with (a plain
        step where the model keeps the error feedback)."""
        cfg = self.config
        return outer_rule(
            self._last_group_size,
            lr=cfg.outer_lr,
            beta=cfg.outer_momentum,
            plain=self._keep_unsent,
        )

    # -- overlapped rounds (diloco) -----------------------------------------------------------
    def launch(self) -> None:
        """Keep ``Δ_local`` (just loaded) for the landing, take the eager outer step with it
        (the rule of the group size this peer averaged with last time) and start the next
        round's count."""
        cfg = self.config
        guess = self._rule_for_last_group()
        overlap = self._overlaps[self.fragment]
        with self.lock:
            overlap.keep_local()
            overlap.eager_step(guess, nesterov=cfg.nesterov)
            self.steps_in_round = 0
            self.samples_in_round = 0.0

    def land(self) -> Generator[RoundWait, Any, StepReport]:
        """Apply the round in flight (waiting for it if still running), one step or more late."""
        flight = self._flight
        if flight is None:
            raise TrainingError("no round in flight")
        waited = 0.0
        if flight.handle.done():
            outcome = _outcome(flight.handle)
        else:
            t0 = time.perf_counter()
            outcome = yield RoundWait(flight.handle, self.config.averaging.round_timeout_s + 10.0)
            waited = time.perf_counter() - t0
            self.utilization.add_wait(waited)
            logger.info(
                "round %d still running when the next was due: waited %.2fs for it",
                self.round + 1,
                waited,
            )
        with self._landed:
            norm, scale = self._overlaps[flight.fragment].land(
                self._outer_rule(outcome),
                nesterov=self.config.nesterov,
                steps_in_flight=self.steps_in_round,
                steps_per_round=self.cadence.round_steps,
            )
            if self._keep_unsent:  # by the share of the correction the model followed
                share = landing_share(self.steps_in_round, self.cadence.round_steps)
                kept = share if outcome.averaged and scale > 0 else 0.0
                self._outers[flight.fragment].keep_unsent(outcome.unsent, kept)
            self.round += 1
            self._flight, self._fragment = None, None
            self._landed.notify_all()
        round_s = outcome.round_s or time.perf_counter() - flight.started
        return self._round_report(outcome, waited, round_s, norm, scale)

    @property
    def in_flight(self) -> bool:
        """A round runs in the background (started, not landed yet)."""
        return self._flight is not None

    def _round_report(
        self,
        outcome: RoundOutcome,
        waited: float,
        round_s: float,
        norm: float | None,
        scale: float,
    ) -> StepReport:
        """The report of a round that was applied, with its failure and divergence logs.

        ``norm`` is the averaged pseudo-gradient's norm (None where no outer step ran) and
        ``scale`` the factor the norm bound cut it by (1.0: not cut; 0.0: not finite).
        """
        self.cadence.round_ended(round_s)  # "auto": the steps until the next rounds
        self.failures.log(self.round, outcome.averaged, outcome.group_size, outcome.reason)
        loss, divergence = self.divergence.end_round()
        divergence = with_outer_step(divergence, norm, scale)
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
            refusals=outcome.refusals,
            round_s=round_s,
            in_flight=self.in_flight,
            loss=loss,
            diverging=bool(divergence),
            divergence=divergence,
            pseudo_grad_norm=norm,
            inner_steps=self.cadence.inner_steps,
            synced=outcome.synced,
        )

    def local_report(self) -> StepReport:
        return StepReport.local(
            self.step_count,
            self.round,
            self.utilization.value,
            in_flight=self.in_flight,
            loss=self.last_loss,
            inner_steps=self.cadence.inner_steps,
        )


def turn(count: int, clock: int | None, fragments: int) -> int:
    """A round's fragment: its count mod F, or on the wall clock its clock order mod F."""
    return (count if clock is None else clock) % fragments
