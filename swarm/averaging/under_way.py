"""An averager's round as a task that the averager's ``close`` calls off."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from swarm.averaging.result import RoundResult


class RoundUnderWay:
    """An averager's round as a task :meth:`Averager.close` calls off: its caller gets a failed
    result (tensors untouched, or averaged if the call came as they were written)."""

    def __init__(self) -> None:
        self._task: asyncio.Future[RoundResult] | None = None
        self._called_off = False

    async def run(self, round_: Coroutine[Any, Any, RoundResult]) -> RoundResult:
        if self._called_off:  # a round that waited for the lock while close called one off
            round_.close()
            return RoundResult(False, "the averager closed")
        task = self._task = asyncio.ensure_future(round_)
        try:
            return await task
        except asyncio.CancelledError:
            caller_cancelled = getattr(asyncio.current_task(), "cancelling", lambda: 0)() > 0
            if self._called_off and task.cancelled() and not caller_cancelled:
                return RoundResult(False, "the averager closed")
            raise
        finally:
            self._task = None

    async def call_off(self) -> None:
        """Cancel the round under way (and any later one) and wait for its cleanup."""
        self._called_off = True
        if (task := self._task) is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])
