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
        self._wakes: list[tuple[float, float]] = []  # (due at, woke at) of each late wake-up
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
            due = time.perf_counter() + self.tick_s
            await asyncio.sleep(self.tick_s)
            woke = time.perf_counter()
            if woke > due:
                self._wakes.append((due, woke))

    def worst(self, start: float, end: float) -> float:
        """The longest hold-up (a wake-up's delay past its due time) that overlapped
        ``[start, end]`` (0.0: none seen)."""
        return max(
            (woke - due for due, woke in self._wakes if due <= end and woke >= start),
            default=0.0,
        )
