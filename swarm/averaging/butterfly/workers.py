"""The worker threads of one all-reduce: tensor work off the event loop, tracked until it ends.

A cancelled task does not stop the thread work it started, and that work still touches the
round's buffers, so every submission is tracked and :meth:`Workers.drain` waits for all of it
before the buffers are read or reused.

Work on chunks of a few thousand values costs less than the hop to a thread and back, and under
load each hop waits for the interpreter lock: a round whose chunks are that small, on the CPU,
runs its work at once on the event loop's thread instead (8 peers of a 2762-parameter model in
one process trained 20-25% slower with CenteredClip than with the plain mean through the
threads, 0-5% run at once). On a GPU the work would wait for the device's queue: always a
thread there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")

# chunks up to this many values are worked on at once (tens of microseconds a call); chunks are
# never cut below MIN_CHUNK_BYTES (32K float32 values), so only a round of parts this small, a
# small vector, ever runs inline: a large one on a slow link still goes to the threads
INLINE_CHUNK_VALUES = 8192


class Workers:
    """Runs functions in a shared thread pool and remembers what is still running; with
    ``inline``, runs them at once on the caller's thread (a future already done)."""

    def __init__(self, pool: concurrent.futures.ThreadPoolExecutor, inline: bool = False):
        self.pool = pool
        self.inline = inline
        self._inflight: set[concurrent.futures.Future[Any]] = set()

    @classmethod
    def for_chunks(
        cls, pool: concurrent.futures.ThreadPoolExecutor, largest: int, device: torch.device
    ) -> Workers:
        """Workers for a round whose largest chunk holds ``largest`` values on ``device``."""
        return cls(pool, inline=device.type == "cpu" and largest <= INLINE_CHUNK_VALUES)

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Start ``fn(*args)`` in the pool; tracked until it finishes."""
        if self.inline:
            done: concurrent.futures.Future[T] = concurrent.futures.Future()
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # as the pool's threads hand on what a function raised
                done.set_exception(e)
            return done
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
