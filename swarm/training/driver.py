"""Driving a step: one loop for both facades, which differ only in how they wait for a round.

:meth:`~swarm.training.engine.TrainingEngine.step` is a generator that yields what it needs from
the network (see :mod:`swarm.training.engine`). :func:`drive` is the one loop that answers it,
through a :class:`Rounds` implementation:

- :class:`BlockingRounds` (the sync ``Swarm``): runs or waits for a round by blocking the
  caller's thread; its coroutines never suspend, so :func:`run_step` runs :func:`drive` to its
  end in the caller's thread, without an event loop (:func:`run_inline`);
- :class:`AwaitingRounds` (``AsyncSwarm``): awaits rounds on the caller's loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any, Protocol, TypeVar

from swarm.errors import TrainingError
from swarm.training.overlap import RoundHandle, RoundWait
from swarm.training.report import StepReport
from swarm.training.rounds import RoundOutcome, RoundPlan, StepFlow

T = TypeVar("T")
TIMED_OUT = "round timed out"
CANCELLED = "round cancelled"


class Rounds(Protocol):
    """How a driver runs, starts and waits for the rounds a step asks for."""

    async def run(self, plan: RoundPlan) -> RoundOutcome: ...

    async def start(self, plan: RoundPlan) -> RoundHandle: ...

    async def wait(self, request: RoundWait) -> RoundOutcome: ...


async def drive(flow: Generator[RoundPlan | RoundWait, Any, T], rounds: Rounds) -> T:
    """Answer ``flow``'s requests (a step's, or ``average_parameters()``'s) until it returns
    its report."""
    try:
        request = next(flow)
        while True:
            if isinstance(request, RoundWait):
                reply: Any = await rounds.wait(request)
            elif request.background:
                reply = await rounds.start(request)
            else:
                reply = await rounds.run(request)
            request = flow.send(reply)
    except StopIteration as done:
        return done.value


def run_inline(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends to its end, in the caller's thread.

    Raises:
        TrainingError: it suspended (something it awaited needs an event loop).
    """
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise TrainingError("a blocking step driver suspended; use the async facade on a loop")


class _Ran(concurrent.futures.Future):  # type: ignore[type-arg]
    """The handle of a background round that its driver ran in place: already done."""

    def __init__(self, outcome: RoundOutcome):
        super().__init__()
        self.set_result(outcome)


class BlockingRounds:
    """Rounds for a thread that may block: ``run_round`` blocks until the outcome;
    ``start_round`` returns a ``concurrent.futures.Future`` (without it a background round runs
    in place and lands at once, like a blocking one)."""

    def __init__(
        self,
        run_round: Callable[[RoundPlan], RoundOutcome],
        start_round: Callable[[RoundPlan], RoundHandle] | None = None,
    ):
        self.run_round, self.start_round = run_round, start_round

    async def run(self, plan: RoundPlan) -> RoundOutcome:
        return self.run_round(plan)

    async def start(self, plan: RoundPlan) -> RoundHandle:
        return self.start_round(plan) if self.start_round else _Ran(self.run_round(plan))

    async def wait(self, request: RoundWait) -> RoundOutcome:
        handle: Any = request.handle
        try:
            return handle.result(request.timeout)
        except concurrent.futures.TimeoutError:
            handle.cancel()
            return RoundOutcome.failed(TIMED_OUT)
        except concurrent.futures.CancelledError:
            return RoundOutcome.failed(CANCELLED)


class AwaitingRounds:
    """Rounds awaited on the caller's loop; ``start_round`` returns a task on it."""

    def __init__(
        self,
        run_round: Callable[[RoundPlan], Awaitable[RoundOutcome]],
        start_round: Callable[[RoundPlan], RoundHandle] | None = None,
    ):
        self.run_round, self.start_round = run_round, start_round

    async def run(self, plan: RoundPlan) -> RoundOutcome:
        return await self.run_round(plan)

    async def start(self, plan: RoundPlan) -> RoundHandle:
        if self.start_round:
            return self.start_round(plan)
        return _Ran(await self.run_round(plan))

    async def wait(self, request: RoundWait) -> RoundOutcome:
        handle: Any = request.handle
        future = handle if asyncio.isfuture(handle) else asyncio.wrap_future(handle)
        try:
            return await asyncio.wait_for(asyncio.shield(future), request.timeout)
        except asyncio.TimeoutError:
            future.cancel()
            return RoundOutcome.failed(TIMED_OUT)
        except asyncio.CancelledError:
            if not future.cancelled():
                raise  # this step itself was cancelled, not the round
            return RoundOutcome.failed(CANCELLED)


def run_step(
    flow: StepFlow,
    run_round: Callable[[RoundPlan], RoundOutcome],
    start_round: Callable[[RoundPlan], RoundHandle] | None = None,
) -> StepReport:
    """Drive a step in the caller's thread, blocking on ``run_round`` for each round."""
    return run_inline(drive(flow, BlockingRounds(run_round, start_round)))


async def arun_step(
    flow: StepFlow,
    run_round: Callable[[RoundPlan], Awaitable[RoundOutcome]],
    start_round: Callable[[RoundPlan], RoundHandle] | None = None,
) -> StepReport:
    """Drive a step on the caller's loop, awaiting ``run_round`` for each round."""
    report = await drive(flow, AwaitingRounds(run_round, start_round))
    # One turn of the loop per step, so a round in flight moves on between busy steps.
    await asyncio.sleep(0)
    return report
