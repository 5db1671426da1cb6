"""msgpack helpers for bytes that come from the network: bounded, no extension types.

Malformed network bytes raise :class:`~swarm.errors.TransportError` everywhere in :mod:`swarm.net`
(failed *authentication* raises :class:`~swarm.errors.AuthError` instead).
"""

from __future__ import annotations

from typing import Any

import msgpack

from swarm.errors import TransportError


def _no_ext(code: int, data: bytes) -> Any:
    raise TransportError(f"msgpack extension type {code} is not accepted")


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
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, ext_hook=_no_ext, use_list=True
        )
    except TransportError:
        raise
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as e:
        raise TransportError(f"{what}: malformed msgpack ({type(e).__name__}: {e})") from e
