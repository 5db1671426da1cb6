"""The codec interface and the machinery every codec shares: input checks, scratch buffers, packing.

A codec is pure tensor math split in two halves, both working on the tensor's own device:

- ``_encode(x)`` turns a flat contiguous tensor into a :class:`~swarm.compression.header.Header`
  and a list of section tensors;
- ``_decode(header, sections, out, accumulate, weight)`` writes the reconstruction into ``out``
  (or adds ``weight`` times it).

:class:`Codec` wraps them into ``encode(tensor) -> bytes`` / ``decode(bytes) -> tensor``; error
feedback calls the halves directly so that it never round-trips through bytes.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod

import torch

from swarm.compression.header import DTYPE_CODES, Header, header_size
from swarm.errors import CompressionError

Sections = list[torch.Tensor]


# Scratch buffers, per thread and shared by every instance of a codec: decoding builds a codec
# instance from each payload's header, and a fresh tensor-sized buffer per call would cost page
# faults at about the speed of the codec itself (~1.4 GB/s measured on the reference CPU).
_SCRATCH = threading.local()


class Codec(ABC):
    """Base class of the codecs. Instances are immutable settings; scratch is per thread.

    A codec instance may be shared by several threads: scratch buffers are thread-local, so each
    worker thread reuses its own, and instances of one codec share them within a thread (a
    section returned by ``_encode`` may be a scratch buffer: pack it before the next call).
    """

    #: codec name, written in the payload header
    name: str = ""
    #: number of sections of every payload of this codec
    nsections: int = 1
    #: keeps only what stands out (a few values, or signs): fine for changes such as
    #: pseudo-gradients, whose dropped rest error feedback sends later, but it would ruin raw
    #: values (parameters, anchors), which must average exactly or nearly so
    sparse: bool = False
    #: what error feedback keeps of its residual each round (1.0: all of it)
    feedback_decay: float = 1.0

    def __init__(self) -> None:
        self._local = threading.local()  # per-thread state other than buffers (e.g. generators)

    @property
    def spec(self) -> str:
        """The string form accepted by :func:`swarm.compression.get_codec`."""
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    # ------------------------------------------------------------------ public API

    def encode(self, tensor: torch.Tensor) -> bytes:
        """Compress a tensor into a self-describing payload.

        Args:
            tensor: float32, float16 or bfloat16 tensor of any shape, on any device. The work
                happens on that device; only the final bytes are copied to the CPU.

        Returns:
            The payload (header + sections).

        Raises:
            CompressionError: the dtype is not supported, or the tensor holds inf/NaN (their
                count is in the message): a diverged peer must not poison the others.
        """
        flat = self._prepare(tensor)
        header, sections = self._encode(flat, tuple(tensor.shape))
        return pack(header, sections)

    def decode(
        self,
        data: bytes | bytearray | memoryview,
        device: str | torch.device = "cpu",
        max_numel: int | None = None,
    ) -> torch.Tensor:
        """Decode a payload made by this codec (any of its settings: the header carries them).

        Args:
            data: bytes produced by :meth:`encode`.
            device: where the result (and the decoding work) goes.
            max_numel: largest element count accepted (default 2**30); pass the size you
                expect so that a hostile payload cannot make you allocate more.

        Returns:
            A new tensor with the original dtype and shape.

        Raises:
            CompressionError: the payload is malformed or hostile, claims more than
                ``max_numel`` elements, or carries another codec's id.
        """
        header, sections = Header.parse(data, max_numel)
        if header.codec != self.name:
            raise CompressionError(
                f"payload was made by codec {header.codec!r}, expected {self.name!r}"
            )
        device = torch.device(device)
        codec, sections = type(self).open(header, sections, device)
        return codec.decode_new(header, sections, device)

    def estimate_size(self, numel: int, ndim: int = 1) -> int:
        """Upper bound of the payload size in bytes for a tensor of ``numel`` elements."""
        return header_size(ndim, self.nsections) + self._body_bound(numel)

    # ------------------------------------------------------------------ for subclasses

    @abstractmethod
    def _encode(self, flat: torch.Tensor, shape: tuple[int, ...]) -> tuple[Header, Sections]:
        """Encode a flat contiguous finite-checked tensor; sections live on its device."""

    @abstractmethod
    def _decode(
        self, header: Header, sections: Sections, out: torch.Tensor, accumulate: bool, weight: float
    ) -> None:
        """Write D(payload) into the flat ``out`` (``out += weight * D`` when ``accumulate``).

        The header has passed :meth:`_validate`; sections are uint8 tensors on ``out``'s device.
        """

    @abstractmethod
    def _validate(self, header: Header) -> None:
        """Raise CompressionError unless the header's fields and section lengths are consistent."""

    @abstractmethod
    def _body_bound(self, numel: int) -> int:
        """Upper bound of the section bytes for ``numel`` elements."""

    @classmethod
    @abstractmethod
    def from_header(cls, header: Header) -> Codec:
        """A codec instance able to decode payloads like this one."""

    @classmethod
    def open(
        cls, header: Header, sections: Sections, device: torch.device
    ) -> tuple[Codec, Sections]:
        """The codec of a parsed payload of this class, its header checked, sections on ``device``.

        Raises:
            CompressionError: the header's settings, section count or lengths are inconsistent.
        """
        codec = cls.from_header(header)
        if len(header.section_lengths) != codec.nsections:
            raise CompressionError(
                f"{header.codec} payload has {len(header.section_lengths)} sections, "
                f"expected {codec.nsections}"
            )
        codec._validate(header)
        if device.type != "cpu":
            sections = [s.to(device) for s in sections]
        return codec, sections

    def decode_new(self, header: Header, sections: Sections, device: torch.device) -> torch.Tensor:
        """D(payload) as a new tensor of the payload's dtype and shape (after :meth:`open`)."""
        out = torch.empty(header.numel, dtype=header.dtype, device=device)
        self._decode(header, sections, out, False, 1.0)
        return out.view(header.shape)

    def _prepare(self, tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise CompressionError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in DTYPE_CODES:
            raise CompressionError(
                f"dtype {tensor.dtype} is not supported (float32, float16, bfloat16)"
            )
        return tensor.detach().contiguous().view(-1)

    def _as_float32(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` itself when fp32, else an fp32 copy in this thread's scratch."""
        if flat.dtype == torch.float32:
            return flat
        x = self._scratch("x32", flat.numel(), torch.float32, flat.device)
        x.copy_(flat)
        return x

    def _scratch(
        self, key: str, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A reusable buffer of at least ``numel`` elements, private to this thread."""
        store = getattr(_SCRATCH, "buffers", None)
        if store is None:
            store = _SCRATCH.buffers = {}
        full = (self.name, key, dtype, device)
        buf = store.get(full)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            store[full] = buf
        return buf[:numel]


def check_finite(flat: torch.Tensor, *stats: torch.Tensor) -> None:
    """Raise CompressionError if any of ``stats`` (reductions of ``flat``) is not finite.

    Reductions propagate inf/NaN, so checking them is nearly free; only when one is non-finite
    is the exact count computed for the message. A reduction can also overflow to inf from finite
    fp16/bf16 inputs, so the count is taken before raising.
    """
    for stat in stats:
        if stat.numel() and not bool(torch.isfinite(stat).all()):
            count = int((~torch.isfinite(flat)).sum())
            if count:
                raise CompressionError(
                    f"tensor holds {count} non-finite value(s) (inf/NaN) out of {flat.numel()}; "
                    "refusing to encode a diverged tensor"
                )


def finite_total(values: torch.Tensor) -> torch.Tensor:
    """The float32 sum of ``values``: a reduction for :func:`check_finite` where no other is at
    hand. It propagates inf/NaN like any, in one read of the values (aminmax took 6x as long on a
    chunk of 256K values in cache), and its overflow from finite values is recounted there."""
    return values.sum(dtype=torch.float32)


def as_bytes(t: torch.Tensor) -> memoryview:
    """A CPU byte view of a contiguous tensor (copied from the device if needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().view(-1)
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


def pack(header: Header, sections: Sections) -> bytes:
    """Header bytes followed by the sections, in one allocation and one copy per section."""
    return b"".join([header.serialize(), *(as_bytes(s) for s in sections)])


def section_as(section: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret a uint8 section as ``dtype`` (its length was validated beforehand)."""
    if section.numel() == 0:
        return torch.empty(0, dtype=dtype, device=section.device)
    return section.view(dtype)
