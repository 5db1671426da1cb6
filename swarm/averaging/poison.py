"""Slow-poison updates of the hostile-peer faults (sans-I/O): attacks that stay inside the
clip radius round after round (see :class:`swarm.averaging.faults.Fault`).

- IPM, inner-product manipulation (Xie et al., 2020): ``-eps`` times the attacker's own update;
- ALIE, "A little is enough" (Baruch et al., 2019): the per-coordinate mean minus ``z`` standard
  deviations of the colluders' updates (pooled through a :class:`Collusion`); an attacker alone
  estimates them from its own update as ``x`` and ``|x|``;
- stale: the attacker's update of ``STALE_ROUNDS`` rounds ago (:class:`History`);
- inside the radius: the attacker's update turned around, as far as the clip radius it saw on
  its own part allows (:func:`inside_radius`);
- free riding (a zero update, full samples claimed) needs no helper.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch

IPM_EPSILON = 0.5
ALIE_Z = 1.0
STALE_ROUNDS = 10
RADIUS_MARGIN = 0.9  # an inside-radius attacker aims this far out, as a share of the radius


def ipm(flat: torch.Tensor, eps: float = IPM_EPSILON) -> torch.Tensor:
    return flat * -eps


def alie(updates: list[torch.Tensor], z: float = ALIE_Z) -> torch.Tensor:
    """Mean minus ``z`` standard deviations per coordinate (one update: ``x - z |x|``)."""
    if len(updates) == 1:
        return updates[0] - z * updates[0].abs()
    stacked = torch.stack(updates)
    return stacked.mean(0) - z * stacked.std(0)


def inside_radius(flat: torch.Tensor, distance: float | None) -> torch.Tensor:
    """``flat`` moved ``distance`` away from itself, toward and past zero: the update turned
    around as far as a clip radius of ``distance`` lets a contribution go unclipped (its own
    update standing for the group's mean); honest until a radius was seen."""
    norm = float(torch.linalg.vector_norm(flat))
    if distance is None or norm == 0:
        return flat
    return flat * (1.0 - distance / norm)


class RadiusEstimate:
    """The clip radius an attacker saw on the part it owns, per value (over its rounds)."""

    def __init__(self) -> None:
        self._sum2, self._numel = 0.0, 0

    def add(self, radius: float, numel: int) -> None:
        if numel > 0 and math.isfinite(radius):
            self._sum2 += radius * radius
            self._numel += numel

    def distance(self, numel: int) -> float | None:
        """The radius a whole vector of ``numel`` values would see; None before any."""
        if not self._numel:
            return None
        return RADIUS_MARGIN * math.sqrt(self._sum2 / self._numel * numel)


class History:
    """An attacker's own past updates, to send one ``STALE_ROUNDS`` rounds old."""

    def __init__(self, rounds: int = STALE_ROUNDS):
        self._past: deque[torch.Tensor] = deque(maxlen=rounds + 1)

    def stale(self, flat: torch.Tensor) -> torch.Tensor:
        """The oldest update held (``rounds`` ago once that many were seen)."""
        if self._past and self._past[0].shape != flat.shape:
            self._past.clear()
        self._past.append(flat.detach().clone())
        return self._past[0]


class Collusion:
    """What colluding attackers share: each one's latest update (for ALIE)."""

    def __init__(self) -> None:
        self._latest: dict[int, torch.Tensor] = {}

    def alie(self, member: Any, flat: torch.Tensor) -> torch.Tensor:
        """ALIE from the colluders' latest updates of the same shape, ``flat`` for ``member``."""
        self._latest[id(member)] = flat.detach().clone()
        pooled = [u for u in self._latest.values() if u.shape == flat.shape]
        return alie(pooled)
