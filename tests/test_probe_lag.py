"""RTT probes on a loop that something else holds up: the hold-up is not a distance.

Two real peers on loopback; the prober under test holds its own event loop (a blocking sleep,
as a training step holding the GIL does) while each of its pings is in flight."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from loopback_peers import start_peers

from swarm.averaging.groups.coordinates import Coordinate
from swarm.averaging.groups.loop_lag import LagWatch
from swarm.averaging.groups.prober import Prober
from swarm.net.record import PeerRecord
from swarm.peer import Peer

HOLD_S = 0.1  # five times HELD_UP_S; loopback answers in well under a millisecond


class HeldUpProber(Prober):
    """A prober whose loop is held for ``hold_s`` while each ping is in flight."""

    hold_s = 0.0

    async def _ping(self, record: PeerRecord) -> float | None:
        ping = asyncio.ensure_future(super()._ping(record))
        await asyncio.sleep(0)  # the request is on its way
        time.sleep(self.hold_s)  # the point: this loop is held up
        return await ping


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Peer, Peer]]:
    a, b = await start_peers([176, 177])
    try:
        for _ in range(100):  # until each lists the other
            if b.peer_id in await a.known_peers():
                break
            await asyncio.sleep(0.05)
        yield a, b
    finally:
        await asyncio.gather(a.close(), b.close())


async def test_a_held_up_sample_is_dropped_once_a_clean_one_was_taken(pair) -> None:
    a, b = pair
    prober = HeldUpProber(a)
    for _ in range(20):  # a loaded machine may hold up the first ones too
        await prober.probe_once()
        if prober.measured(b.peer_id):
            break
    assert prober.measured(b.peer_id)
    clean, samples = prober.coordinate, prober.samples
    prober.hold_s = HOLD_S
    assert await prober.probe_once() == 0
    assert prober.held_up == 1 and prober.samples == samples
    assert prober.coordinate == clean  # the hold-up moved nothing


async def test_a_loop_that_is_always_held_up_still_gets_coordinates(pair) -> None:
    a, b = pair
    prober = HeldUpProber(a)
    prober.hold_s = HOLD_S
    assert await prober.probe_once() == 1  # no clean sample to keep: this one is the best
    assert not prober.measured(b.peer_id) and prober.held_up == 0
    assert prober.coordinate != Coordinate.origin(prober.vivaldi.config.dims)


async def test_the_watch_sees_a_hold_up_inside_a_window_and_none_outside() -> None:
    async with LagWatch() as watch:
        await asyncio.sleep(0.03)
        start = time.perf_counter()
        time.sleep(HOLD_S)
        end = time.perf_counter()
        await asyncio.sleep(0.03)
    assert watch.worst(start, end) >= HOLD_S - 0.01
    assert watch.worst(end + 0.02, end + 0.03) < HOLD_S / 2
