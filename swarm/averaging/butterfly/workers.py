"""The worker threads of one all-reduce: tensor work off the event loop, tracked until it ends.

A cancelled task does not stop the thread work it started, and that work still touches the
round's buffers, so every submission is tracked and :meth:`Workers.drain` waits for all of it
before the buffers are read or reused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Workers:
    """Runs functions in a shared thread pool and remembers what is still running."""

    def __init__(self, pool: concurrent.futures.ThreadPoolExecutor):
        self.pool = pool
        self._inflight: set[concurrent.futures.Future[Any]] = set()

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Start ``fn(*args)`` in the pool; tracked until it finishes."""
        cf = self.pool.submit(fn, *args)
        self._inflight.add(cf)
        cf.add_done_callback(self._inflight.discard)
        return cf

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the pool, awaited."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    async def drain(self) -> None:
        """Wait for every submitted function, including those of cancelled callers."""
        while self._inflight:
            pending = [asyncio.wrap_future(cf) for cf in list(self._inflight)]
            await asyncio.gather(*pending, return_exceptions=True)
