"""Bit packing on any device: 8 booleans per byte, least significant bit first.

On the CPU numpy's packbits/unpackbits are an order of magnitude faster than torch arithmetic
(measured 11 GB/s for packing); on CUDA the work stays on the GPU with shifts and a reduction.
"""

from __future__ import annotations

import numpy as np
import torch

_WEIGHTS: dict[torch.device, torch.Tensor] = {}
# Row b holds the 8 bits of byte value b, least significant first, as +1.0 / -1.0.
_SIGN_TABLE = torch.from_numpy(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(
        np.float32
    )
    * 2.0
    - 1.0
)
_SIGN_TABLES: dict[torch.device, torch.Tensor] = {}


def packed_size(nbits: int) -> int:
    """Bytes needed for ``nbits`` bits."""
    return (nbits + 7) // 8


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a flat bool tensor into uint8, 8 per byte (LSB first, zero padding)."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    n = mask.numel()
    padded = torch.zeros(packed_size(n) * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask
    weights = _WEIGHTS.get(mask.device)
    if weights is None:
        weights = _WEIGHTS[mask.device] = (1 << torch.arange(8, device=mask.device)).to(torch.uint8)
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, nbits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``nbits`` bits as a flat bool tensor."""
    if packed.device.type == "cpu":
        return torch.from_numpy(
            np.unpackbits(packed.numpy(), count=nbits, bitorder="little").view(np.bool_)
        )
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    bits = (packed[:, None] >> shifts) & 1
    return bits.view(-1)[:nbits].bool()


def padding_is_zero(packed: torch.Tensor, nbits: int) -> bool:
    """True when the bits past ``nbits`` in the last byte are zero (canonical payloads only)."""
    spare = packed.numel() * 8 - nbits
    if spare <= 0:
        return True
    return int(packed[-1]) >> (8 - spare) == 0


def signs_from_bits(packed: torch.Tensor, out: torch.Tensor) -> None:
    """Write +1/-1 per bit of ``packed`` into fp32 ``out`` of exactly ``8 * len(packed)``."""
    table = _SIGN_TABLES.get(packed.device)
    if table is None:
        table = _SIGN_TABLES[packed.device] = _SIGN_TABLE.to(packed.device)
    # One gather of 8 floats per byte, written straight into the reused output.
    torch.index_select(table, 0, packed.int(), out=out.view(-1, 8))
