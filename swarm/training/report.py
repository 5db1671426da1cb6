"""What ``swarm.step()`` returns, the one-line-per-round progress text, and the log of rounds
that were not averaged."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# A round that fails now and then (a planned member that went elsewhere, a busy moment) is
# logged at INFO: honest swarms meet it (2 of 3,537 rounds of 8 calm peers in 240 s). This many
# in a row are a peer training alone, which is worth a WARNING.
FAILED_ROUNDS_TO_WARN = 3


@dataclass(frozen=True)
class StepReport:
    """Outcome of one ``swarm.step()``.

    Most steps are plain local steps (``round_due`` False). On a step that ends an averaging
    round, ``averaged`` says whether the swarm average was applied; when it was not, ``reason``
    says why and the peer went on alone (a DiLoCo peer then applies its own pseudo-gradient).
    With overlapped rounds a round ends at the step where it lands, not where it started.
    """

    step: int  # local optimizer steps taken by this peer so far (this one included)
    round: int  # completed averaging rounds of the model this peer holds
    round_due: bool  # this step ended an averaging round (attempted)
    averaged: bool  # the round averaged with at least one other peer
    group_size: int  # peers in the group, this one included (0 when not averaged)
    bytes_sent: int  # bytes this peer sent in the round
    bytes_received: int  # bytes this peer received in the round
    wait_s: float  # seconds step() blocked on the swarm (matchmaking + all-reduce)
    utilization: float  # share of wall time spent computing (not waiting) since the start
    reason: str = ""  # why not averaged ("" when averaged or no round was due)
    refusals: tuple[str, ...] = ()  # peers the round clipped, capped, dropped, refused, accused
    round_s: float = 0.0  # seconds the round took, start to outcome (overlapped: not all waited)
    in_flight: bool = False  # a round still runs in the background after this step (overlap)
    # a round started in the background at this step, and its eager outer step moved the model
    # (overlap): the model changed although no round ended
    round_started: bool = False
    inner_steps: int = 0  # the inner steps per round in use (fitted with inner_steps="auto")
    loss: float | None = None  # the loss passed to step(): this step's, or the round's mean
    diverging: bool = False  # a sharp loss rise or pseudo-gradient norm jump (see divergence)
    divergence: str = ""  # what was seen ("" when not diverging)
    pseudo_grad_norm: float | None = None  # ‖Δ‖ averaged this round (diloco), before any bound
    # the group also synced its members' anchors (diloco) or their parameters, which differed
    # (gradients): the round sent about one more vector (see anchor_sync_every)
    synced: bool = False

    @classmethod
    def local(
        cls,
        step: int,
        round_: int,
        utilization: float,
        *,
        in_flight: bool = False,
        loss: float | None = None,
        inner_steps: int = 0,
    ) -> StepReport:
        """The report of a plain local step: no round ended, nothing sent; a loss that is not
        finite is flagged as diverging."""
        bad = loss is not None and not math.isfinite(loss)
        return cls(
            step=step,
            round=round_,
            round_due=False,
            averaged=False,
            group_size=0,
            bytes_sent=0,
            bytes_received=0,
            wait_s=0.0,
            utilization=utilization,
            in_flight=in_flight,
            loss=loss,
            diverging=bad,
            divergence="the loss is not finite" if bad else "",
            inner_steps=inner_steps,
        )

    def line(self, loss: float | None = None) -> str:
        """One progress line, e.g. for a log or a script's stdout."""
        text = f"round {self.round:4d} step {self.step:6d}"
        loss = self.loss if loss is None else loss
        if loss is not None:
            text += f" loss {loss:.4f}"
        if self.averaged:
            text += f" averaged with {self.group_size - 1} peers, sent {_size(self.bytes_sent)}"
            text += " (synced)" if self.synced else ""
        elif self.round_due:
            text += f" not averaged ({self.reason})"
        if self.diverging:
            text += f" DIVERGING ({self.divergence})"
        return text + f", waited {self.wait_s:.2f}s, utilization {self.utilization:.0%}"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


class Utilization:
    """Share of wall time not spent blocked on the swarm since the first step."""

    def __init__(self) -> None:
        self._start: float | None = None
        self.waited = 0.0

    def started(self) -> None:
        if self._start is None:
            self._start = time.perf_counter()

    def add_wait(self, seconds: float) -> None:
        self.waited += seconds

    @property
    def value(self) -> float:
        if self._start is None:
            return 1.0
        wall = time.perf_counter() - self._start
        return 1.0 if wall <= 0 else max(0.0, 1.0 - self.waited / wall)


class RoundFailures:
    """Logs the rounds a peer did not average: each new reason at INFO, and one WARNING once
    :data:`FAILED_ROUNDS_TO_WARN` rounds in a row were not (then INFO when one is again)."""

    def __init__(self) -> None:
        self.in_a_row = 0  # rounds not averaged since the last that was
        self._last_reason = ""

    def log(self, rnd: int, averaged: bool, group_size: int, reason: str) -> None:
        if averaged:
            if self.in_a_row >= FAILED_ROUNDS_TO_WARN:
                logger.info(
                    "round %d averaged with %d peers after %d rounds alone",
                    rnd,
                    group_size - 1,
                    self.in_a_row,
                )
            else:
                logger.debug("round %d averaged with %d peers", rnd, group_size - 1)
            self.in_a_row, self._last_reason = 0, ""
            return
        self.in_a_row += 1
        if self.in_a_row == FAILED_ROUNDS_TO_WARN:
            logger.warning(
                "rounds %d-%d not averaged (the last: %s); training on alone",
                rnd - FAILED_ROUNDS_TO_WARN + 1,
                rnd,
                reason,
            )
        elif reason != self._last_reason:  # one line per kind, not one per round
            logger.info("round %d not averaged: %s; training on alone", rnd, reason)
        self._last_reason = reason
