"""msgpack helpers for bytes that come from the network: bounded, no extension types.

Malformed network bytes raise :class:`~swarm.errors.TransportError` everywhere in :mod:`swarm.net`
(failed *authentication* raises :class:`~swarm.errors.AuthError` instead).
"""

from __future__ import annotations

from typing import Any

import msgpack

from swarm import strict_msgpack
from swarm.errors import TransportError


def pack(value: Any) -> bytes:
    """Canonical msgpack: floats as float64, str as UTF-8, bytes as bin."""
    return msgpack.packb(value, use_bin_type=True)


def unpack(data: bytes, *, max_bytes: int, what: str) -> Any:
    """Decode one msgpack value of at most ``max_bytes`` bytes.

    Raises:
        TransportError: too long, truncated, trailing bytes, too deeply nested, invalid UTF-8,
            non-string map keys or an extension type.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TransportError(f"{what}: expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise TransportError(f"{what}: {len(data)} bytes, more than the {max_bytes} allowed")
    return strict_msgpack.unpack(data, TransportError, what)
