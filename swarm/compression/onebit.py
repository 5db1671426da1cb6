"""``1bit``: the sign of every element, 8 per byte, plus one scale per block.

The scale is the block's mean |x|, so a block decodes to ``sign(x) * mean(|x|)``: the L1 mass of
every block is preserved, the per-element detail is left to error feedback. Zero counts as
positive (one bit has no room for it); an all-zero block has scale 0 and decodes to zeros.

Sections: the scales (fp32, first for alignment), then ``ceil(numel / 8)`` bytes of sign bits
(bit set = non-negative, least significant bit first). Ratio ~31.5 at the default block size.
"""

from __future__ import annotations

import math

import torch

from swarm.compression.base import Codec, Sections, check_finite, section_as
from swarm.compression.bits import pack_bits, packed_size, padding_is_zero, signs_from_bits
from swarm.compression.blocks import MAX_BLOCK, MIN_BLOCK, blocks, check_scales
from swarm.compression.header import Header, expect_lengths
from swarm.errors import CompressionError, ConfigError


def block_mean_abs(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Mean |x| of each block of a flat fp32 tensor (the last block may be short)."""
    full, tail = blocks(x, block_size)
    out = torch.empty(math.ceil(x.numel() / block_size), dtype=torch.float32, device=x.device)
    if full.numel():
        # An L1 norm reduces without materializing |x|.
        torch.linalg.vector_norm(full, 1, dim=1, out=out[: full.shape[0]])
        out[: full.shape[0]] /= block_size
    if tail.numel():
        out[-1] = torch.linalg.vector_norm(tail, 1) / tail.numel()
    return out


class OneBitCodec(Codec):
    """Sign bits with a per-block mean-magnitude scale (use with error feedback).

    Args:
        block_size: elements per scale; smaller blocks follow magnitudes more closely at
            4 bytes per block (ratio = 32 / (1 + 32 / block_size)).
    """

    name = "1bit"
    sparse = True
    nsections = 2

    def __init__(self, block_size: int = 4096) -> None:
        super().__init__()
        if not isinstance(block_size, int) or not MIN_BLOCK <= block_size <= MAX_BLOCK:
            raise ConfigError(f"1bit block_size must be an int in [{MIN_BLOCK}, {MAX_BLOCK}]")
        self.block_size = block_size

    @property
    def spec(self) -> str:
        return f"1bit:{self.block_size}"

    def _body_bound(self, numel: int) -> int:
        return 4 * math.ceil(numel / self.block_size) + packed_size(numel)

    @classmethod
    def from_header(cls, header: Header) -> Codec:
        if not MIN_BLOCK <= header.block_size <= MAX_BLOCK:
            raise CompressionError(f"1bit payload has invalid block size {header.block_size}")
        return cls(header.block_size)

    def _validate(self, header: Header) -> None:
        if header.param or header.flags:
            raise CompressionError("1bit payload has non-zero param/flags fields")
        n = header.numel
        expect_lengths(header, (4 * math.ceil(n / self.block_size), packed_size(n)))

    def _encode(self, flat: torch.Tensor, shape: tuple[int, ...]) -> tuple[Header, Sections]:
        n, dev = flat.numel(), flat.device
        x = self._as_float32(flat)
        scales = block_mean_abs(x, self.block_size)
        check_finite(x, scales)
        mask = self._scratch("mask", n, torch.bool, dev)
        torch.ge(x, 0, out=mask)
        bits = pack_bits(mask)
        header = Header(
            self.name, flat.dtype, shape, self.block_size, 0, 0, (4 * scales.numel(), bits.numel())
        )
        return header, [scales, bits]

    def _decode(
        self, header: Header, sections: Sections, out: torch.Tensor, accumulate: bool, weight: float
    ) -> None:
        n = header.numel
        scales = section_as(sections[0], torch.float32)
        check_scales(scales, "1bit")
        bits = sections[1]
        if not padding_is_zero(bits, n):
            raise CompressionError("1bit payload has bits set past the end of the tensor")
        direct = out.dtype == torch.float32 and n % 8 == 0 and not accumulate
        target = (
            out if direct else self._scratch("dec", 8 * bits.numel(), torch.float32, out.device)
        )
        signs_from_bits(bits, target)
        full, tail = blocks(target[:n], self.block_size)
        full.mul_(scales[: full.shape[0], None])
        if tail.numel():
            tail.mul_(scales[-1])
        if direct:
            return
        if accumulate:
            out.add_(target[:n], alpha=weight)
        else:
            out.copy_(target[:n])
