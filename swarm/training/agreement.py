"""Which state a late joiner adopts: what a majority of distinct providers agree on (no I/O).

No provider is trusted, so a joiner asks several providers chosen at random for a manifest
(round, size, SHA-256, a sketch of the values and the provider's recent loss) and keeps only the
providers in line with the others:

- the round: within ``max(ROUND_SLACK, ROUND_SLACK_SHARE x median)`` of the median round (a
  lone provider claiming a round far ahead, or far behind, is refused). Round counters drift
  apart between honest peers (a peer alone runs its rounds at its own pace), so this catches the
  absurd claim, not a few rounds of difference;
- the values: the sketch (norms of ``SKETCH_SLICES`` equal slices of the flat state) within
  ``SKETCH_TOLERANCE`` (relative L2) of the coordinate-wise median sketch. Peers of one swarm
  hold nearby states, but after rounds in different groups rarely identical ones, so agreement is
  closeness, not equal hashes;
- the loss, where at least three providers report one: at most ``LOSS_FACTOR`` times the median.

The state is adopted only if the providers in line are a strict majority of the distinct providers
that answered; the joiner then downloads from those that hold the most common exact state, and
checks that what arrives has the announced hash and sketch and only finite values.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

ROUND_SLACK = 10  # rounds a provider may be ahead of or behind the median, at least
ROUND_SLACK_SHARE = 0.25  # ... or this share of the median round, whichever is more
SKETCH_SLICES = 64  # values in a sketch, whatever the model's size
SKETCH_TOLERANCE = 0.25  # largest relative L2 distance of a sketch to the median sketch
LOSS_FACTOR = 2.0  # largest recent loss relative to the providers' median
MIN_LOSSES = 3  # losses needed before they are compared


@dataclass(frozen=True)
class Manifest:
    """One provider's answer: which state it would send (all fields are its claims)."""

    provider: Any  # PeerRecord
    round: int
    size: int
    sha256: str
    steps_in_round: int
    sketch: tuple[float, ...]  # see :func:`sketch_of`
    loss: float | None = None  # the provider's recent mean training loss, if its script passes it
    order: int | None = None  # the round order the provider plans groups with, if it averages

    @property
    def key(self) -> tuple[int, str, int]:
        return (self.round, self.sha256, self.size)


@dataclass(frozen=True)
class Verdict:
    """The outcome of :func:`agree`."""

    accepted: tuple[Manifest, ...]  # providers in line with the majority
    refused: tuple[tuple[Manifest, str], ...]  # (provider, why) for every one out of line
    majority: bool  # the accepted providers are a strict majority of those that answered

    def candidates(self, limit: int = 3) -> list[list[Manifest]]:
        """Groups of accepted providers holding one exact state, most holders first, then the
        newest round; at most ``limit`` groups."""
        counts = Counter(m.key for m in self.accepted)
        keys = sorted(counts, key=lambda k: (counts[k], k[0]), reverse=True)[:limit]
        return [[m for m in self.accepted if m.key == k] for k in keys]


def sketch_of(values: torch.Tensor) -> tuple[float, ...]:
    """Norms of ``SKETCH_SLICES`` equal slices of a flat fp32 tensor (fewer if it is small)."""
    if values.numel() == 0:
        return ()
    chunks = torch.tensor_split(values.reshape(-1), min(SKETCH_SLICES, values.numel()))
    return tuple(float(n) for n in torch.stack([c.norm() for c in chunks]).tolist())


def sketch_distance(a: Sequence[float], b: Sequence[float]) -> float:
    """Relative L2 distance of sketch ``a`` to the reference sketch ``b``."""
    if len(a) != len(b):
        return math.inf
    diff = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b, strict=True)))
    scale = math.sqrt(sum(y * y for y in b))
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def _distinct(manifests: Sequence[Manifest]) -> list[Manifest]:
    seen: set[Any] = set()
    out = []
    for m in manifests:
        pid = getattr(m.provider, "peer_id", id(m.provider))
        if pid not in seen:
            seen.add(pid)
            out.append(m)
    return out


def agree(manifests: Sequence[Manifest], *, sketch_len: int) -> Verdict:
    """Keep the providers in line with the others (see the module docstring).

    Args:
        manifests: one per provider that answered (a provider counted twice counts once).
        sketch_len: the sketch length of this joiner's own model's state; another is refused.
    """
    answered = _distinct(manifests)
    refused: list[tuple[Manifest, str]] = []
    left: list[Manifest] = []
    for m in answered:
        if len(m.sketch) != sketch_len or not all(math.isfinite(x) for x in m.sketch):
            refused.append((m, "its sketch is malformed or not finite"))
        elif m.loss is not None and not math.isfinite(m.loss):
            refused.append((m, f"its loss is {m.loss}"))
        else:
            left.append(m)
    if left:
        median_round = statistics.median_low(m.round for m in left)
        slack = max(ROUND_SLACK, ROUND_SLACK_SHARE * median_round)
        kept = []
        for m in left:
            if abs(m.round - median_round) > slack:
                where = "ahead of" if m.round > median_round else "behind"
                refused.append(
                    (m, f"claims round {m.round}, far {where} the median {median_round}")
                )
            else:
                kept.append(m)
        left = kept
    if left:
        median = [statistics.median(col) for col in zip(*(m.sketch for m in left), strict=True)]
        kept = []
        for m in left:
            d = sketch_distance(m.sketch, median)
            if d > SKETCH_TOLERANCE:
                refused.append((m, f"its values are {d:.0%} away from the providers' median"))
            else:
                kept.append(m)
        left = kept
    losses = [m.loss for m in left if m.loss is not None]
    if len(losses) >= MIN_LOSSES and statistics.median(losses) > 0:
        limit = LOSS_FACTOR * statistics.median(losses)
        kept = []
        for m in left:
            if m.loss is not None and m.loss > limit:
                refused.append((m, f"its loss {m.loss:.4g} is over {limit:.4g}"))
            else:
                kept.append(m)
        left = kept
    majority = 2 * len(left) > len(answered)
    return Verdict(tuple(left), tuple(refused), majority)
