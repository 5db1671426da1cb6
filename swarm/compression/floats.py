"""Dense codecs that only change the float format: ``none``, ``fp16`` and ``bf16``.

``none`` sends the tensor's own dtype unchanged, so it is exact. ``fp16``/``bf16`` round to
nearest; values beyond the target format's range saturate at its largest finite value instead of
becoming inf (fp16 tops out at 65504: prefer ``bf16`` for tensors with a large range).
"""

from __future__ import annotations

import torch

from swarm.compression.base import Codec, Sections, check_finite, finite_total, section_as
from swarm.compression.header import Header, expect_lengths
from swarm.errors import CompressionError


class CastCodec(Codec):
    """Send every value in a fixed float format (or the tensor's own, for ``none``)."""

    nsections = 1

    def __init__(self, name: str, wire_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.name = name
        self.wire_dtype = wire_dtype  # None: the tensor's own dtype

    def _wire(self, dtype: torch.dtype) -> torch.dtype:
        return dtype if self.wire_dtype is None else self.wire_dtype

    def _body_bound(self, numel: int) -> int:
        size = 4 if self.wire_dtype is None else torch.finfo(self.wire_dtype).bits // 8
        return numel * size

    @classmethod
    def from_header(cls, header: Header) -> Codec:
        return CODECS_BY_NAME[header.codec]

    def _encode(self, flat: torch.Tensor, shape: tuple[int, ...]) -> tuple[Header, Sections]:
        wire = self._wire(flat.dtype)
        if not flat.numel():
            section = flat if wire == flat.dtype else flat.to(wire)
        elif wire == flat.dtype:
            check_finite(flat, finite_total(flat))
            section = flat
        else:
            low, high = torch.aminmax(flat)
            check_finite(flat, low, high)
            section = self._scratch("cast", flat.numel(), wire, flat.device)
            limit = torch.finfo(wire).max
            if float(high) > limit or float(low) < -limit:
                # Saturate instead of turning large finite values into inf.
                clamped = self._scratch("clamp", flat.numel(), flat.dtype, flat.device)
                section.copy_(torch.clamp(flat, -limit, limit, out=clamped))
            else:
                section.copy_(flat)
        header = Header(
            self.name, flat.dtype, shape, 0, 0, 0, (section.numel() * section.element_size(),)
        )
        return header, [section]

    def _validate(self, header: Header) -> None:
        if header.block_size or header.param or header.flags:
            raise CompressionError(f"{self.name} payload has non-zero block/param/flags fields")
        size = torch.finfo(self._wire(header.dtype)).bits // 8
        expect_lengths(header, (header.numel * size,))

    def _decode(
        self, header: Header, sections: Sections, out: torch.Tensor, accumulate: bool, weight: float
    ) -> None:
        values = section_as(sections[0], self._wire(header.dtype))
        total = finite_total(values)
        if not bool(torch.isfinite(total)) and not bool(torch.isfinite(values).all()):
            raise CompressionError(f"{self.name} payload holds non-finite values")
        if accumulate:
            out.add_(values, alpha=weight)
        else:
            out.copy_(values)


NONE = CastCodec("none", None)
FP16 = CastCodec("fp16", torch.float16)
BF16 = CastCodec("bf16", torch.bfloat16)
CODECS_BY_NAME: dict[str, CastCodec] = {c.name: c for c in (NONE, FP16, BF16)}
