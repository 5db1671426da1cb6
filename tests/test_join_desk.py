"""A planned member that asks its leader before the leader opened the round is held, not
turned away; the hold is bounded in time and in count, whatever the asker claims."""

from __future__ import annotations

import asyncio
import logging
import math

import pytest
from loopback_peers import start_peers

from swarm.averaging.groups import join_desk
from swarm.averaging.groups.group import GroupInfo
from swarm.averaging.groups.matchmaking import Matchmaker
from swarm.errors import TransportError
from swarm.net.streams import RemotePeer


@pytest.mark.parametrize(
    ("gather_window", "late", "patience"),
    [(0.8, 0.4, 0.0), (0.2, 0.6, 2.0)],
    ids=["within-the-gather-window", "past-it-within-the-patience"],
)
async def test_a_planned_member_asking_before_its_leader_opened_is_held_not_turned_away(
    caplog, gather_window: float, late: float, patience: float
) -> None:
    """The follower's plan is ready ``late`` seconds before the leader's (the leader's last
    round was still landing): its first request waits at the leader and is the one that joins;
    the leader then closes at once with its planned member instead of after a patience. A
    leader later than the follower's gather window is still asked directly, within the
    follower's patience for planned members."""
    caplog.set_level(logging.DEBUG, logger="swarm.averaging.groups.matchmaking")
    peers = await start_peers([201, 202])
    leader_peer, follower_peer = sorted(peers, key=lambda p: p.peer_id.digest)
    leader, follower = (
        Matchmaker(
            p,
            rpc_name="mm.join",
            min_group_size=2,
            target_group_size=2,
            gather_window=gather_window,
        )
        for p in (leader_peer, follower_peer)
    )
    record = leader_peer.transport.record()

    async def late_leader() -> GroupInfo | object:
        await asyncio.sleep(late)
        planned = (follower_peer.transport.record(),)
        return await leader.form_group(
            "early", 8.0, expected=2, patience=patience, leader=record, planned=planned
        )

    try:
        groups = await asyncio.wait_for(
            asyncio.gather(
                follower.form_group(
                    "early", 8.0, expected=2, patience=patience, leader=record, planned=(record,)
                ),
                late_leader(),
            ),
            20.0,
        )
        assert all(isinstance(g, GroupInfo) for g in groups), groups
        assert groups[0].group_id == groups[1].group_id
        turned_away = [r for r in caplog.records if "not looking for this key" in r.getMessage()]
        assert not turned_away, turned_away
        assert leader.desk.held == 0
    finally:
        await asyncio.gather(leader.close(), follower.close())
        await asyncio.gather(*(p.close() for p in peers))


async def _ask(caller, record, key: str, wait: object, deadline: float = 1e12) -> dict:
    payload = {"k": key, "d": deadline, "r": caller.transport.record().serialize(), "o": 0}
    if wait is not None:
        payload["w"] = wait
    return await caller.transport.call(record, "mm.join", payload, timeout=10.0)


@pytest.mark.parametrize("wait", [None, 0, -1.0, math.nan, math.inf, "1", True, [1.0]])
async def test_a_join_that_will_not_wait_or_lies_about_it_is_answered_at_once(wait) -> None:
    desk_peer, caller = await start_peers([203, 204])
    maker = Matchmaker(
        desk_peer, rpc_name="mm.join", min_group_size=2, target_group_size=2, gather_window=0.1
    )
    try:
        task = asyncio.create_task(_ask(caller, desk_peer.transport.record(), "nowhere", wait))
        reply = await asyncio.wait_for(task, 10.0)
        assert reply == {"ok": False, "why": "not looking for this key"}
        assert maker.desk.held == 0
    finally:
        await maker.close()
        await asyncio.gather(desk_peer.close(), caller.close())


async def test_joins_held_for_a_round_that_never_opens_are_bounded(monkeypatch) -> None:
    """Any authenticated peer can ask: however long it says it waits (1e30 s), a request is held
    at most HOLD_EARLY_S, one per sender and at most MAX_HELD at once; the rest, and malformed
    requests, are answered at once."""
    monkeypatch.setattr(join_desk, "MAX_HELD", 3)
    desk_peer, *callers = await start_peers([205, 206, 207, 208, 209])
    maker = Matchmaker(
        desk_peer, rpc_name="mm.join", min_group_size=2, target_group_size=2, gather_window=0.1
    )
    record = desk_peer.transport.record()
    try:

        async def most_held(askers: list) -> int:
            asks = [
                asyncio.create_task(_ask(c, record, f"never-{i}", 1e30))
                for i, c in enumerate(askers)
            ]
            most = 0

            async def watch() -> None:
                nonlocal most
                while not all(t.done() for t in asks):
                    most = max(most, maker.desk.held)
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(watch(), 10.0)  # (held for 1e30 s, it would not end)
            for reply in await asyncio.gather(*asks, return_exceptions=True):
                # a refusal, or the server's own flood limit
                assert reply == {"ok": False, "why": "not looking for this key"} or isinstance(
                    reply, TransportError
                ), reply
            assert maker.desk.held == 0
            return most

        # one from each of four senders: MAX_HELD held, the fourth answered at once
        assert await most_held(callers) == 3
        # three at once from one sender (the handler called as the server would, so that no
        # transport budget decides): one held, the others answered at once
        me = callers[0]
        sender = RemotePeer(me.peer_id, b"", b"", "127.0.0.206")
        payload = {"d": 1e12, "r": me.transport.record().serialize(), "o": 0, "w": 1e30}
        joins = [
            asyncio.create_task(maker.desk.rpc_join(sender, {**payload, "k": f"again-{i}"}))
            for i in range(3)
        ]
        done, _ = await asyncio.wait(joins, timeout=0.3)
        assert len(done) == 2 and maker.desk.held == 1
        assert (
            await asyncio.wait_for(asyncio.gather(*joins), 10.0)
            == [{"ok": False, "why": "not looking for this key"}] * 3
        )
        long_key = await _ask(callers[0], record, "k" * (join_desk.MAX_KEY_CHARS + 1), 1.0)
        assert long_key == {"ok": False, "why": "not looking for this key"}
        malformed = asyncio.create_task(_ask(callers[1], record, "never", 1.0, deadline=math.nan))
        assert await asyncio.wait_for(malformed, 10.0) == {"ok": False, "why": "bad deadline"}
        assert maker.desk.held == 0
    finally:
        await maker.close()
        await asyncio.gather(desk_peer.close(), *(c.close() for c in callers))
