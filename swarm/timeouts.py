"""``wait_for`` that never loses a cancellation.

Before Python 3.12, :func:`asyncio.wait_for` returns the awaited result instead of raising when
its task is cancelled in the same loop step as what it awaits finishes (CPython gh-86296). A
loop that waits on an event with a timeout then runs on after its task was cancelled: a part
owner's intake, woken by one sender's failure as another's reader was cancelled, read that
sender's stream on into a worker pool that was shutting down. 3.12 rebuilt ``wait_for`` on
``asyncio.timeout``; on older versions this one waits with :func:`asyncio.wait`, whose own
cancellation always propagates.

The all-reduce's waits use it. At every call site of the library, a 16-peer test lost rounds
more often (cause not found), so matchmaking, the DHT and the transport keep asyncio's.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

_FIXED_UPSTREAM = sys.version_info >= (3, 12)

if sys.version_info >= (3, 11):
    _Timeout = TimeoutError  # asyncio.TimeoutError is the built-in one
else:

    class _Timeout(asyncio.TimeoutError, TimeoutError):
        """Caught as either: on 3.10 asyncio's timeout is not the built-in one."""


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """Await ``aw`` for at most ``timeout`` seconds (None: no limit), as
    :func:`asyncio.wait_for`: on timeout ``aw`` is cancelled, and has stopped, before
    :class:`asyncio.TimeoutError` is raised; a cancellation of the caller always propagates
    (``aw`` cancelled and stopped first), even when ``aw`` finished in the same step."""
    if _FIXED_UPSTREAM:
        return await asyncio.wait_for(aw, timeout)
    if timeout is None:
        return await aw
    inner = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait((inner,), timeout=timeout)
    except asyncio.CancelledError:
        await _cancel_and_wait(inner)
        if not inner.cancelled():
            inner.exception()  # retrieved: whatever it raised goes with the cancellation
        raise
    if done:
        return inner.result()
    await _cancel_and_wait(inner)
    try:
        return inner.result()  # it finished as it was cancelled
    except asyncio.CancelledError as e:
        raise _Timeout() from e


async def _cancel_and_wait(inner: asyncio.Future[T]) -> None:
    """Cancel ``inner`` and wait until it has stopped; a second cancellation of the caller
    meanwhile propagates (``inner`` is cancelled already)."""
    if inner.done():
        return
    inner.cancel()
    await asyncio.wait((inner,))
