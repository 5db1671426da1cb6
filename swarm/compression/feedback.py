"""Error feedback: what a lossy codec drops this time is added back next time.

For every call ``e = x + r; c = C(e); r <- d * (e - D(c))``, with the codec's decay ``d``
(:attr:`Codec.feedback_decay`, 1 for every codec but ``sparse``). With ``d = 1`` the sum of what
was sent tracks the sum of the inputs up to the current residual, which stays bounded, so top-K
and 1-bit converge like their uncompressed counterparts instead of losing the dropped mass for
good; ``d < 1`` forgets old dropped mass a little each round (SparseLoCo, Covenant-72B).
"""

from __future__ import annotations

from typing import Any

import torch

from swarm.compression.base import Codec, pack
from swarm.errors import CompressionError


class ErrorFeedback:
    """A residual for one logical tensor (or one averaging slot), wrapped around a codec.

    Memory: one residual buffer shaped like the tensor, in its dtype, on its device, created on
    the first :meth:`encode`. Use one instance per tensor/slot; it is not thread-safe.

    Args:
        codec: any codec; with ``none`` the residual stays zero.
    """

    def __init__(self, codec: Codec) -> None:
        if not isinstance(codec, Codec):
            raise CompressionError(f"ErrorFeedback needs a Codec, got {type(codec).__name__}")
        self.codec = codec
        self.residual: torch.Tensor | None = None

    def encode(self, tensor: torch.Tensor) -> bytes:
        """Encode ``tensor + residual`` and keep what the payload fails to carry.

        The sum is formed in the residual buffer itself (no second tensor-sized buffer), so
        when encoding fails on non-finite values the residual, contaminated, is reset to zero.

        Raises:
            CompressionError: shape/dtype/device differs from earlier calls, or non-finite input.
        """
        flat = self.codec._prepare(tensor)
        r = self._residual_for(tensor)
        r.add_(flat)  # r now holds e = x + r
        return encode_keeping_error(self.codec, r, tuple(tensor.shape))

    def _residual_for(self, tensor: torch.Tensor) -> torch.Tensor:
        r = self.residual
        if r is None:
            r = self.residual = torch.zeros(
                tensor.numel(), dtype=tensor.dtype, device=tensor.device
            )
        elif (r.numel(), r.dtype, r.device) != (tensor.numel(), tensor.dtype, tensor.device):
            raise CompressionError(
                f"ErrorFeedback holds a residual of {r.numel()} {r.dtype} on {r.device}, got a "
                f"tensor of {tensor.numel()} {tensor.dtype} on {tensor.device}; use one "
                "ErrorFeedback per tensor"
            )
        return r

    def reset(self) -> None:
        """Forget the residual (e.g. after the model was replaced by a downloaded state)."""
        if self.residual is not None:
            self.residual.zero_()

    def state_dict(self) -> dict[str, Any]:
        """The residual (a reference, like ``Module.state_dict``) and the codec spec."""
        return {"codec": self.codec.spec, "residual": self.residual}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a residual saved by :meth:`state_dict` (copied, onto the current device).

        Raises:
            CompressionError: the state is malformed or its size differs from the residual's.
        """
        if not isinstance(state, dict) or "residual" not in state:
            raise CompressionError("ErrorFeedback state needs a 'residual' entry")
        saved = state["residual"]
        if saved is None:
            self.residual = None
            return
        if not isinstance(saved, torch.Tensor) or not saved.is_floating_point():
            raise CompressionError("ErrorFeedback residual must be a float tensor")
        saved = saved.detach().reshape(-1)
        if self.residual is None:
            self.residual = saved.clone()
        elif saved.numel() != self.residual.numel():
            raise CompressionError(
                f"saved residual has {saved.numel()} elements, expected {self.residual.numel()}"
            )
        else:
            self.residual.copy_(saved)


def encode_keeping_error(
    codec: Codec,
    e: torch.Tensor,
    shape: tuple[int, ...] | None = None,
    decoded: torch.Tensor | None = None,
) -> bytes:
    """Encode flat ``e`` and leave in it the decayed error ``d * (e - D(C(e)))``; with
    ``decoded``, also write ``D(C(e))`` there (what receivers apply).

    ``D`` runs on the device-side sections, not on the bytes: no parse, and on a GPU no trip of
    the payload back to the device.

    Raises:
        CompressionError: ``e`` is not finite; it is zeroed (a poisoned residual).
    """
    try:
        header, sections = codec._encode(e, shape if shape is not None else tuple(e.shape))
    except CompressionError:
        e.zero_()
        raise
    payload = pack(header, sections)  # first: a section may alias e itself (codec "none")
    if decoded is None:
        codec._decode(header, sections, e, True, -1.0)
    else:
        codec._decode(header, sections, decoded, False, 1.0)
        e.sub_(decoded)
    if codec.feedback_decay != 1.0:
        e.mul_(codec.feedback_decay)
    return payload
