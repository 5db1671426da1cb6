"""Codec lookup by name or spec string, and decoding of any payload by its header."""

from __future__ import annotations

import torch

from swarm.compression.base import Codec
from swarm.compression.floats import BF16, FP16, NONE
from swarm.compression.header import CODEC_IDS, Header
from swarm.compression.int8 import Int8Codec
from swarm.compression.onebit import OneBitCodec
from swarm.compression.sparse import SparseCodec
from swarm.compression.topk import TopKCodec
from swarm.errors import CompressionError, ConfigError

CODEC_NAMES: tuple[str, ...] = tuple(CODEC_IDS)
_CLASSES: dict[str, type[Codec]] = {
    "none": type(NONE),
    "fp16": type(FP16),
    "bf16": type(BF16),
    "int8": Int8Codec,
    "topk": TopKCodec,
    "1bit": OneBitCodec,
    "sparse": SparseCodec,
}


def _number(text: str, spec: str) -> int | float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"codec spec {spec!r}: {text!r} is not a number") from None
    if value >= 1 and value == int(value) and "." not in text and "e" not in text.lower():
        return int(value)
    return value


def get_codec(spec: str, **options: object) -> Codec:
    """Build a codec from a name or a spec string.

    Spec strings (used by the CLI and :class:`~swarm.config.SwarmConfig`): ``none``, ``fp16``,
    ``bf16``, ``int8``, ``int8:BLOCK``, ``int8:BLOCK:bnb``, ``topk:FRACTION`` (a float such as
    ``0.01``), ``topk:COUNT`` (an integer), ``topk:0.01:int8`` (value format), ``1bit``,
    ``1bit:BLOCK``, ``sparse`` (``sparse:4096:96:2``), ``sparse:CHUNK:K:BITS`` and
    ``sparse:CHUNK:K:BITS:DECAY`` (error feedback's decay, default 0.95).

    Args:
        spec: codec name or spec string.
        **options: constructor keywords (``block_size``, ``method``, ``fraction``, ``count``,
            ``values``); they override what the spec string says.

    Raises:
        ConfigError: unknown codec or invalid option.
    """
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"codec spec must be a non-empty string, got {spec!r}")
    name, *args = spec.strip().lower().split(":")
    if name not in CODEC_NAMES:
        raise ConfigError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_NAMES)}")
    kwargs: dict[str, object] = {}
    if name in ("none", "fp16", "bf16"):
        if args or options:
            raise ConfigError(f"codec {name!r} takes no options")
        return {"none": NONE, "fp16": FP16, "bf16": BF16}[name]
    if name in ("int8", "1bit"):
        if len(args) > (2 if name == "int8" else 1):
            raise ConfigError(f"codec spec {spec!r} has too many fields")
        if args:
            kwargs["block_size"] = _number(args[0], spec)
        if len(args) == 2:
            kwargs["method"] = args[1]
    elif name == "sparse":
        if len(args) > 4:
            raise ConfigError(f"codec spec {spec!r} has too many fields")
        for field, text in zip(("chunk", "k", "bits", "decay"), args, strict=False):
            kwargs[field] = _number(text, spec)
        if "decay" in kwargs:
            kwargs["decay"] = float(kwargs["decay"])  # type: ignore[arg-type]
    else:  # topk
        if len(args) > 2:
            raise ConfigError(f"codec spec {spec!r} has too many fields")
        if args:
            value = _number(args[0], spec)
            kwargs["count" if isinstance(value, int) else "fraction"] = value
        if len(args) == 2:
            kwargs["values"] = args[1]
        if "fraction" in options or "count" in options:
            kwargs.pop("fraction", None)
            kwargs.pop("count", None)
    kwargs.update(options)
    try:
        return _CLASSES[name](**kwargs)
    except TypeError as exc:
        raise ConfigError(f"codec {name!r}: {exc}") from None


def _parse(
    payload: bytes | bytearray | memoryview,
    max_numel: int | None,
    device: torch.device,
    expect: str | None = None,
) -> tuple[Header, Codec, list[torch.Tensor]]:
    header, sections = Header.parse(payload, max_numel)
    if expect is not None and header.codec != expect:
        raise CompressionError(f"payload was made by codec {header.codec!r}, expected {expect!r}")
    codec, sections = _CLASSES[header.codec].open(header, sections, device)
    return header, codec, sections


def decode(
    payload: bytes | bytearray | memoryview,
    device: str | torch.device = "cpu",
    max_numel: int | None = None,
    *,
    expect: str | None = None,
) -> torch.Tensor:
    """Decode any payload; the codec, dtype and shape come from its header.

    Args:
        payload: bytes produced by :meth:`Codec.encode`.
        device: where the result (and the decoding work) goes.
        max_numel: largest element count accepted; pass the size you expect so that a hostile
            payload cannot make you allocate more (default 2**30).
        expect: codec name the payload must carry (None: any codec).

    Returns:
        A new tensor with the original dtype and shape.

    Raises:
        CompressionError: the payload is malformed, hostile, larger than ``max_numel``, or
            made by another codec than ``expect``.
    """
    device = torch.device(device)
    header, codec, sections = _parse(payload, max_numel, device, expect)
    return codec.decode_new(header, sections, device)


def decode_into(
    payload: bytes | bytearray | memoryview,
    out: torch.Tensor,
    weight: float = 1.0,
    *,
    accumulate: bool = True,
) -> torch.Tensor:
    """Accumulate a payload into ``out``: ``out += weight * decode(payload)``, without a temporary.

    Meant for reducing many peers' chunks into one buffer. Only the element count must match
    (the payload's shape is not enforced), so a flat buffer can take any chunk of its size.

    Args:
        payload: bytes produced by :meth:`Codec.encode`.
        out: contiguous float tensor on the device where the work happens.
        weight: factor applied to the decoded values (e.g. a peer's share of the samples).
        accumulate: False overwrites instead, ``out = weight * decode(payload)`` (no pass to
            zero ``out`` first).

    Returns:
        ``out``.

    Raises:
        CompressionError: malformed payload, or its element count differs from ``out``'s.
    """
    if not out.is_floating_point():
        raise CompressionError(f"decode_into needs a float output tensor, got {out.dtype}")
    if not out.is_contiguous():
        raise CompressionError("decode_into needs a contiguous output tensor")
    header, codec, sections = _parse(payload, out.numel(), out.device)
    if header.numel != out.numel():
        raise CompressionError(
            f"payload holds {header.numel} elements, output buffer has {out.numel()}"
        )
    codec._decode(header, sections, out.view(-1), accumulate, float(weight))
    if not accumulate and weight != 1.0:
        out.mul_(weight)
    return out


def read_header(payload: bytes | bytearray | memoryview, max_numel: int | None = None) -> Header:
    """Parse and validate a payload's header only (cheap; no tensor is produced)."""
    header, _, _ = _parse(payload, max_numel, torch.device("cpu"))
    return header


__all__ = ["CODEC_NAMES", "CompressionError", "decode", "decode_into", "get_codec", "read_header"]
