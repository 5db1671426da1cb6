"""The named choices among a config's settings: training mode, grouping and aggregator.

``str`` enums, so configs and checkpoints keep their text form (``Mode.DILOCO == "diloco"``);
:mod:`swarm.config` validates the settings that use them and re-exports them.
"""

from __future__ import annotations

import enum


class Mode(str, enum.Enum):
    """What an averaging round averages, and when (``SwarmConfig.mode``).

    A ``str`` enum: ``Mode.DILOCO == "diloco"``, so configs and checkpoints keep their text form.
    """

    DILOCO = "diloco"  # pseudo-gradient every inner_steps, then an outer Nesterov step
    LOCAL_SGD = "local_sgd"  # parameter values every inner_steps
    GRADIENTS = "gradients"  # gradients at every step, before optimizer.step() (like DDP)

    def __str__(self) -> str:
        return self.value

    @property
    def has_outer_step(self) -> bool:
        """The round feeds an outer optimizer (with momentum) instead of replacing values."""
        return self is Mode.DILOCO

    @property
    def averages_values(self) -> bool:
        """The round averages raw parameter values (sparse codecs would ruin them)."""
        return self is Mode.LOCAL_SGD

    @property
    def averages_gradients(self) -> bool:
        """Every step is a round, run before ``optimizer.step()`` on the averaged gradients."""
        return self is Mode.GRADIENTS


TRAINING_MODES = tuple(m.value for m in Mode)


class Grouping(str, enum.Enum):
    """Who a peer looks for partners with (``AveragingConfig.grouping``)."""

    LATENCY = "latency"  # near peers by Vivaldi coordinates, regions mixed every cross_every-th
    RANDOM = "random"  # the same group sizes with random members (a baseline)
    FIXED = "fixed"  # every peer declares under group_key alone

    def __str__(self) -> str:
        return self.value


class Aggregator(str, enum.Enum):
    """How a part owner reduces its part (``AveragingConfig.aggregator``)."""

    CENTERED_CLIP = "centered_clip"  # capped weights, CenteredClip around the median
    MEAN = "mean"  # the plain weighted mean (trusted swarms only)

    def __str__(self) -> str:
        return self.value


GROUPINGS = tuple(g.value for g in Grouping)
AGGREGATORS = tuple(a.value for a in Aggregator)
