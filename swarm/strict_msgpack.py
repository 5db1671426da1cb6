"""msgpack from other peers, decoded strictly: one value, UTF-8 text, no extension types.

The DHT datagrams, the HTTP auth header and every :mod:`swarm.net` record read untrusted bytes
through :func:`unpack`, each raising its own subsystem's error type.
"""

from __future__ import annotations

from typing import Any

import msgpack

from swarm.errors import SwarmError


class _Extension(Exception):
    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def _refuse_extension(code: int, data: bytes) -> Any:
    raise _Extension(code)


def unpack(data: bytes | bytearray | memoryview, error: type[SwarmError], what: str) -> Any:
    """Decode exactly one msgpack value (strings as UTF-8 text, arrays as lists).

    Args:
        data: the untrusted bytes; bound their length before calling.
        error: the caller's error type, raised for anything malformed.
        what: names the bytes in the error message (``"datagram"``, ``"peer record"``).

    Raises:
        error: truncated, trailing bytes, too deeply nested, invalid UTF-8, map keys other than
            text or bytes, or an extension type.
    """
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, ext_hook=_refuse_extension, use_list=True
        )
    except _Extension as e:
        raise error(f"{what}: msgpack extension type {e.code} is not accepted") from None
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as e:
        raise error(f"{what}: malformed msgpack ({type(e).__name__}: {e})") from e
