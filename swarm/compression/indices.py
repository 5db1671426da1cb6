"""Compact encodings of a sorted set of k distinct indices into ``range(numel)``.

Three encodings; :func:`encode_indices` computes the exact size of each for the payload at hand
and keeps the smallest (ties go to the faster one to decode, in the order listed):

- ``FIXED``: gaps ``idx[i] - idx[i-1] - 1`` as little-endian integers of the smallest width
  (1, 2, 4 or 8 bytes) that holds the largest gap. Best when gaps are uniform, e.g. top-1% of
  noise: the gaps fit 2 bytes, 2 bytes per index.
- ``VARINT``: the same gaps in LEB128 (7 bits per byte). Best when gaps are skewed: clustered
  indices take 1 byte each while the rare long jump takes a few, where ``FIXED`` would have to
  widen every gap for the longest one.
- ``BITMAP``: one bit per element, ``ceil(numel / 8)`` bytes whatever k is. Wins once more than
  roughly 1 element in 8-16 is kept, where any per-index encoding needs more than a byte per
  8-16 elements.

Decoding validates everything (count, range, termination, padding) and raises CompressionError.
"""

from __future__ import annotations

import torch

from swarm.compression.bits import pack_bits, packed_size, padding_is_zero, unpack_bits
from swarm.errors import CompressionError

FIXED, VARINT, BITMAP = 0, 1, 2
ENCODINGS = (FIXED, VARINT, BITMAP)
WIDTHS = (1, 2, 4, 8)
MAX_VARINT_BYTES = 9  # 63 bits: any gap below 2**63


def _gaps(idx: torch.Tensor) -> torch.Tensor:
    gaps = torch.empty_like(idx)
    if idx.numel():
        gaps[0] = idx[0]
        torch.sub(idx[1:], idx[:-1], out=gaps[1:])
        gaps[1:] -= 1
    return gaps


def _varint_lengths(gaps: torch.Tensor) -> torch.Tensor:
    lengths = torch.ones_like(gaps)
    for j in range(1, MAX_VARINT_BYTES):
        lengths += gaps >= (1 << (7 * j))
    return lengths


def _width(max_gap: int) -> int:
    for w in WIDTHS:
        if max_gap < 1 << (8 * w):
            return w
    raise CompressionError(f"gap {max_gap} does not fit 8 bytes")


def encoded_size_bound(k: int, numel: int) -> int:
    """Upper bound of the bytes :func:`encode_indices` produces for k of numel indices."""
    return min(packed_size(numel), k * _width(max(numel - 1, 0)))


def encode_indices(idx: torch.Tensor, numel: int) -> tuple[int, int, torch.Tensor]:
    """Encode sorted distinct int64 indices; returns ``(encoding, width, bytes)``.

    ``width`` is the byte width for ``FIXED`` and 0 otherwise. Work stays on ``idx``'s device.
    """
    k = idx.numel()
    gaps = _gaps(idx)
    max_gap = int(gaps.max()) if k else 0
    width = _width(max_gap)
    lengths = _varint_lengths(gaps)
    sizes = {FIXED: k * width, VARINT: int(lengths.sum()), BITMAP: packed_size(numel)}
    best = min(ENCODINGS, key=lambda e: (sizes[e], e))
    if best == BITMAP:
        mask = torch.zeros(numel, dtype=torch.bool, device=idx.device)
        mask[idx] = True
        return BITMAP, 0, pack_bits(mask)
    if best == FIXED:
        shifts = torch.arange(0, 8 * width, 8, device=idx.device)
        data = ((gaps[:, None] >> shifts) & 0xFF).to(torch.uint8)
        return FIXED, width, data.view(-1)
    ends = torch.cumsum(lengths, 0)
    starts = ends - lengths
    out = torch.empty(sizes[VARINT], dtype=torch.uint8, device=idx.device)
    for j in range(int(lengths.max()) if k else 0):
        sel = lengths > j
        chunk = (gaps[sel] >> (7 * j)) & 0x7F
        chunk |= (lengths[sel] > j + 1).long() << 7  # continuation bit
        out[starts[sel] + j] = chunk.to(torch.uint8)
    return VARINT, 0, out


def index_bytes_valid(encoding: int, width: int, nbytes: int, k: int, numel: int) -> bool:
    """Whether ``nbytes`` of index data is a possible length for this encoding (pre-allocation)."""
    if encoding == FIXED:
        return width in WIDTHS and nbytes == k * width
    if encoding == VARINT:
        return width == 0 and k <= nbytes <= k * MAX_VARINT_BYTES
    if encoding == BITMAP:
        return width == 0 and nbytes == packed_size(numel)
    return False


def decode_indices(
    encoding: int, width: int, data: torch.Tensor, k: int, numel: int
) -> torch.Tensor:
    """Decode index bytes into sorted distinct int64 indices, all in ``range(numel)``.

    Raises:
        CompressionError: the bytes are not a valid encoding of exactly k such indices.
    """
    if not index_bytes_valid(encoding, width, data.numel(), k, numel):
        raise CompressionError(
            f"index section of {data.numel()} bytes does not fit encoding {encoding} "
            f"(width {width}) for k={k} of {numel}"
        )
    if encoding == BITMAP:
        if not padding_is_zero(data, numel):
            raise CompressionError("top-K bitmap has bits set past the end of the tensor")
        idx = unpack_bits(data, numel).nonzero().view(-1)
        if idx.numel() != k:
            raise CompressionError(f"top-K bitmap holds {idx.numel()} indices, header says {k}")
        return idx
    if encoding == FIXED:
        if width == 8 and k and bool((data.view(k, 8)[:, 7] >= 0x80).any()):
            raise CompressionError("top-K index gap overflows 63 bits")
        gaps = torch.zeros(k, dtype=torch.int64, device=data.device)
        if k:
            cols = data.view(k, width).long()
            for j in range(width):
                gaps |= cols[:, j] << (8 * j)
    else:
        gaps = _decode_varint(data, k)
    if k and bool((gaps >= numel).any()):
        raise CompressionError("top-K index gap points past the end of the tensor")
    idx = torch.cumsum(gaps + 1, 0) - 1
    # Each term is in [1, numel], so a wrap-around of int64 would show as a decrease.
    if k and (int(idx[-1]) >= numel or not bool((idx[1:] > idx[:-1]).all())):
        raise CompressionError(f"top-K indices run past the end of the {numel}-element tensor")
    return idx


def _decode_varint(data: torch.Tensor, k: int) -> torch.Tensor:
    n = data.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=data.device)
    is_end = data < 0x80
    if not bool(is_end[-1]):
        raise CompressionError("top-K varint indices are truncated")
    count = int(is_end.sum())
    if count != k:
        raise CompressionError(f"top-K varint section holds {count} values, header says {k}")
    group = torch.cumsum(is_end, 0) - is_end.long()  # value number of every byte
    positions = torch.arange(n, device=data.device)
    ends = positions[is_end]
    starts = torch.cat([ends.new_zeros(1), ends[:-1] + 1])
    offset = positions - starts[group]
    if int(offset.max()) >= MAX_VARINT_BYTES:
        raise CompressionError("top-K varint index is longer than 9 bytes")
    terms = (data.long() & 0x7F) << (7 * offset)
    gaps = torch.zeros(k, dtype=torch.int64, device=data.device)
    gaps.index_add_(0, group, terms)
    if bool((gaps < 0).any()):
        raise CompressionError("top-K varint index overflows 63 bits")
    return gaps
