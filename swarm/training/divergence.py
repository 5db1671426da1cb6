"""Divergence watch: a sharp rise of the loss the script reports, round by round (no I/O).

The script passes its loss to ``step(loss=...)``; each round's mean is compared with the median
round mean of the last ``WINDOW`` rounds (a median, so one lucky round of small noisy batches does
not make the next normal one look like a rise). A round whose mean exceeds ``RISE`` times that
median (or that saw a non-finite loss) is flagged: the step report carries the reason and the
engine logs a WARNING when the peer starts diverging. Pseudo-gradient norm jumps are caught by
the outer rule's norm bound (:mod:`swarm.training.outer_rule`), which reports through the same flag.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

import torch

RISE = 1.5  # a round mean above 1.5x the recent median is a sharp rise
WINDOW = 8  # rounds whose means make the recent median
MIN_ROUNDS = 2  # no verdict before this many rounds were seen


def as_loss(value: object) -> float:
    """A Python float from a float, an int or a one-element tensor (a CPU-GPU sync point).

    Raises:
        ValueError: anything else (a batch of losses, a string).
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError("loss must be a scalar (one element), e.g. loss.item()")
        return float(value.detach().item())
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"loss must be a number or a scalar tensor, got {type(value).__name__}")
    return float(value)


def with_outer_step(divergence: str, norm: float | None, scale: float) -> str:
    """``divergence`` with what the outer step saw: a pseudo-gradient ``norm`` that was not
    finite (the round's steps discarded), or one the norm bound cut by ``scale`` (< 1)."""
    if norm is not None and not math.isfinite(norm):
        lost = "the pseudo-gradient is not finite; the round's steps were discarded"
        return "; ".join(filter(None, [divergence, lost]))
    if scale < 1.0:
        jump = (
            f"the pseudo-gradient norm jumped to {norm:.4g}, {1 / scale:.1f}x the bound "
            "from recent rounds; scaled down to the bound"
        )
        return "; ".join(filter(None, [divergence, jump]))
    return divergence


class DivergenceMonitor:
    """Mean loss per round and the verdict on it."""

    def __init__(self) -> None:
        self._sum = 0.0
        self._count = 0
        self._bad = False  # a non-finite loss this round
        self.means: deque[float] = deque(maxlen=WINDOW)

    def add(self, loss: float) -> None:
        if math.isfinite(loss):
            self._sum += loss
            self._count += 1
        else:
            self._bad = True

    @property
    def round_mean(self) -> float | None:
        """Mean of this round's finite losses so far (None when none were passed)."""
        if self._bad:
            return math.nan
        return self._sum / self._count if self._count else None

    def end_round(self) -> tuple[float | None, str]:
        """Close the round: ``(its mean loss, why it looks divergent or "")``."""
        mean, bad = self.round_mean, self._bad
        self._sum, self._count, self._bad = 0.0, 0, False
        if bad:
            return mean, "the loss is not finite"
        if mean is None:
            return None, ""
        reason = ""
        if len(self.means) >= MIN_ROUNDS:
            usual = statistics.median(self.means)
            if mean > RISE * usual and mean - usual > 1e-6:
                reason = f"the loss rose to {mean:.4g} from {usual:.4g} in the last rounds"
        self.means.append(mean)
        return mean, reason
