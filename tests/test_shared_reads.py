"""DHT work a peer shares between its parts: one read of the run's records serves the prober,
the planner and the heartbeat; a burst of declaration updates is one store; a coordinate that
barely moved waits for the heartbeat. Real peers on loopback, one event loop; the counting
wrappers only count (and, once, inject a DHT failure) around the real calls."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from loopback_peers import start_peers

from swarm import peer as peer_module
from swarm.averaging.groups.coordinates import Coordinate
from swarm.averaging.groups.declarations import DeclarationBoard
from swarm.averaging.groups.placement import (
    LEAD_ROUNDS,
    PLACEMENT_FIELD,
    PREVIOUS_FIELD,
    Placement,
)
from swarm.averaging.groups.prober import Prober
from swarm.errors import ConfigError, DHTError, SwarmError
from swarm.net.progress import MAX_REASON_CHARS, PROGRESS_FIELD
from swarm.peer import Peer


def _count(target: object, name: str, fail_first: bool = False) -> Callable[[], int]:
    """Count the calls of ``target.<name>`` (a peer's DHT method, or the peer's announce) from
    now on (the first raising, if asked); returns the counter."""
    real = getattr(target, name)
    calls = 0

    async def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if fail_first and calls == 1:
            await asyncio.sleep(0.05)
            raise DHTError("injected: no node answered")
        return await real(*args, **kwargs)

    setattr(target, name, counted)
    return lambda: calls


async def _both_listed(peer: Peer, other: Peer) -> None:
    for _ in range(100):
        if other.peer_id in await peer.known_peers():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the other peer's record never showed up")


@pytest.fixture
async def listed() -> AsyncIterator[tuple[Peer, Peer]]:
    """Two peers on loopback, each listed in the other's reads of the run's records."""
    a, b = await start_peers([161, 162])
    try:
        await _both_listed(a, b)
        yield a, b
    finally:
        await asyncio.gather(a.close(), b.close())


async def test_concurrent_reads_of_the_run_records_share_one_dht_read(
    listed: tuple[Peer, Peer],
) -> None:
    a, b = listed
    gets = _count(a.dht, "get")
    first, second, third = await asyncio.gather(*(a.known_peers() for _ in range(3)))
    assert gets() == 1
    assert first == second == third and set(first) == {a.peer_id, b.peer_id}
    first.clear()  # each caller has its own copy
    assert set(await a.known_peers(max_age_s=60.0)) == {a.peer_id, b.peer_id}
    assert gets() == 1  # young enough: the last read answered again
    await a.known_peers()
    assert gets() == 2  # fresh asked for: read again


async def test_reads_that_keep_a_view_current_are_spaced_by_the_swarms_size(
    listed: tuple[Peer, Peer], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _ = listed
    gets = _count(a.dht, "get")
    await a.known_peers()
    assert gets() == 1
    await asyncio.sleep(0.3)
    monkeypatch.setattr(peer_module, "READ_S_PER_RECORD", 0.5)  # 2 records: 1 s apart
    await a.known_peers(max_age_s=0.1, spaced=True)
    assert gets() == 1  # 0.3 s old: young enough for a swarm of two at 0.5 s per record
    await a.known_peers(max_age_s=0.1)
    assert gets() == 2  # unspaced: its own age only
    monkeypatch.setattr(peer_module, "READ_S_PER_RECORD", 0.01)
    await asyncio.sleep(0.15)
    await a.known_peers(max_age_s=0.1, spaced=True)
    assert gets() == 3  # a small swarm: the caller's age rules


async def test_a_caller_that_stops_waiting_does_not_cancel_the_others_read(
    listed: tuple[Peer, Peer],
) -> None:
    a, b = listed
    gets = _count(a.dht, "get")
    impatient = asyncio.create_task(a.known_peers())
    patient = asyncio.create_task(a.known_peers())
    await asyncio.sleep(0)
    impatient.cancel()
    assert set(await patient) == {a.peer_id, b.peer_id}
    assert impatient.cancelled() and gets() == 1


async def test_a_failed_shared_read_fails_every_caller_and_is_not_kept(
    listed: tuple[Peer, Peer],
) -> None:
    a, b = listed
    gets = _count(a.dht, "get", fail_first=True)
    results = await asyncio.gather(a.known_peers(), a.known_peers(), return_exceptions=True)
    assert all(isinstance(r, SwarmError) for r in results), results
    assert set(await a.known_peers(max_age_s=60.0)) == {a.peer_id, b.peer_id}
    assert gets() == 1  # the last good read still serves those it is young enough for
    assert set(await a.known_peers()) == {a.peer_id, b.peer_id}
    assert gets() == 2
    assert a.metrics.counts.dht_failures.get("get") == 1


async def test_a_burst_of_declaration_updates_stores_the_newest_once_the_first_is_in() -> None:
    a, b = await start_peers([167, 168])
    board, reader = DeclarationBoard(a), DeclarationBoard(b)
    try:
        stores = _count(a.dht, "store")
        key, deadline = "shared-reads/round", time.time() + 30.0
        board.declare(key, deadline, update=0, leading=True, size=1)
        await asyncio.sleep(0)  # its store is under way
        for update in range(1, 6):  # a leader whose group grows by one member at a time
            board.declare(key, deadline, update=update, leading=True, size=update + 1)
        view: dict[Any, Any] = {}
        for _ in range(100):
            view = await reader.read(key, ())
            if a.peer_id in view and view[a.peer_id].size == 6:
                break
            await asyncio.sleep(0.05)
        assert view[a.peer_id].leading and view[a.peer_id].size == 6
        assert stores() == 2  # the first, then the newest of the five that came meanwhile
    finally:
        await asyncio.gather(board.close(), reader.close())
        await asyncio.gather(a.close(), b.close())


async def test_a_declaration_whose_round_is_over_is_not_stored() -> None:
    (a,) = await start_peers([169])
    board = DeclarationBoard(a)
    try:
        stores = _count(a.dht, "store")
        board.declare("shared-reads/over", time.time() - 1.0, update=0)
        await asyncio.sleep(0.1)
        assert stores() == 0
    finally:
        await board.close()
        await a.close()


async def test_a_move_to_another_cell_is_announced_at_once() -> None:
    a, b = await start_peers([174, 175])
    prober = Prober(a, publish_move_s=10.0)  # no move of the coordinate alone is announced
    announces = _count(a, "announce")
    try:
        await _both_listed(a, b)
        assert await prober.probe_once() == 1
        assert announces() == 1  # the first coordinate
        assert await prober.probe_once() == 1
        assert announces() == 1  # the same cell, a small move: the heartbeat's
        far = Placement(0, (99, 0, 0, 0), (0, 0, 0, 0), 0)  # as if it had sat far away
        prober.placer.current = far
        assert await prober.probe_once() == 1
        assert announces() == 2
        placed = prober.placer.current
        assert placed is not None and placed.cell != far.cell
        # the far one counted (from round 0): it counts until the new one does
        assert placed.start == LEAD_ROUNDS and prober.placer.previous == far
        extra = a.transport.record().extra
        assert extra[PLACEMENT_FIELD] == placed.to_wire()
        assert extra[PREVIOUS_FIELD] == far.to_wire()[1:]
    finally:
        await prober.close()
        await asyncio.gather(a.close(), b.close())


@pytest.mark.parametrize("move_s, announced", [(0.005, 1), (0.0, 3)])
async def test_a_coordinate_that_barely_moved_waits_for_the_heartbeat(
    move_s: float, announced: int
) -> None:
    a, b = await start_peers([170, 171])
    prober = Prober(a, publish_move_s=move_s)
    announces = _count(a, "announce")
    try:
        await _both_listed(a, b)
        for _ in range(3):  # loopback RTTs move the coordinate well under 5 ms
            assert await prober.probe_once() == 1
        assert announces() == announced
        # what is not announced yet is in the record the next heartbeat signs
        assert a.transport.record().extra["vc"] == prober.coordinate.to_wire()
    finally:
        await prober.close()
        await asyncio.gather(a.close(), b.close())


async def test_the_record_publishes_placements_and_readers_check_them() -> None:
    a, b = await start_peers([172, 173])
    prober, reader = Prober(a), Prober(b)
    try:
        await _both_listed(a, b)
        assert await prober.probe_once() == 1
        placed = prober.placer.current
        assert placed is not None and placed.start == LEAD_ROUNDS  # no round planned yet
        assert a.transport.record().extra[PLACEMENT_FIELD] == placed.to_wire()
        await a.announce()
        await reader.refresh()
        origin = Coordinate.origin(reader.vivaldi.config.dims)
        for round_ in (0, LEAD_ROUNDS - 1):  # before it counts: at the origin, in no cell
            view, cells = reader.placed(round_)
            assert view[a.peer_id] == origin and a.peer_id not in cells
        view, cells = reader.placed(LEAD_ROUNDS)
        assert cells[a.peer_id] == placed.cell
        assert view[a.peer_id] == placed.coordinate()
        for junk in (
            "near",
            [2, [1, 2], [0, 0, 0, 0], 0],
            [2, [True] * 4, [0, 0, 0, 0], 0],
            [2, [1.5, 0, 0, 0], [0, 0, 0, 0], 0],
            [2, [10**9, 0, 0, 0], [0, 0, 0, 0], 0],
            [2, [0, 0, 0, 0], [0.5, 0, 0, 0], 0],
            [2, [0, 0, 0, 0], [10**9, 0, 0, 0], 0],
            [2, [0, 0, 0, 0], [0, 0, 0, 0], -1],
            [-1, [0, 0, 0, 0], [0, 0, 0, 0], 0],
            [2, [0, 0, 0, 0], [0, 0, 0, 0]],
        ):
            record = a.transport.record()
            a.transport.update_record(extra={**record.extra, PLACEMENT_FIELD: junk})
            await a.announce()
            await reader.refresh()
            assert a.peer_id in reader.records  # the record is kept, its placement is not
            view, cells = reader.placed(LEAD_ROUNDS)
            assert a.peer_id not in cells and view[a.peer_id] == origin, junk
    finally:
        await asyncio.gather(prober.close(), reader.close())
        await asyncio.gather(a.close(), b.close())


async def test_a_progress_that_fills_the_record_leaves_room_for_the_placement() -> None:
    a, b = await start_peers([176, 177])
    prober = Prober(a)
    try:
        await _both_listed(a, b)
        # a progress as long as the extra fields hold (a scorer's list of lowered peers): the
        # next announce fits it again, halving its list (Peer._with_progress)
        progress = a.progress.snapshot(reachability="public")
        for why in range(MAX_REASON_CHARS, 0, -1):  # the longest that fits alone
            lowered = tuple((f"peer{i:06d}", 0.01, "y" * why) for i in range(8))
            wire = dataclasses.replace(progress, lowered=lowered).to_wire()
            try:
                a.transport.update_record(extra={PROGRESS_FIELD: wire})
                break
            except ConfigError:
                continue
        assert await prober.probe_once() == 1
        # the placement went out (the announce put a progress that fits back beside it)
        assert PLACEMENT_FIELD in a.transport.record().extra
    finally:
        await prober.close()
        await asyncio.gather(a.close(), b.close())
