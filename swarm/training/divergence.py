"""Divergence watch: a sharp rise of the loss the script reports, round by round (no I/O).

The script passes its loss to ``step(loss=...)``; each round's mean is compared with the median
round mean of the last ``WINDOW`` rounds (a median, so one lucky round of small noisy batches does
not make the next normal one look like a rise). A round whose mean exceeds ``RISE`` times that
median by more than ``NOISE_Z`` standard errors of a mean of its steps (or that saw a non-finite
loss) is flagged: the step report carries the reason and the engine logs a WARNING when the peer
starts diverging. The standard error keeps short rounds quiet: an overlapped round that lands
soon after the one before holds a few steps, whose mean swings with single batches (one such
round of a calm run read 1.51x the median, its test loss unchanged: batches of 64 with 10% random
labels, a step's loss +-0.2 around 0.6). Pseudo-gradient norm jumps are caught by
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
NOISE_Z = 4.0  # a rise within this many standard errors of a round's mean is noise


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
        self._sum2 = 0.0
        self._count = 0
        self._bad = False  # a non-finite loss this round
        self.means: deque[float] = deque(maxlen=WINDOW)
        self.variances: deque[float] = deque(maxlen=WINDOW)  # of one step's loss, per round

    def add(self, loss: float) -> None:
        if math.isfinite(loss):
            self._sum += loss
            self._sum2 += loss * loss
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
        mean, bad, count, sum2 = self.round_mean, self._bad, self._count, self._sum2
        self._sum, self._sum2, self._count, self._bad = 0.0, 0.0, 0, False
        if bad:
            return mean, "the loss is not finite"
        if mean is None:
            return None, ""
        reason = ""
        if len(self.means) >= MIN_ROUNDS:
            usual = statistics.median(self.means)
            spread = math.sqrt(statistics.median(self.variances)) if self.variances else 0.0
            noise = NOISE_Z * spread / math.sqrt(count)
            if mean > RISE * usual and mean - usual > max(1e-6, noise):
                reason = (
                    f"the loss rose to {mean:.4g} from {usual:.4g} in the last rounds"
                    f" (a mean of {count} steps)"
                )
        self.means.append(mean)
        if count >= 2:
            self.variances.append(max(0.0, sum2 / count - mean * mean) * count / (count - 1))
        return mean, reason
