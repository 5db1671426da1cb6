"""``topk``: keep the k largest magnitudes, send their values and their positions.

Selection is exact: the result is always exactly k indices and every kept |x| is >= every dropped
|x| (ties broken arbitrarily). It is fast on large tensors because ``torch.topk`` over 25M floats
costs ~640 ms on the 2-core reference CPU: instead a random sample of |x| gives a threshold
slightly below the k-th largest magnitude, one vectorized comparison keeps the ~1.4k candidates
above it, and ``torch.topk`` runs over those candidates only. If the sample misjudges (fewer
than k candidates, or a flood of ties) the codec falls back to ``torch.topk`` over everything.

Values go as fp16 (default; saturating at +-65504), bf16, or int8 with one absmax scale per
``block_size`` values. Indices use the smallest of three encodings, see
:mod:`swarm.compression.indices`. Sections: int8 scales (empty unless int8), values, indices.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from swarm.compression.base import Codec, Sections, check_finite, section_as
from swarm.compression.blocks import absmax_dequantize, absmax_quantize, check_scales
from swarm.compression.header import Header
from swarm.compression.indices import (
    FIXED,
    WIDTHS,
    decode_indices,
    encode_indices,
    encoded_size_bound,
    index_bytes_valid,
)
from swarm.errors import CompressionError, ConfigError

VALUE_FORMATS = ("fp16", "bf16", "int8")
_VALUE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
SAMPLE_SIZE = 1 << 16
EXACT_BELOW = 1 << 16  # below this many elements, torch.topk on everything is cheap enough

logger = logging.getLogger(__name__)


def _flags(encoding: int, width: int, value_format: str) -> int:
    width_code = WIDTHS.index(width) if width else 0
    return encoding | (width_code << 2) | (VALUE_FORMATS.index(value_format) << 4)


def _index_format(flags: int) -> tuple[int, int]:
    """(index encoding, fixed width) from payload flags; width -1 marks an invalid combination."""
    encoding, width_code = flags & 0x3, (flags >> 2) & 0x3
    if encoding == FIXED:
        return encoding, WIDTHS[width_code]
    return encoding, 0 if width_code == 0 else -1


class TopKCodec(Codec):
    """Top-K sparsification by magnitude.

    Args:
        fraction: share of elements kept, in (0, 1]; k = ceil(fraction * numel).
        count: fixed number of elements kept (capped at numel); exclusive with ``fraction``.
        values: ``"fp16"``, ``"bf16"`` or ``"int8"`` for the kept values.
        block_size: values per scale when ``values="int8"``.

    Top-K alone loses what it drops: use it through :class:`~swarm.compression.ErrorFeedback`
    so the dropped mass is sent in later rounds. 1% keeps ratio near 100 with fp16 values.
    """

    name = "topk"
    sparse = True
    nsections = 3

    def __init__(
        self,
        fraction: float | None = None,
        count: int | None = None,
        values: str = "fp16",
        block_size: int = 4096,
    ) -> None:
        super().__init__()
        if (fraction is None) == (count is None):
            if fraction is None and count is None:
                fraction = 0.01
            else:
                raise ConfigError("topk takes fraction or count, not both")
        if fraction is not None and not (isinstance(fraction, float | int) and 0 < fraction <= 1):
            raise ConfigError(f"topk fraction must be in (0, 1], got {fraction!r}")
        if count is not None and (not isinstance(count, int) or count < 1):
            raise ConfigError(f"topk count must be a positive int, got {count!r}")
        if values not in VALUE_FORMATS:
            raise ConfigError(f"topk values must be one of {VALUE_FORMATS}, got {values!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ConfigError("topk block_size must be a positive int")
        self.fraction = None if fraction is None else float(fraction)
        self.count = count
        self.values = values
        self.block_size = block_size

    @property
    def spec(self) -> str:
        base = f"topk:{self.fraction!r}" if self.fraction is not None else f"topk:{self.count}"
        return base if self.values == "fp16" else f"{base}:{self.values}"

    def k_for(self, numel: int) -> int:
        """Number of elements kept from a tensor of ``numel`` elements."""
        if numel == 0:
            return 0
        if self.count is not None:
            return min(self.count, numel)
        return min(numel, max(1, math.ceil(self.fraction * numel - 1e-9)))

    def _body_bound(self, numel: int) -> int:
        k = self.k_for(numel)
        value_bytes = k if self.values == "int8" else 2 * k
        scale_bytes = 4 * math.ceil(k / self.block_size) if self.values == "int8" else 0
        return scale_bytes + value_bytes + encoded_size_bound(k, numel)

    @classmethod
    def from_header(cls, header: Header) -> Codec:
        fmt = (header.flags >> 4) & 0x3
        if header.flags >> 6 or fmt >= len(VALUE_FORMATS):
            raise CompressionError(f"topk payload has unknown flags {header.flags:#x}")
        if VALUE_FORMATS[fmt] == "int8" and header.block_size < 1:
            raise CompressionError("topk int8 payload has block size 0")
        if VALUE_FORMATS[fmt] != "int8" and header.block_size:
            raise CompressionError("topk float payload has a non-zero block size")
        return cls(
            count=max(1, header.param),
            values=VALUE_FORMATS[fmt],
            block_size=max(1, header.block_size),
        )

    def _validate(self, header: Header) -> None:
        k, n = header.param, header.numel
        if k > n:
            raise CompressionError(f"topk payload keeps k={k} of only {n} elements")
        scales, values, index = header.section_lengths
        int8 = self.values == "int8"
        want_scales = 4 * math.ceil(k / self.block_size) if int8 else 0
        want_values = k if int8 else 2 * k
        encoding, width = _index_format(header.flags)
        if (
            scales != want_scales
            or values != want_values
            or not index_bytes_valid(encoding, width, index, k, n)
        ):
            raise CompressionError(
                f"topk payload sections {header.section_lengths} do not fit k={k} of {n} "
                f"(flags {header.flags:#x})"
            )

    def _select(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        n, dev = flat.numel(), flat.device
        if k == n:
            return torch.arange(n, device=dev)
        mag = self._scratch("mag", n, torch.float32, dev)
        if flat.dtype == torch.float32:
            torch.abs(flat, out=mag)
        else:
            mag.copy_(flat).abs_()
        if n > EXACT_BELOW and k <= n // 8:
            idx = self._select_sampled(mag, k)
            if idx is not None:
                return idx
        return torch.topk(mag, k, sorted=False).indices.sort().values

    def _select_sampled(self, mag: torch.Tensor, k: int) -> torch.Tensor | None:
        n, dev = mag.numel(), mag.device
        gens = getattr(self._local, "generators", None)
        if gens is None:
            gens = self._local.generators = {}
        gen = gens.get(dev)
        if gen is None:
            gen = gens[dev] = torch.Generator(device=dev)
            gen.manual_seed(0x5EED)
        sample = mag[torch.randint(n, (SAMPLE_SIZE,), generator=gen, device=dev)]
        expected = SAMPLE_SIZE * k / n
        # Aim ~20% + 4 sigma above k so that the candidates almost surely hold the top k.
        rank = min(SAMPLE_SIZE, math.ceil(1.2 * expected + 4 * math.sqrt(expected) + 8))
        threshold = torch.kthvalue(sample, SAMPLE_SIZE - rank + 1).values
        mask = self._scratch("mask", n, torch.bool, dev)
        torch.ge(mag, threshold, out=mask)
        if dev.type == "cpu":
            cand = torch.from_numpy(np.flatnonzero(mask.numpy()))
        else:
            cand = mask.nonzero().view(-1)
        if cand.numel() < k or cand.numel() > 4 * k + 4096:
            logger.debug(
                "top-K sampled threshold kept %d candidates for k=%d of %d; exact selection",
                cand.numel(),
                k,
                n,
            )
            return None
        best = torch.topk(mag[cand], k, sorted=False).indices
        return cand[best].sort().values

    def _encode(self, flat: torch.Tensor, shape: tuple[int, ...]) -> tuple[Header, Sections]:
        n, dev = flat.numel(), flat.device
        k = self.k_for(n)
        if n:
            low, high = torch.aminmax(flat)
            check_finite(flat, low, high)
        idx = self._select(flat, k) if k else torch.zeros(0, dtype=torch.int64, device=dev)
        kept = flat[idx].float()
        scales = torch.empty(0, dtype=torch.float32, device=dev)
        if self.values == "int8":
            values = torch.empty(k, dtype=torch.int8, device=dev)
            scales = absmax_quantize(kept, self.block_size, values, torch.empty_like(kept))
        else:
            wire = _VALUE_DTYPES[self.values]
            limit = torch.finfo(wire).max
            values = kept.clamp_(-limit, limit).to(wire)  # saturate rather than overflow to inf
        encoding, width, index = encode_indices(idx, n)
        header = Header(
            self.name,
            flat.dtype,
            shape,
            self.block_size if self.values == "int8" else 0,
            k,
            _flags(encoding, width, self.values),
            (4 * scales.numel(), values.numel() * values.element_size(), index.numel()),
        )
        return header, [scales, values, index]

    def _decode(
        self, header: Header, sections: Sections, out: torch.Tensor, accumulate: bool, weight: float
    ) -> None:
        k, n = header.param, header.numel
        encoding, width = _index_format(header.flags)
        idx = decode_indices(encoding, width, sections[2], k, n)
        if self.values == "int8":
            scales = section_as(sections[0], torch.float32)
            check_scales(scales, "topk")
            values = torch.empty(k, dtype=torch.float32, device=out.device)
            absmax_dequantize(
                sections[1].view(torch.int8), scales, self.block_size, values, False, 1.0
            )
        else:
            values = section_as(sections[1], _VALUE_DTYPES[self.values])
            if k and not bool(torch.isfinite(values).all()):
                raise CompressionError("topk payload holds non-finite values")
        values = values.to(out.dtype)
        if accumulate:
            out.index_add_(0, idx, values, alpha=weight)
        else:
            out.zero_()
            out.index_copy_(0, idx, values)
