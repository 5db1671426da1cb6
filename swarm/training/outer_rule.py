"""The DiLoCo outer step: its arithmetic and the rule that adapts it to a swarm's groups.

DiLoCo's outer optimizer is Nesterov SGD (lr 0.7, momentum 0.9) on the averaged
pseudo-gradient ``Δ̄``; the state it moves is :class:`~swarm.training.outer.OuterState`'s.
The paper's rule assumes a fixed set of workers; a swarm's group changes every round and may be
one peer. :func:`outer_rule` adapts it (see the README's "Fidelity to the papers"):

- alone (nobody averaged in), no outer step: the anchor takes the local model as it is, exactly
  plain local training, and the momentum decays without being applied;
- with ``k`` members, the momentum is capped at ``1 - 1/k``: momentum multiplies a steady
  pseudo-gradient by ``1/(1 - β)``, and averaging ``k`` of them divides their noise variance by
  only ``k``, so the amplification never exceeds what averaging bought (2 peers: 0.5, 4: 0.75,
  8: 0.875, 10 or more: the configured 0.9);
- the averaged pseudo-gradient's norm is bounded by ``NORM_BOUND`` times the median of the
  last rounds' norms, so one bad round (a poisoned group, a peer that restarted far away) moves
  the anchor no further than a normal round would;
- the momentum **restarts** (O'Donoghue and Candès 2015, "Adaptive restart for accelerated
  gradient schemes") when the round's averaged pseudo-gradient points against it: the anchor
  went past where the group's data pulls it, and momentum would carry it further. That round's
  step is the plain ``lr · Δ``. Late contributions make the group's pull a delayed one, which
  momentum turns into a growing oscillation: 2 of 8 peers sending their updates of 10 rounds
  ago drove the honest peers' loss up round after round (see :data:`RESTART_BELOW`). An
  overlapped round decides it at its landing, from ``Δ̄``; its eager step never restarts;
- where the model keeps the error feedback (sparse codecs in ``diloco``), there is no momentum:
  a plain step of ``lr / (1 - β)``, the step the capped momentum gives a steady pseudo-gradient
  (see :data:`PLAIN_BETA_CAP`); in a pair, whose members apply each other's payloads whole,
  with β capped at :data:`PAIR_PLAIN_BETA` instead of 1/2.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@torch.no_grad()
def outer_step(
    anchor: Sequence[torch.Tensor],
    pseudo_grads: Sequence[torch.Tensor],
    momentum: Sequence[torch.Tensor],
    *,
    lr: float,
    beta: float,
    nesterov: bool = True,
) -> None:
    """Apply one outer SGD step to ``anchor`` from the averaged pseudo-gradients, in place.

    Same update as ``torch.optim.SGD(lr, momentum=beta, nesterov=...)`` with ``Δ`` as gradient.
    ``pseudo_grads`` is used as scratch space (its values are consumed). Without ``momentum``
    (an empty list: a plain step, see :func:`outer_rule`), ``θ ← θ - lr·Δ``.
    """
    if not momentum:
        for theta, delta in zip(anchor, pseudo_grads, strict=True):
            theta.sub_(delta, alpha=lr)
        return
    for theta, delta, m in zip(anchor, pseudo_grads, momentum, strict=True):
        m.mul_(beta).add_(delta)  # m ← βm + Δ
        update = delta.add_(m, alpha=beta) if nesterov else m  # Nesterov look-ahead: Δ + βm
        theta.sub_(update, alpha=lr)  # θ ← θ - lr·update


@torch.no_grad()
def momentum_cosine(
    momentum: Sequence[torch.Tensor], deltas: Sequence[torch.Tensor], delta_norm: float
) -> float:
    """The cosine of the momentum with ``deltas`` (of norm ``delta_norm``, which the round
    computed already) over all tensors; 0 where either is zero or not finite. One pass over
    each, one CPU-GPU sync."""
    if not momentum:
        return 0.0
    pairs = [*zip(momentum, deltas, strict=True), *zip(momentum, momentum, strict=True)]
    sums = torch.stack([torch.dot(a.reshape(-1), b.reshape(-1)) for a, b in pairs])
    dot, mm = sums.view(2, -1).sum(dim=1).tolist()  # m·Δ, m·m
    denom = math.sqrt(mm) * delta_norm
    return dot / denom if denom > 0 and math.isfinite(denom) and math.isfinite(dot) else 0.0


RESTART_BELOW = 0.0
"""The momentum restarts when its cosine with the averaged pseudo-gradient falls below this.

Measured on the slow-poison task (``tests/poison_run.py``, 40 rounds of 8 steps, groups of 4):
honest peers' cosines lie at 0.06-0.10 (5th percentile) to 0.86 (95th), so 0 restarts about
one honest round in 200, at no measurable cost to the loss. With 2 of 8 peers sending their
updates of 10 rounds ago (``Fault.STALE``), the cosine fell to -0.4 as the anchors oscillated,
and the honest peers' worst final loss was 0.20-2.59 (mean 0.70, seeds 0-5) without restarts
and 0.18-0.29 (mean 0.20) with them."""

PAIR_PLAIN_BETA = 2 / 3
"""The momentum a pair's plain step folds in (3x the learning rate, a group of three's step).

A pair's members apply each other's payloads whole (:mod:`swarm.averaging.butterfly.pairs`),
where owners re-sparsifying the mean sent what they left out rounds later, which a larger step
turned into oscillation. With pairs, final loss of ``sparse`` by plain step: the convergence
benchmark's CNN (simulation, 2 peers, 3 seeds) 0.6068 at 1.4, 0.6036 at 1.8, 0.5985 at 2.1
(int8 DiLoCo 0.5984); the language-model example (held-out bits per byte, seeds 0 and 1)
2.354 at 1.4, 2.316 at 1.6, 2.300 at 1.8, 2.281 at 2.0 (int8 DiLoCo 2.277), and 2.328 at 2.4
(seed 0, where 2.0 gave 2.274)."""

PLAIN_BETA_CAP = 0.875
"""The largest momentum a plain step folds in (8x the learning rate; see :func:`outer_rule`):
the largest group measured.

With ``sparse`` (error feedback in the model; before pairs exchanged their payloads), final
loss against the Nesterov step of the same momentum: the convergence benchmark's CNN task
(simulation) with 2 peers 0.6197 against 0.6247 (2 seeds), 4 peers 0.5955 against 0.5960
(2 seeds), 8 peers 0.5838 against 0.6032 (one seed; a plain step of 4x the learning rate:
0.5912); the language-model example (2 peers) 2.431 against 2.506 bits per byte (4 seeds),
where plain steps of 2x and 4x the learning rate ended at 2.57 and 3.27 (seed 0): the step
has to follow the group's size."""

NORM_BOUND = 3.0  # an averaged pseudo-gradient is scaled down to this x the recent median norm
NORM_HISTORY = 8  # rounds whose norms make that median
NORM_MIN_HISTORY = 3  # no bound until this many rounds were seen (a joiner has no history)


@dataclass(frozen=True)
class OuterStep:
    """The outer step one round applies: what :func:`outer_rule` decided."""

    lr: float  # outer learning rate (0 when alone: no outer step)
    beta: float  # momentum used this round
    solitary: bool  # nobody averaged in: the anchor follows the local model


def outer_rule(group_size: int, *, lr: float, beta: float, plain: bool = False) -> OuterStep:
    """The outer step for a round averaged over ``group_size`` peers (1 = alone).

    Alone, DiLoCo's Nesterov step would re-apply one noisy pseudo-gradient with a momentum
    built for the mean of many, and diverges (lr 0.7, momentum 0.9: loss rising for hundreds of
    rounds on the benchmark task); plain local training is the stable fixed point. In a group,
    the momentum is capped at ``1 - 1/k`` (see the module docstring).

    ``plain`` (error feedback kept in the model, see :meth:`OuterState.keep_unsent`): the
    momentum is folded into the step size, a plain step of ``lr / (1 - β)`` with ``β`` capped
    as above and at :data:`PLAIN_BETA_CAP` (in a pair at :data:`PAIR_PLAIN_BETA` instead):
    the step a steady pseudo-gradient gets from the momentum, without the momentum's memory
    of earlier rounds, which the model's error feedback already carries (see the README's
    "Fidelity to the papers: training").
    """
    if group_size <= 1:
        return OuterStep(0.0, 0.0 if plain else beta, solitary=True)
    capped = min(beta, 1.0 - 1.0 / group_size)
    if plain:
        # a pair's members apply each other's payloads whole (swarm.averaging.butterfly.pairs)
        folded = min(beta, PAIR_PLAIN_BETA) if group_size == 2 else min(capped, PLAIN_BETA_CAP)
        return OuterStep(lr / (1.0 - folded), 0.0, solitary=False)
    return OuterStep(lr, capped, solitary=False)
