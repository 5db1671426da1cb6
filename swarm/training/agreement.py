"""Which state a late joiner adopts: what providers holding most of the weight agree on (no I/O).

No provider is trusted and identities are free, so a count of providers decides nothing on its
own. A joiner asks providers for a manifest (round, size, SHA-256, a sketch of the values and
the provider's recent loss) and weighs each by what an outsider cannot buy cheaply:

- time: how long the DHT has held the provider's peer record (``age_s``, the lower median of
  what its holders witnessed): ``1 + (min(age_s, AGE_CAP_S) - AGE_GRACE_S) / AGE_UNIT_S``, and 1
  below ``AGE_GRACE_S``. A swarm where everybody is new decides by count; a provider whose
  record is a minute old weighs 10, more than 9 fresh identities; past ``AGE_CAP_S`` age adds
  nothing, so old peers never dominate for good. The grace keeps the noise of a young swarm out
  of the decision: a holder witnesses a slot from when it got it, so there a peer that trained
  for a minute reads about as old as identities that joined a second ago (their own nodes
  among its holders), and a second either way must not hand the decision to them;
- addresses: providers reached at addresses of one subnet (IPv4 /24, IPv6 /48; a relayed peer
  sits at its relay's) share the weight of the subnet's oldest among them, each in proportion to
  its own. A thousand identities on one host weigh as one; so do honest peers behind one NAT or
  in one data-center subnet, which costs them only when they disagree with providers elsewhere.

- Broken offers count nowhere, neither towards a majority nor in its denominator: a sketch of
  another length (another model) or with values that are not finite, a loss that is not finite,
  a round past :data:`~swarm.training.snapshot.MAX_ROUND`. (The transfer drops malformed and
  oversized manifests and providers that decline before they get here.)
- The round: within ``max(ROUND_SLACK, ROUND_SLACK_SHARE x median)`` of the weighted median
  round (a provider claiming a round far ahead, or far behind, is out of line). Round counters
  drift apart between honest peers (a peer alone runs rounds at its own pace), so this catches
  the absurd claim, not a few rounds of difference.
- The values: the sketch (norms of ``SKETCH_SLICES`` equal slices of the flat state) within
  ``SKETCH_TOLERANCE`` (relative L2) of the coordinate-wise weighted median sketch. Peers of one
  swarm hold nearby states, but after rounds in different groups rarely identical ones, so
  agreement is closeness, not equal hashes.
- The loss, where at least three providers report one: at most ``LOSS_FACTOR`` times the
  weighted median.

A state is adopted only when the providers in line hold a strict majority of the weight of all
valid offers; the joiner then downloads from the exact state whose holders weigh most, and
checks that what arrives has the announced hash and sketch and only finite values. Without a
majority the joiner asks again after a short wait, and if there is still none it trains from its
own state and averages in later (:mod:`swarm.training.joining`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from swarm.identity import PeerID
from swarm.net.record import PeerRecord
from swarm.training.snapshot import MAX_ROUND

ROUND_SLACK = 10  # rounds a provider may be ahead of or behind the median, at least
ROUND_SLACK_SHARE = 0.25  # ... or this share of the median round, whichever is more
SKETCH_SLICES = 64  # values in a sketch, whatever the model's size
SKETCH_TOLERANCE = 0.25  # largest relative L2 distance of a sketch to the median sketch
LOSS_FACTOR = 2.0  # largest recent loss relative to the providers' median
MIN_LOSSES = 3  # losses needed before they are compared
AGE_GRACE_S = 15.0  # record age that adds no weight yet: "fresh"
AGE_UNIT_S = 5.0  # seconds of record age past the grace worth one more fresh provider
AGE_CAP_S = 600.0  # record age past this adds no weight (a weight of at most 118)


def provider_weight(age_s: float) -> float:
    """A provider's weight from its record's age in the DHT (see the module docstring)."""
    if not isinstance(age_s, float | int) or not math.isfinite(age_s) or age_s <= AGE_GRACE_S:
        return 1.0
    return 1.0 + (min(float(age_s), AGE_CAP_S) - AGE_GRACE_S) / AGE_UNIT_S


@dataclass(frozen=True)
class Manifest:
    """One provider's answer: which state it would send (all fields but ``age_s`` its claims)."""

    provider: PeerRecord  # who answered (its signed record)
    round: int
    size: int
    sha256: str
    steps_in_round: int
    sketch: tuple[float, ...]  # see :func:`sketch_of`
    loss: float | None = None  # the provider's recent mean training loss, if its script passes it
    order: int | None = None  # the round order the provider plans groups with, if it averages
    age_s: float = 0.0  # how long the DHT has held the provider's record (not its claim)
    subnet: str = ""  # of the address it was reached at (swarm.hosts); "" counts as its own

    @property
    def provider_id(self) -> PeerID:
        return self.provider.peer_id

    @property
    def key(self) -> tuple[int, str, int]:
        return (self.round, self.sha256, self.size)


@dataclass(frozen=True)
class Verdict:
    """The outcome of :func:`agree`."""

    accepted: tuple[Manifest, ...]  # providers in line with the majority
    refused: tuple[tuple[Manifest, str], ...]  # (provider, why) for every one out of line
    majority: bool  # the accepted providers hold a strict majority of the valid offers' weight
    weight: float = 0.0  # of the accepted providers
    total: float = 0.0  # of every valid offer (broken ones count nowhere)
    shares: dict[PeerID, float] = field(default_factory=dict, compare=False)  # provider -> weight

    def candidates(self, limit: int = 3) -> list[list[Manifest]]:
        """Groups of accepted providers holding one exact state, heaviest first, then the
        newest round; at most ``limit`` groups."""
        weights: dict[tuple[int, str, int], float] = defaultdict(float)
        for m in self.accepted:
            weights[m.key] += self.shares.get(m.provider_id, 1.0)
        keys = sorted(weights, key=lambda k: (weights[k], k[0]), reverse=True)[:limit]
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


def weighted_median(
    values: Sequence[float], weights: Sequence[float], *, low: bool = False
) -> float:
    """The value with at most half the weight on either side; equal weights give
    ``statistics.median`` (``median_low`` with ``low``). Weights are positive."""
    pairs = sorted(zip(values, weights, strict=True))
    total = sum(w for _, w in pairs)
    acc = 0.0
    for i, (value, w) in enumerate(pairs):
        acc += w
        if _half(acc, total) == 0 and i < len(pairs) - 1:
            return value if low else (value + pairs[i + 1][0]) / 2
        if _half(acc, total) > 0 or i == len(pairs) - 1:
            return value
    raise ValueError("the median of nothing")


def shares_of(providers: Sequence[tuple[PeerID, float, str]]) -> dict[PeerID, float]:
    """The weight of each provider given as ``(id, age_s, subnet)``: its age's, the providers
    of one subnet sharing the weight of their oldest (see the module docstring); subnet ""
    counts as the provider's own."""
    subnets: dict[str | tuple[str, PeerID], list[tuple[PeerID, float]]] = defaultdict(list)
    for pid, age_s, subnet in providers:
        subnets[subnet or ("provider", pid)].append((pid, provider_weight(age_s)))
    out: dict[PeerID, float] = {}
    for members in subnets.values():
        scale = max(w for _, w in members) / sum(w for _, w in members)
        out.update((pid, w * scale) for pid, w in members)
    return out


def _half(part: float, total: float) -> int:
    """1 if ``part`` is more than half of ``total``, 0 if half, -1 if less (sums of shares
    carry rounding errors, which must not turn a tie into a majority)."""
    margin = 2 * part - total
    if abs(margin) <= 1e-9 * max(total, 1.0):
        return 0
    return 1 if margin > 0 else -1


def _distinct(manifests: Sequence[Manifest]) -> list[Manifest]:
    seen: set[PeerID] = set()
    out = []
    for m in manifests:
        if m.provider_id not in seen:
            seen.add(m.provider_id)
            out.append(m)
    return out


def _broken(m: Manifest, sketch_len: int) -> str | None:
    """Why an offer is broken (it then counts nowhere), or None."""
    if len(m.sketch) != sketch_len or not all(math.isfinite(x) for x in m.sketch):
        return "its sketch is malformed or not finite"
    if m.loss is not None and not math.isfinite(m.loss):
        return f"its loss is {m.loss}"
    if m.round > MAX_ROUND:
        return f"claims round {m.round}, past the largest sane round 2^40"
    return None


def agree(manifests: Sequence[Manifest], *, sketch_len: int) -> Verdict:
    """Keep the providers in line with the weighted majority (see the module docstring).

    Args:
        manifests: one per provider that answered (a provider counted twice counts once).
        sketch_len: the sketch length of this joiner's own model's state; another is broken.
    """
    refused: list[tuple[Manifest, str]] = []
    valid: list[Manifest] = []
    for m in _distinct(manifests):
        why = _broken(m, sketch_len)
        if why is None:
            valid.append(m)
        else:
            refused.append((m, why))
    shares = shares_of([(m.provider_id, m.age_s, m.subnet) for m in valid])
    left = valid
    if left:
        rounds = [m.round for m in left]
        median_round = int(weighted_median(rounds, _weights(left, shares), low=True))
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
        weights = _weights(left, shares)
        median = [
            weighted_median(col, weights) for col in zip(*(m.sketch for m in left), strict=True)
        ]
        kept = []
        for m in left:
            d = sketch_distance(m.sketch, median)
            if d > SKETCH_TOLERANCE:
                refused.append((m, f"its values are {d:.0%} away from the providers' median"))
            else:
                kept.append(m)
        left = kept
    reporting = [m for m in left if m.loss is not None]
    if len(reporting) >= MIN_LOSSES:
        median_loss = weighted_median([m.loss for m in reporting], _weights(reporting, shares))
        if median_loss > 0:
            limit = LOSS_FACTOR * median_loss
            kept = []
            for m in left:
                if m.loss is not None and m.loss > limit:
                    refused.append((m, f"its loss {m.loss:.4g} is over {limit:.4g}"))
                else:
                    kept.append(m)
            left = kept
    weight, total = sum(_weights(left, shares)), sum(shares.values())
    majority = _half(weight, total) > 0
    return Verdict(tuple(left), tuple(refused), majority, weight, total, shares)


def _weights(manifests: Sequence[Manifest], shares: dict[PeerID, float]) -> list[float]:
    return [shares[m.provider_id] for m in manifests]
