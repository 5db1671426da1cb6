"""swarm.timeouts.wait_for: asyncio.wait_for's contract, without losing a cancellation."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from swarm import timeouts


async def _wait_then_run_on(event: asyncio.Event, ran_on: list[bool]) -> None:
    while True:  # an owner's watchdog loop: wait for a change, at most a tick
        with contextlib.suppress(asyncio.TimeoutError):
            await timeouts.wait_for(event.wait(), 10.0)
        ran_on.append(True)
        event.clear()


async def test_a_cancellation_in_the_step_the_wait_ends_is_not_lost() -> None:
    """The event is set and the waiting task cancelled in one step: asyncio.wait_for before
    Python 3.12 returned, and the loop ran on for good."""
    event, ran_on = asyncio.Event(), []
    task = asyncio.create_task(_wait_then_run_on(event, ran_on))
    await asyncio.sleep(0.01)
    event.set()
    task.cancel()
    done, _ = await asyncio.wait((task,), timeout=1.0)
    assert done and task.cancelled()
    assert ran_on == []


async def test_a_timeout_cancels_and_stops_what_it_waited_on() -> None:
    stopped = asyncio.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            stopped.set()

    with pytest.raises(asyncio.TimeoutError):
        await timeouts.wait_for(slow(), 0.01)
    assert stopped.is_set()  # stopped before the timeout was raised


async def test_results_and_errors_pass_through() -> None:
    async def value() -> int:
        await asyncio.sleep(0)
        return 7

    async def broken() -> None:
        raise ValueError("its own error")

    assert await timeouts.wait_for(value(), 1.0) == 7
    assert await timeouts.wait_for(value(), None) == 7
    with pytest.raises(ValueError, match="its own error"):
        await timeouts.wait_for(broken(), 1.0)


async def test_a_cancelled_caller_cancels_what_it_waited_on() -> None:
    inner_cancelled = asyncio.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            inner_cancelled.set()
            raise

    task = asyncio.create_task(timeouts.wait_for(slow(), 10.0))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert inner_cancelled.is_set()
