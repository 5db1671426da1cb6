"""The payload format shared by every codec: a fixed header, then the codec's sections.

Layout (little-endian)::

    offset  size  field
    0       3     magic  b"SWZ"
    3       1     format version (FORMAT_VERSION)
    4       1     codec id (see CODEC_IDS)
    5       1     original dtype code (see DTYPE_CODES)
    6       1     ndim                  (<= MAX_NDIM)
    7       1     number of sections    (<= MAX_SECTIONS)
    8       2     flags                 codec-specific sub-format (e.g. top-K index encoding)
    10      2     reserved, must be 0
    12      4     block size            codec-specific (0 when unused)
    16      8     param                 codec-specific (top-K: k)
    24      8*nd  shape, one u64 per dimension
    ..      8*ns  section lengths in bytes, one u64 per section
    ..            the sections, back to back; nothing may follow the last one

The header is a multiple of 8 bytes and codecs put their widest elements first (fp32 scales,
then 16-bit values, then bytes), so every section is naturally aligned when the payload is.

Everything here is pure parsing: :meth:`Header.parse` checks every field against the bytes
actually present and against ``max_numel`` before anything is allocated, and turns each section
into a zero-copy uint8 view of the payload.
"""

from __future__ import annotations

import math
import struct
import warnings
from dataclasses import dataclass

import torch

from swarm.errors import CompressionError

# Views of immutable ``bytes`` are only ever read. Torch warns once per process that it cannot
# enforce that; spend the one warning here, silenced, instead of in a caller's decode.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(b"\0", dtype=torch.uint8)

MAGIC = b"SWZ"
FORMAT_VERSION = 2  # 2: `sparse` sends its positions as maps and low bits
MAX_NDIM = 32
MAX_SECTIONS = 4
# Default cap on the element count a payload may claim. Top-K payloads legitimately expand to far
# more memory than their size, so callers that know the expected size should pass max_numel.
DEFAULT_MAX_NUMEL = 1 << 30

CODEC_IDS: dict[str, int] = {
    "none": 0,
    "fp16": 1,
    "bf16": 2,
    "int8": 3,
    "topk": 4,
    "1bit": 5,
    "sparse": 6,
}
CODEC_BY_ID: dict[int, str] = {v: k for k, v in CODEC_IDS.items()}

DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
DTYPE_BY_CODE: dict[int, torch.dtype] = {v: k for k, v in DTYPE_CODES.items()}

_FIXED = struct.Struct("<3sBBBBBHHIQ")
FIXED_SIZE = _FIXED.size  # 24


def header_size(ndim: int, nsections: int) -> int:
    """Bytes taken by a header with ``ndim`` dimensions and ``nsections`` sections."""
    return FIXED_SIZE + 8 * (ndim + nsections)


@dataclass(frozen=True)
class Header:
    """The self-describing front of a payload."""

    codec: str  # codec name, a key of CODEC_IDS
    dtype: torch.dtype  # dtype of the encoded tensor, restored by decode
    shape: tuple[int, ...]  # shape of the encoded tensor, restored by decode
    block_size: int  # codec-specific block size (0 when unused)
    param: int  # codec-specific parameter (top-K: number of kept values)
    flags: int  # codec-specific sub-format bits
    section_lengths: tuple[int, ...]  # byte length of each section, in payload order
    version: int = FORMAT_VERSION  # payload format version

    @property
    def numel(self) -> int:
        """Number of elements of the encoded tensor."""
        return math.prod(self.shape)

    @property
    def size(self) -> int:
        """Header length in bytes."""
        return header_size(len(self.shape), len(self.section_lengths))

    def serialize(self) -> bytes:
        """Header bytes (the sections follow them)."""
        return _FIXED.pack(
            MAGIC,
            self.version,
            CODEC_IDS[self.codec],
            DTYPE_CODES[self.dtype],
            len(self.shape),
            len(self.section_lengths),
            self.flags,
            0,
            self.block_size,
            self.param,
        ) + struct.pack(
            f"<{len(self.shape) + len(self.section_lengths)}Q", *self.shape, *self.section_lengths
        )

    @classmethod
    def parse(
        cls, data: bytes | bytearray | memoryview, max_numel: int | None = None
    ) -> tuple[Header, list[torch.Tensor]]:
        """Validate a payload's header and split its sections without copying.

        Args:
            data: the whole payload.
            max_numel: largest element count accepted (``DEFAULT_MAX_NUMEL`` when None).

        Returns:
            The header and one uint8 CPU tensor per section, each a view of ``data``.

        Raises:
            CompressionError: on any malformed or out-of-bounds field, or trailing bytes.
        """
        limit = DEFAULT_MAX_NUMEL if max_numel is None else max_numel
        try:
            view = memoryview(data).cast("B")
        except TypeError as exc:
            raise CompressionError(
                f"payload must be bytes-like, not {type(data).__name__}"
            ) from exc
        total = view.nbytes
        if total < FIXED_SIZE:
            raise CompressionError(f"payload of {total} bytes is shorter than a header")
        magic, version, codec_id, dtype_code, ndim, nsec, flags, reserved, block, param = (
            _FIXED.unpack_from(view, 0)
        )
        if magic != MAGIC:
            raise CompressionError(f"bad magic {bytes(magic)!r}: not a swarm compression payload")
        if version != FORMAT_VERSION:
            raise CompressionError(
                f"payload format version {version} is not supported (expected {FORMAT_VERSION})"
            )
        if codec_id not in CODEC_BY_ID:
            raise CompressionError(f"unknown codec id {codec_id}")
        if dtype_code not in DTYPE_BY_CODE:
            raise CompressionError(f"unknown dtype code {dtype_code}")
        if ndim > MAX_NDIM:
            raise CompressionError(f"ndim {ndim} exceeds the maximum of {MAX_NDIM}")
        if nsec > MAX_SECTIONS:
            raise CompressionError(f"{nsec} sections exceed the maximum of {MAX_SECTIONS}")
        if reserved != 0:
            raise CompressionError("reserved header field is not zero")
        hsize = header_size(ndim, nsec)
        if total < hsize:
            raise CompressionError(
                f"payload of {total} bytes is shorter than its {hsize}-byte header"
            )
        fields = struct.unpack_from(f"<{ndim + nsec}Q", view, FIXED_SIZE)
        shape, lengths = tuple(fields[:ndim]), tuple(fields[ndim:])
        if any(dim >= 1 << 63 for dim in shape):
            raise CompressionError(f"shape {shape} has a dimension beyond int64")
        numel = math.prod(shape)  # Python ints: exact, and at most 32 factors below 2**64
        if numel > limit:
            raise CompressionError(f"shape {shape} claims {numel} elements, over max_numel={limit}")
        body = total - hsize
        if sum(lengths) != body:
            raise CompressionError(
                f"section lengths {lengths} sum to {sum(lengths)} "
                f"but {body} bytes follow the header"
            )
        header = cls(
            CODEC_BY_ID[codec_id],
            DTYPE_BY_CODE[dtype_code],
            shape,
            block,
            param,
            flags,
            lengths,
            version,
        )
        sections = []
        offset = hsize
        for length in lengths:
            if length == 0:
                sections.append(torch.empty(0, dtype=torch.uint8))
            else:
                sections.append(
                    torch.frombuffer(view, dtype=torch.uint8, count=length, offset=offset)
                )
            offset += length
        return header, sections


def expect_lengths(header: Header, expected: tuple[int, ...]) -> None:
    """Raise CompressionError unless the header's section lengths are exactly ``expected``."""
    if header.section_lengths != expected:
        raise CompressionError(
            f"{header.codec} payload for shape {header.shape} must have sections of "
            f"{expected} bytes, found {header.section_lengths}"
        )
