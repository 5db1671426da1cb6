"""The frame pool keeps a burst's buffers for the next burst, and gives them back once idle.

Real memory maps and a real event loop; the hold is shortened for the test.
"""

from __future__ import annotations

import asyncio

from swarm.net.buffers import FramePool

MiB = 1 << 20
HOLD_S = 0.2


async def _until(check, seconds: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    for _ in range(int(seconds / 0.02)):
        if check():
            return True
        await asyncio.sleep(0.02)
    return check()


async def test_a_burst_reuses_its_buffers_then_only_the_kept_part_stays_mapped() -> None:
    pool = FramePool(max_idle_bytes=8 * MiB, kept_idle_bytes=2 * MiB, hold_s=HOLD_S)
    first = [pool.take(MiB) for _ in range(6)]  # six frames read at once
    for buffer in first:
        pool.give(buffer)
    assert pool.idle_bytes == 6 * MiB and not any(b.closed for b in first)
    second = [pool.take(MiB) for _ in range(6)]  # the next burst maps nothing new
    assert {id(b) for b in second} == {id(b) for b in first}
    for buffer in second:
        pool.give(buffer)
    # quiet: what is above the kept 2 MiB is unmapped after the hold, the newest kept
    assert await _until(lambda: pool.idle_bytes == 2 * MiB)
    assert sum(b.closed for b in first) == 4
    assert not second[-1].closed and not second[-2].closed
    await asyncio.sleep(3 * HOLD_S)
    assert pool.idle_bytes == 2 * MiB and sum(b.closed for b in first) == 4
    pool.clear()
    assert pool.idle_bytes == 0 and all(b.closed for b in first)


async def test_a_buffer_in_use_again_within_the_hold_is_not_unmapped() -> None:
    pool = FramePool(max_idle_bytes=8 * MiB, kept_idle_bytes=MiB, hold_s=HOLD_S)
    a, b = pool.take(MiB), pool.take(MiB)
    pool.give(a)
    pool.give(b)
    taken = pool.take(MiB)  # the last given back
    assert taken is b
    await asyncio.sleep(2 * HOLD_S)  # a's hold ends while b is in use: a is within the kept MiB
    assert not a.closed and pool.idle_bytes == MiB
    pool.give(taken)  # above the kept part again: the older one goes after the hold
    assert await _until(lambda: a.closed)
    assert not b.closed and pool.idle_bytes == MiB
    pool.clear()


def test_without_a_running_loop_the_next_give_sweeps() -> None:
    pool = FramePool(max_idle_bytes=8 * MiB, kept_idle_bytes=MiB, hold_s=0.0)
    a, b = pool.take(MiB), pool.take(MiB)
    pool.give(a)
    pool.give(b)  # no loop to wait on: swept at the next give
    c = pool.take(3 * MiB)
    pool.give(c)  # sweeps the oldest down to the kept MiB first
    assert a.closed and not b.closed and not c.closed
    assert pool.idle_bytes == 4 * MiB
    pool.clear()
