"""How long this peer's event loop was held up while RTT probes ran.

An RTT measured on a busy event loop includes the time the loop spent elsewhere (a training
step holding the GIL, a round's tensor work, many peers in one process): the answer waits in
the socket until the loop reads it. A peer whose loop lags would see its neighbours far away
and plan itself out of their region. :class:`LagWatch` wakes every ``tick_s`` while the probes
run and notes how late each wake-up came, so the prober can tell a measured path from a
measured hold-up (see :meth:`swarm.averaging.groups.prober.Prober.probe_once`).
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType

TICK_S = 0.005  # wake-up period while probes run (Windows' timer granularity makes it ~16 ms)


class LagWatch:
    """An async context manager: between enter and exit, notes each late wake-up of the loop.

    Times are ``time.perf_counter()`` seconds, as :meth:`swarm.net.transport.Transport.ping`
    measures.
    """

    def __init__(self, tick_s: float = TICK_S):
        self.tick_s = tick_s
        self._late: list[tuple[float, float]] = []  # (woke at, seconds later than asked)
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LagWatch:
        self._task = asyncio.get_running_loop().create_task(self._tick(), name="swarm-lag")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _tick(self) -> None:
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(self.tick_s)
            woke = time.perf_counter()
            self._late.append((woke, max(0.0, woke - asked - self.tick_s)))

    def worst(self, start: float, end: float) -> float:
        """The longest hold-up that overlapped ``[start, end]`` (0.0: none seen)."""
        return max(
            (
                late
                for woke, late in self._late
                if woke >= start and woke - late - self.tick_s <= end
            ),
            default=0.0,
        )
