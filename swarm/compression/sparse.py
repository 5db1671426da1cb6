"""``sparse``: top-k inside fixed chunks, values in a few bits, positions in 7-8 bits.

The codec of pseudo-gradients over home uplinks (SparseLoCo, arXiv 2508.15706; Covenant-72B's
top-64 of every 4096 values, 2-bit values). The flat tensor is cut into chunks of ``chunk``
values (a power of two; the last may be shorter); each chunk keeps its ``k`` largest magnitudes,
exactly (ties broken arbitrarily). A kept value is sent as its sign and a magnitude level: the
magnitudes kept in a *scale block* (``max(1, 4096 // chunk)`` consecutive chunks, so that a
block holds enough values to be worth two scales) span ``[lo, hi]``, cut into ``2^(bits-1)``
equal bins, and a value decodes to its bin's centre. ``lo`` is rounded down and ``hi`` up to
bfloat16, so every kept value lies within half a bin of what it decodes to.

Positions: a full chunk's ``k`` positions, in increasing order, are each split into a high part
(which of the chunk's ``chunk >> b`` slices it lies in, ``b = floor(log2(chunk / k))``) and its
``b`` low bits. The low bits are sent as they are; the high parts as a map of ``k + (chunk >> b)
- 1`` bits holding ``k`` ones, where the ``j``-th one stands at ``j + high_j`` (a one per
position, a zero after each slice but the last): 6 + 2 bits a position for 64 of 4096 and 5 +
2.3 for 96, against ``log2(4096)`` = 12 for a plain index, so the same bytes carry 1.5x the
values. The short last chunk's positions are sent in ``log2(chunk)`` bits each.

Sections, in order: the scale pairs (bfloat16 ``lo, hi`` per block); the positions (the full
chunks' maps, then their low bits, then the last chunk's positions, each packed LSB first from a
byte boundary); the codes (``bits`` bits each: the sign in the top bit, the magnitude level
below it). The default ``sparse:4096:96:2`` sends 116 bytes per 4096 values (0.23 bits per value,
141x fewer than fp32); ``sparse:4096:64:2`` 84 bytes (195x).

The codec drops most of each chunk: use it through error feedback, whose residual it asks to
decay by ``decay`` per round (:attr:`feedback_decay`; 0.95 by default, as SparseLoCo and
Covenant; 1 keeps the whole residual). In ``diloco`` the training engine keeps that residual in
the model rather than beside it (:meth:`swarm.training.outer.OuterState.keep_unsent`).

Every field of a payload is checked before use: section lengths, bfloat16 scales (finite,
``0 <= lo <= hi``), positions (``k`` per full chunk, strictly increasing, inside the last
chunk, none repeated) and the zero padding of every packed stream; anything else raises
:class:`~swarm.errors.CompressionError`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from swarm.compression.base import Codec, Sections, check_finite
from swarm.compression.bits import pack_bits, packed_size, padding_is_zero, unpack_bits
from swarm.compression.header import Header, expect_lengths
from swarm.errors import CompressionError, ConfigError

MAX_CHUNK = 1 << 16  # positions fit 16 bits
SCALE_SPAN = 4096  # values a pair of scales covers at least (whole chunks)
DEFAULT_CHUNK, DEFAULT_K, DEFAULT_BITS, DEFAULT_DECAY = 4096, 96, 2, 0.95


class SparseCodec(Codec):
    """Chunked top-k with low-bit values (see the module docstring).

    Args:
        chunk: values per chunk, a power of two in [2, 65536].
        k: values kept per chunk, in [1, chunk].
        bits: bits per kept value (the sign and ``bits - 1`` magnitude bits), in [2, 8].
        decay: what error feedback keeps of its residual each round, in (0, 1].
    """

    name = "sparse"
    sparse = True
    nsections = 3

    def __init__(
        self,
        chunk: int = DEFAULT_CHUNK,
        k: int = DEFAULT_K,
        bits: int = DEFAULT_BITS,
        decay: float = DEFAULT_DECAY,
    ) -> None:
        super().__init__()
        if type(chunk) is not int or not 2 <= chunk <= MAX_CHUNK or chunk & (chunk - 1):
            raise ConfigError(f"sparse chunk must be a power of two in [2, {MAX_CHUNK}]: {chunk!r}")
        if type(k) is not int or not 1 <= k <= chunk:
            raise ConfigError(f"sparse k must be an integer in [1, chunk={chunk}], got {k!r}")
        if type(bits) is not int or not 2 <= bits <= 8:
            raise ConfigError(f"sparse bits must be an integer in [2, 8], got {bits!r}")
        if not isinstance(decay, float | int) or not 0 < decay <= 1:
            raise ConfigError(f"sparse decay must be in (0, 1], got {decay!r}")
        self.chunk, self.k, self.bits = chunk, k, bits
        self.feedback_decay = float(decay)
        self.index_bits = chunk.bit_length() - 1
        self.low_bits = (chunk // k).bit_length() - 1  # floor(log2(chunk / k))
        self.map_bits = k + (chunk >> self.low_bits) - 1
        self.levels = 1 << (bits - 1)  # magnitude bins
        self.block_chunks = max(1, SCALE_SPAN // chunk)

    @property
    def spec(self) -> str:
        base = f"sparse:{self.chunk}:{self.k}:{self.bits}"
        return base if self.feedback_decay == DEFAULT_DECAY else f"{base}:{self.feedback_decay!r}"

    # ---- layout

    def layout(self, numel: int) -> tuple[int, int, int, int]:
        """(full chunks, values in the last short chunk, values kept, scale blocks)."""
        full, tail = divmod(numel, self.chunk)
        kept = full * self.k + min(self.k, tail)
        chunks = full + (1 if tail else 0)
        return full, tail, kept, math.ceil(chunks / self.block_chunks)

    def _lengths(self, numel: int) -> tuple[int, int, int]:
        _, _, kept, blocks = self.layout(numel)
        return 4 * blocks, sum(self._position_streams(numel)), packed_size(kept * self.bits)

    def _position_streams(self, numel: int) -> tuple[int, int, int]:
        """Bytes of the full chunks' maps, of their low bits and of the last chunk's positions."""
        full, _, kept, _ = self.layout(numel)
        return (
            packed_size(full * self.map_bits),
            packed_size(full * self.k * self.low_bits),
            packed_size((kept - full * self.k) * self.index_bits),
        )

    def _body_bound(self, numel: int) -> int:
        return sum(self._lengths(numel))

    @classmethod
    def from_header(cls, header: Header) -> Codec:
        try:
            return cls(chunk=header.block_size, k=header.param, bits=header.flags)
        except ConfigError as e:
            raise CompressionError(f"sparse payload settings: {e}") from None

    def _validate(self, header: Header) -> None:
        expect_lengths(header, self._lengths(header.numel))

    # ---- encode

    def _encode(self, flat: torch.Tensor, shape: tuple[int, ...]) -> tuple[Header, Sections]:
        x = self._as_float32(flat)
        numel = x.numel()
        full, tail, kept, blocks = self.layout(numel)
        mags = self._scratch("mags", numel, torch.float32, x.device)
        torch.abs(x, out=mags)
        if mags.device.type == "cpu":
            # the bits of a float >= 0 (NaN and inf included) order as int32s do, and torch's
            # CPU top-k of int32s takes about 0.7x the time of float32s'
            mags = mags.view(torch.int32)
        streams, values = [], []
        if full:
            rows = mags[: full * self.chunk].view(full, self.chunk)
            idx = torch.sort(_top_k_of_rows(rows, self.k), dim=1).values
            streams += self._pack_full_positions(idx)
            values.append(torch.gather(x[: full * self.chunk].view(full, self.chunk), 1, idx))
        if tail:
            idx = torch.topk(mags[full * self.chunk :], min(self.k, tail), sorted=False).indices
            streams.append(_pack(idx, self.index_bits))
            values.append(x[full * self.chunk :][idx])
        val = torch.cat([v.reshape(-1) for v in values]) if values else x.new_empty(0)
        # top-k ranks NaN and infinities first: a non-finite input is always among the kept
        check_finite(x, val)
        block = torch.arange(kept, device=x.device) // (self.k * self.block_chunks)
        lo, hi = _bounds(val.abs(), block, blocks)
        codes = self._quantize(val, block, lo, hi)
        scales = torch.stack([lo, hi], dim=1).to(torch.bfloat16).view(torch.int16).view(-1)
        header = Header(
            self.name,
            flat.dtype,
            shape,
            self.chunk,
            self.k,
            self.bits,
            self._lengths(numel),
        )
        positions = torch.cat(streams) if streams else x.new_empty(0, dtype=torch.uint8)
        return header, [scales.view(torch.uint8), positions, _pack(codes, self.bits)]

    def _pack_full_positions(self, idx: torch.Tensor) -> list[torch.Tensor]:
        """The map of high parts and the low bits of each row's sorted positions."""
        full = idx.shape[0]
        high = idx >> self.low_bits
        marks = high + torch.arange(self.k, device=idx.device)  # the j-th one at j + high_j
        bits = torch.zeros(full, self.map_bits, dtype=torch.bool, device=idx.device)
        bits.scatter_(1, marks, True)
        streams = [pack_bits(bits.view(-1))]
        if self.low_bits:
            streams.append(_pack(idx.reshape(-1) & ((1 << self.low_bits) - 1), self.low_bits))
        return streams

    def _quantize(
        self, val: torch.Tensor, block: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
    ) -> torch.Tensor:
        w = ((hi - lo) / self.levels).index_select(0, block)
        level = (val.abs() - lo.index_select(0, block)) / torch.where(w > 0, w, 1.0)
        level = torch.where(w > 0, level, 0.0)
        level = level.floor_().clamp_(0, self.levels - 1).to(torch.int64)
        return level + (val < 0).to(torch.int64) * self.levels

    # ---- decode

    def _decode(
        self, header: Header, sections: Sections, out: torch.Tensor, accumulate: bool, weight: float
    ) -> None:
        numel = header.numel
        _, _, kept, blocks = self.layout(numel)
        scales = sections[0].view(torch.int16).view(torch.bfloat16).float().view(blocks, 2)
        lo, hi = scales[:, 0], scales[:, 1]
        if not bool(torch.isfinite(scales).all()) or bool((lo < 0).any() | (hi < lo).any()):
            raise CompressionError("sparse payload has scales that are not finite, 0 <= lo <= hi")
        pos = self._unpack_positions(sections[1], numel)
        codes = _unpack(sections[2], self.bits, kept)
        block = torch.arange(kept, device=out.device) // (self.k * self.block_chunks)
        level = codes % self.levels
        width = (hi - lo) / self.levels
        mag = lo.index_select(0, block) + (level.float() + 0.5) * width.index_select(0, block)
        val = torch.where(codes >= self.levels, -mag, mag)
        chunk_of = torch.arange(kept, device=out.device) // self.k
        where = chunk_of * self.chunk + pos
        if not accumulate:
            out.zero_()  # (the caller scales an overwritten output itself)
        elif weight != 1.0:
            val.mul_(weight)
        out.index_add_(0, where, val.to(out.dtype))

    def _unpack_positions(self, section: torch.Tensor, numel: int) -> torch.Tensor:
        """Every kept value's position inside its chunk, checked (see the module docstring)."""
        full, tail, _, _ = self.layout(numel)
        maps, lows, _ = self._position_streams(numel)
        out = []
        if full:
            out.append(self._full_positions(section[:maps], section[maps : maps + lows], full))
        if tail:
            pos = _unpack(section[maps + lows :], self.index_bits, min(self.k, tail))
            if bool((pos >= tail).any()):
                raise CompressionError(
                    f"sparse payload has a position past its last chunk ({tail})"
                )
            if torch.unique(pos).numel() != pos.numel():
                raise CompressionError("sparse payload repeats a position within a chunk")
            out.append(pos)
        return torch.cat(out) if out else section.new_empty(0, dtype=torch.int64)

    def _full_positions(self, maps: torch.Tensor, lows: torch.Tensor, full: int) -> torch.Tensor:
        """The full chunks' positions from their maps and low bits (``k`` marks a map, counted
        before any is read; strictly increasing in each chunk)."""
        nbits = full * self.map_bits
        if not padding_is_zero(maps, nbits):
            raise CompressionError("sparse payload has non-zero padding bits")
        bits = unpack_bits(maps, nbits).view(full, self.map_bits)
        if not bool((bits.sum(dim=1) == self.k).all()):
            raise CompressionError(
                f"sparse payload's position map does not mark {self.k} positions in every chunk"
            )
        marks = bits.nonzero()[:, 1].view(full, self.k)  # row by row, increasing in each
        pos = (marks - torch.arange(self.k, device=marks.device)) << self.low_bits
        if self.low_bits:
            pos |= _unpack(lows, self.low_bits, full * self.k).view(full, self.k)
        if self.k > 1 and not bool((pos[:, 1:] > pos[:, :-1]).all()):
            raise CompressionError(
                "sparse payload repeats a position within a chunk or lists them out of order"
            )
        return pos.view(-1)


def _top_k_of_rows(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` largest values of each row (unsorted, ties broken arbitrarily).

    On the CPU, in two passes that read far fewer values than one top-k of the row: a row is
    seen as ``group`` strided slices, so that each position ``j < chunk / group`` names the
    group of values ``j, j + chunk/group, ...``; the ``k`` groups with the largest maxima hold
    the row's ``k`` largest values (for each ``i <= k``, either every value at least the row's
    i-th largest lies in them, or all ``k`` of their maxima are at least that large), so a top-k
    of their members finds values equal to the row's top ``k``.
    """
    n, chunk = rows.shape
    group = 1 << max(0, int(math.log2(math.sqrt(chunk / k))))
    if rows.device.type != "cpu" or group < 4:  # (the GPU's top-k is fast enough alone)
        return torch.topk(rows, k, dim=1, sorted=False).indices
    span = chunk // group
    sliced = rows.view(n, group, span)
    best = torch.topk(sliced.amax(dim=1), k, dim=1, sorted=False).indices
    members = torch.gather(sliced, 2, best.unsqueeze(1).expand(n, group, k)).view(n, group * k)
    pick = torch.topk(members, k, dim=1, sorted=False).indices  # slice * k + rank among best
    return torch.gather(best, 1, pick % k) + (pick // k) * span


def _bounds(mags: torch.Tensor, block: torch.Tensor, blocks: int) -> tuple[torch.Tensor, ...]:
    """Per scale block, the smallest and largest kept magnitude, rounded outwards to bfloat16
    (so that every magnitude of the block lies inside the rounded range)."""
    lo = torch.full((blocks,), math.inf, device=mags.device)
    hi = torch.zeros(blocks, device=mags.device)
    if mags.numel():
        lo.scatter_reduce_(0, block, mags, "amin")
        hi.scatter_reduce_(0, block, mags, "amax")
    lo = torch.where(torch.isfinite(lo), lo, 0.0)
    return _round_bf16(lo, down=True), _round_bf16(hi, down=False)


def _round_bf16(x: torch.Tensor, *, down: bool) -> torch.Tensor:
    """Non-negative ``x`` rounded to bfloat16 towards zero (``down``) or away from it."""
    bits = x.to(torch.bfloat16).view(torch.int16)
    back = bits.view(torch.bfloat16).float()
    step = (back > x) if down else (back < x)
    bits = bits - step.to(torch.int16) if down else bits + step.to(torch.int16)
    return bits.view(torch.bfloat16).float()


def _pack(values: torch.Tensor, width: int) -> torch.Tensor:
    """``width``-bit unsigned integers (``width`` <= 16), packed LSB first."""
    group = 8 // math.gcd(width, 8)  # values whose bits end on a byte boundary
    if group * width <= 64:  # every width but 9, 11, 13 and 15: such groups fit an int64
        return _pack_words(values, width, group)
    if values.device.type == "cpu":
        # the low ``width`` bits of each little-endian uint16, then all of them back to back
        words = values.to(torch.int16).numpy().view(np.uint8).reshape(-1, 2)
        bits = np.unpackbits(words, axis=1, bitorder="little")[:, :width]
        return torch.from_numpy(np.packbits(bits.reshape(-1), bitorder="little"))
    shifts = torch.arange(width, device=values.device)
    bits = ((values.unsqueeze(1) >> shifts) & 1).to(torch.bool)
    return pack_bits(bits.reshape(-1))


def _pack_words(values: torch.Tensor, width: int, group: int) -> torch.Tensor:
    """:func:`_pack` through int64 words of ``group`` values each (whole bytes), on the
    values' device: the stream's bytes are the words' low bytes, in order."""
    count = values.numel()
    words = math.ceil(count / group)
    v = torch.zeros(words * group, dtype=torch.int64, device=values.device)
    v[:count] = values
    v = v.view(words, group) << torch.arange(0, group * width, width, device=values.device)
    word = v.sum(dim=1, keepdim=True)  # disjoint bits: the sum is their OR
    nbytes = group * width // 8
    shifts = torch.arange(0, 8 * nbytes, 8, device=values.device)
    out = ((word >> shifts) & 0xFF).to(torch.uint8).view(-1)
    return out[: packed_size(count * width)]


def _unpack(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Inverse of :func:`_pack` (the padding of the last byte must be zero)."""
    nbits = count * width
    if not padding_is_zero(packed, nbits):
        raise CompressionError("sparse payload has non-zero padding bits")
    group = 8 // math.gcd(width, 8)
    if group * width <= 64:
        return _unpack_words(packed, width, count, group)
    if packed.device.type == "cpu":
        bits = np.unpackbits(packed.numpy(), count=nbits, bitorder="little").reshape(count, width)
        words = np.zeros((count, 16), dtype=np.uint8)
        words[:, :width] = bits
        packed16 = np.packbits(words, axis=1, bitorder="little").view(np.uint16).reshape(-1)
        return torch.from_numpy(packed16.astype(np.int64))
    bits = unpack_bits(packed, nbits).view(count, width).to(torch.int64)
    shifts = torch.arange(width, device=packed.device)
    return (bits << shifts).sum(dim=1)


def _unpack_words(packed: torch.Tensor, width: int, count: int, group: int) -> torch.Tensor:
    """Inverse of :func:`_pack_words`, on the bytes' device."""
    nbytes = group * width // 8
    words = math.ceil(count / group)
    padded = torch.zeros(words * nbytes, dtype=torch.uint8, device=packed.device)
    padded[: packed.numel()] = packed
    shifts = torch.arange(0, 8 * nbytes, 8, device=packed.device)
    word = (padded.view(words, nbytes).to(torch.int64) << shifts).sum(dim=1, keepdim=True)
    offsets = torch.arange(0, group * width, width, device=packed.device)
    return ((word >> offsets) & ((1 << width) - 1)).view(-1)[:count]
