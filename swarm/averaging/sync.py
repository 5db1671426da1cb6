"""Blocking twin of :class:`~swarm.averaging.Averager` for code that has no event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from swarm.averaging.averager import Averager
from swarm.averaging.result import RoundResult


class SyncAverager:
    """Runs :meth:`Averager.average` on the loop that owns the peer (in another thread).

    Args:
        averager: an averager created on ``loop``.
        loop: the running event loop of the peer (e.g. the one of ``swarm.api.Swarm``'s thread).
    """

    def __init__(self, averager: Averager, loop: asyncio.AbstractEventLoop):
        self.averager = averager
        self.loop = loop

    def average(
        self,
        tensors: Sequence[torch.Tensor],
        weight: float = 1.0,
        *,
        group_key: str | None = None,
        round_: int | None = None,
        timeout: float | None = None,
    ) -> RoundResult:
        """Like :meth:`Averager.average`; blocks the calling thread (never the loop's).

        Raises:
            TimeoutError: ``timeout`` seconds passed (the round goes on in the background).
        """
        future = asyncio.run_coroutine_threadsafe(
            self.averager.average(tensors, weight, group_key=group_key, round_=round_), self.loop
        )
        return future.result(timeout)
