"""Groups of two under a sparse codec: both members apply both members' own payloads (sans-I/O).

In a butterfly round the owner of a part averages what it received and sends the mean back,
compressed again. Under a sparse codec that second compression drops much of what the first
kept: the mean of two top-k selections holds up to 2k values a chunk, the reply k, and the
owner's error feedback sends the rest rounds later. In a group of two the reply costs what the
owner's own share of the part would cost to send, so the owner sends that instead: its own
values of the part, compressed with its own error feedback like any sender's, and in the reply's
header the two shares of the mean. Both members then apply

    share_owner * D(owner's payload) + share_sender * D(sender's payload)

by the same calls on the same bytes (:func:`compose`), so they hold the same bits on any device,
and each member's values reach the other compressed once instead of twice, for the same bytes.
The owner keeps no error feedback of its own for the part: what its payload leaves out stays in
its sender residual (where the round keeps one), as for every part it sends.

The shares are the owner's capped weights (CenteredClip averages two contributions as they are,
with capped weights, and the owner's record of the sender may lower its weight). The sender
checks them: two float32 numbers in [0, 1] that sum to 1, the owner's no larger than the cap
allows (``cap / (1 + cap)``: 2/3 at the default cap of 2). Either payload is as hostile as any
sender's: it is decoded under the same checks, and the receiver's owner check measures the
result against its own values as for any average.
"""

from __future__ import annotations

import math
import struct

import torch

from swarm.compression import Codec, decode_into
from swarm.errors import AveragingError

Shares = tuple[float, float]  # (the owner's share, the sender's share)

_SUM_TOLERANCE = 1e-6


def is_pairwise(updates: bool, codec: Codec, members: int) -> bool:
    """Whether a round exchanges the members' own payloads: a group of two averaging updates
    (pseudo-gradients, or the models' differences from their anchor at the end) in a sparse
    codec. Every member computes the same answer."""
    return updates and codec.sparse and members == 2


def pair_shares(owner_weight: float, sender_weight: float) -> Shares:
    """The two shares of the mean of weights already capped (float32 numbers; equal shares
    when both weights are 0, as CenteredClip counts rows whose weights sum to 0)."""
    total = owner_weight + sender_weight
    if not total > 0:
        return 0.5, 0.5
    owner = _float32(owner_weight / total)
    return owner, _float32(1.0 - owner)


def check_shares(value: object, robust: bool, cap: float) -> Shares:
    """The shares an owner's reply header gives (``"b"``), checked.

    Raises:
        AveragingError: not two float32 numbers in [0, 1] summing to 1, or (``robust``) the
            owner's over ``cap / (1 + cap)``.
    """
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(isinstance(v, float) for v in value)
        or not all(math.isfinite(v) and 0.0 <= v <= 1.0 and _float32(v) == v for v in value)
    ):
        raise AveragingError("the owner's shares are not two float32 numbers in [0, 1]")
    owner, sender = value
    if abs(owner + sender - 1.0) > _SUM_TOLERANCE:
        raise AveragingError(f"the owner's shares sum to {owner + sender!r}, not 1")
    if robust and owner > cap / (1.0 + cap) + _SUM_TOLERANCE:
        raise AveragingError(f"the owner's share {owner:.4g} is over the cap {cap:g} allows")
    return owner, sender


def compose(
    out: torch.Tensor, owner_payload: bytes, sender_payload: bytes | None, shares: Shares
) -> torch.Tensor:
    """``out = shares[0] * D(owner_payload) + shares[1] * D(sender_payload)`` (the owner's
    alone, whole, without a sender's). Both members call this with the same arguments.

    Raises:
        CompressionError: a payload is malformed or does not hold ``out.numel()`` values.
    """
    if sender_payload is None:
        return decode_into(owner_payload, out, accumulate=False)
    decode_into(owner_payload, out, shares[0], accumulate=False)
    return decode_into(sender_payload, out, shares[1])


def _float32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]
