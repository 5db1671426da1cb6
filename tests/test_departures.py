"""Peers that die mid-run: nobody waits for a dead peer, and views agree again quickly.

Real peers on loopback, one event loop. A "dead" peer is a started peer that was closed: its
record is still in hand (as it stays in the DHT until its TTL) but its port refuses connections,
which is what a SIGKILLed process leaves behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import random
from collections.abc import AsyncIterator

import pytest
import torch
from averaging_worker import make_tensor
from loopback_peers import fixed_group_config, start_peers

from swarm.averaging import Averager, AveragingConfig, Fault
from swarm.averaging.butterfly.context import RoundContext
from swarm.averaging.butterfly.replies import PartReplies
from swarm.averaging.groups.group import GroupInfo, NoGroup
from swarm.averaging.groups.liveness import Liveness
from swarm.averaging.groups.matchmaking import Matchmaker
from swarm.averaging.groups.peer_tags import tag_of
from swarm.averaging.groups.prober import (
    GONE_FIELD,
    MAX_GONE_LISTED,
    MAX_REPORT_CHECKS,
    Prober,
)
from swarm.averaging.result import RefusalAction
from swarm.errors import AveragingError, TransportError
from swarm.identity import Identity
from swarm.net.record import PeerRecord


async def test_liveness_tells_a_closed_port_from_a_live_peer() -> None:
    me, live, dead = await start_peers([81, 82, 83])
    dead_record = dead.transport.record()
    await dead.close()
    liveness = Liveness(me)
    try:
        assert await liveness.check(dead_record) is True
        assert await liveness.check(live.transport.record()) is False
        assert liveness.gone == {dead_record.peer_id}
        assert await liveness.check(dead_record) is True  # answered from what it knows
    finally:
        await liveness.close()
        await asyncio.gather(me.close(), live.close())


async def test_a_leader_does_not_wait_for_a_planned_member_that_died() -> None:
    """Two live members planned with a dead one: they close a pair as soon as the check says it
    is gone, not after the patience (20 s here, which the test's bound would not allow)."""
    a, b, dead = await start_peers([84, 85, 86])
    records = {p.peer_id: p.transport.record() for p in (a, b, dead)}
    await dead.close()
    leader = records[min(records, key=lambda pid: pid.digest)]
    makers = [
        Matchmaker(p, rpc_name="mm.join", min_group_size=2, target_group_size=3, gather_window=0.2)
        for p in (a, b)
    ]
    try:

        async def form(m: Matchmaker):
            planned = tuple(r for pid, r in records.items() if pid != m.peer_id)
            return await m.form_group(
                "planned-dead", 30.0, expected=3, patience=20.0, leader=leader, planned=planned
            )

        groups = await asyncio.wait_for(asyncio.gather(*(form(m) for m in makers)), 10.0)
        assert all(isinstance(g, GroupInfo) for g in groups), groups
        assert set(groups[0].peer_ids) == {a.peer_id, b.peer_id}
        assert any(dead.peer_id in m.liveness.gone for m in makers)  # the leader checked it
    finally:
        for m in makers:
            await m.close()
        await asyncio.gather(a.close(), b.close())


@pytest.mark.parametrize("role", ["leader", "follower"])
async def test_a_planned_member_left_alone_gives_up_after_the_patience(role: str) -> None:
    """Its planned partner is alive but planned another group (their views differ): whether it
    would lead or follow, it does not sit through the whole matchmaking timeout."""
    one, two = await start_peers([87, 88])
    first, second = sorted([one, two], key=lambda p: p.peer_id.digest)  # first leads the plan
    me, other = (first, second) if role == "leader" else (second, first)
    maker = Matchmaker(
        me, rpc_name="mm.join", min_group_size=2, target_group_size=2, gather_window=0.1
    )
    try:
        outcome = await asyncio.wait_for(
            maker.form_group(
                "alone",
                30.0,
                expected=2,
                patience=0.5,
                leader=first.transport.record(),
                planned=(other.transport.record(),),
            ),
            10.0,
        )
        assert outcome == NoGroup("no planned member came")
        assert other.peer_id not in maker.liveness.gone  # alive: not reported gone
    finally:
        await maker.close()
        await asyncio.gather(one.close(), two.close())


@pytest.mark.parametrize("patience", [None, 2.5])
async def test_a_round_may_wait_longer_for_its_planned_member(patience: float | None) -> None:
    """Two peers whose rounds start 2 s apart under a 3 s matchmaking timeout (peers of equal
    speed whose overlapped rounds start about one round apart): the earlier one gives up after
    half the timeout, unless its round may wait longer (an overlapped round, whose peer trains
    while it waits)."""
    peers = await start_peers([93, 94], run_id=f"patience-{patience}")
    config = AveragingConfig(
        grouping="latency",
        min_group_size=2,
        target_group_size=2,
        matchmaking_timeout_s=3.0,
        threads=1,
    )
    averagers = [Averager(p, config) for p in peers]
    try:
        for _ in range(100):
            views = await asyncio.gather(*(p.known_peers() for p in peers))
            if all(len(v) == 2 for v in views):
                break
            await asyncio.sleep(0.2)
        values = [torch.zeros(64), torch.ones(64)]

        async def later():
            await asyncio.sleep(2.0)
            return await averagers[1].average([values[1]], order=5, patience_s=patience)

        early, late = await asyncio.gather(
            averagers[0].average([values[0]], order=5, patience_s=patience), later()
        )
        if patience is not None:
            assert early.averaged and late.averaged, (early.reason, late.reason)
            for v in values:
                torch.testing.assert_close(v, torch.full((64,), 0.5))
        else:
            assert (early.averaged, early.reason) == (False, "no planned member came")
            assert not late.averaged
    finally:
        await asyncio.gather(*(a.close() for a in averagers))
        await asyncio.gather(*(p.close() for p in peers))


async def test_patience_follows_how_late_planned_members_joined() -> None:
    (peer,) = await start_peers([89])
    maker = Matchmaker(
        peer, rpc_name="mm.join", min_group_size=2, target_group_size=4, gather_window=0.1
    )
    try:
        assert maker.patience(7.5) == 7.5  # nothing seen yet: the configured most
        maker.desk.lags.extend([0.01, 0.05, 0.2] * 4)
        assert maker.patience(7.5) == pytest.approx(2 * 0.2 + 0.2)
        maker.desk.lags.append(30.0)  # a member that came very late: never above the most
        assert maker.patience(7.5) == 7.5
    finally:
        await maker.close()
        await peer.close()


async def test_a_member_that_died_mid_round_is_found_gone() -> None:
    me, live, dead = await start_peers([90, 91, 92])
    group = GroupInfo.create([p.transport.record() for p in (me, live, dead)])
    dead_index = group.index_of(dead.peer_id)
    live_index = group.index_of(live.peer_id)
    await dead.close()
    liveness = Liveness(me)
    ctx = RoundContext(
        group=group,
        me=group.index_of(me.peer_id),
        weight=1.0,
        feedback=None,
        workers=None,
        stall=None,
        deadline=0.0,
        faults=None,
        liveness=liveness,
    )
    try:
        ctx.suspect(dead_index)
        ctx.suspect(live_index)
        for _ in range(200):
            if dead_index in ctx.gone:
                break
            await asyncio.sleep(0.01)
        assert ctx.gone == {dead_index}
        assert dead.peer_id in liveness.gone
        ctx.mark_gone(live_index)  # a refusal seen by a stream counts the same way
        assert live.peer_id in liveness.gone
    finally:
        await liveness.close()
        await asyncio.gather(me.close(), live.close())


def _record(extra: dict | None = None) -> PeerRecord:
    from swarm.address import PeerAddress

    return PeerRecord.create(
        Identity.generate(),
        address=PeerAddress("127.0.0.1", 9),
        run_id="departures",
        extra=extra or {},
    )


async def test_gone_reports_are_hints_checked_and_bounded() -> None:
    (peer,) = await start_peers([93])
    prober = Prober(peer)
    try:
        listed = [_record() for _ in range(MAX_REPORT_CHECKS + 4)]
        tags = [tag_of(r.peer_id) for r in listed]
        reporters = [_record({GONE_FIELD: tags[:6]}), _record({GONE_FIELD: tags[6:]})]
        hostile = [
            _record({GONE_FIELD: "not a list"}),
            _record({GONE_FIELD: [7, b"bytes", None, "short"]}),
            _record({GONE_FIELD: tags[: MAX_GONE_LISTED + 1]}),  # too long: ignored whole
        ]
        for r in [*listed, *reporters, *hostile]:
            prober.records[r.peer_id] = r
        suspects = prober.reported_gone()
        assert len(suspects) == MAX_REPORT_CHECKS  # a long list costs a bounded number of pings
        assert {s.peer_id for s in suspects} <= {r.peer_id for r in listed}
        rest = prober.reported_gone()  # the others next time, never the same twice in a row
        assert {s.peer_id for s in rest}.isdisjoint({s.peer_id for s in suspects})
        assert prober.reported_gone() == []
        unknown = _record({GONE_FIELD: [tag_of(Identity.generate().peer_id)]})
        prober.records[unknown.peer_id] = unknown
        assert prober.reported_gone() == []  # a peer this view does not hold is nothing to check
    finally:
        await prober.close()
        await peer.close()


async def test_a_peer_found_gone_is_reported_in_its_finders_record() -> None:
    finder, other = await start_peers([94, 95])
    prober = Prober(finder)
    try:
        gone = Identity.generate().peer_id
        prober.mark_gone(gone)
        for _ in range(200):
            if GONE_FIELD in finder.transport.record().extra:
                break
            await asyncio.sleep(0.01)
        assert finder.transport.record().extra[GONE_FIELD] == [tag_of(gone)]
        seen = {}
        for _ in range(100):  # announced at once, not at the next heartbeat
            seen = await other.known_peers()
            if GONE_FIELD in seen.get(finder.peer_id, _record()).extra:
                break
            await asyncio.sleep(0.05)
        assert seen[finder.peer_id].extra[GONE_FIELD] == [tag_of(gone)]
    finally:
        await prober.close()
        await asyncio.gather(finder.close(), other.close())


async def test_rounds_of_different_purposes_never_group() -> None:
    a, b = await start_peers([98, 99])
    config = AveragingConfig(
        codec="none",
        min_group_size=2,
        target_group_size=2,
        matchmaking_timeout_s=1.5,
        round_timeout_s=10.0,
        gather_window_s=0.1,
        group_key="purpose",
        grouping="fixed",
        threads=1,
    )
    averagers = [Averager(p, config) for p in (a, b)]
    rng = random.Random(0)
    tensors = [torch.tensor([rng.random() for _ in range(64)]) for _ in averagers]
    try:
        mixed = await asyncio.gather(
            averagers[0].average([tensors[0]], purpose="values"),
            averagers[1].average([tensors[1]]),
        )
        assert not any(r.averaged for r in mixed), mixed
        same = await asyncio.gather(
            *(avg.average([t], purpose="values") for avg, t in zip(averagers, tensors, strict=True))
        )
        assert all(r.averaged for r in same), same
    finally:
        for avg in averagers:
            await avg.close()
        await asyncio.gather(a.close(), b.close())


@pytest.mark.timeout(90)
async def test_a_sender_that_dies_mid_stream_is_dropped_not_refused(caplog) -> None:
    """A member that dies halfway through its streams (its connections break) is dropped from
    the parts it was sending to, like a stalled one, not refused: a broken connection says
    nothing about what came through it. Nothing above INFO names it, and the owners' replies
    to it, which could not be written, leave no task whose failure nobody read."""
    caplog.set_level(logging.INFO)
    n, numel = 3, 8 << 20  # 8 chunks of 1 MiB per part: the victim stops after 4
    peers = await start_peers([134, 135, 136])
    config = fixed_group_config(n, "dies-mid-stream", aggregator="mean", stall_timeout_min_s=30.0)
    faults = [Fault.NONE, Fault.NONE, Fault.STALL_MID_STREAM]
    averagers = [Averager(p, config, fault=f) for p, f in zip(peers, faults, strict=True)]
    victim = peers[2].peer_id
    try:
        tensors = [make_tensor(i + 1, numel) for i in range(n)]
        rounds = [
            asyncio.create_task(a.average([t])) for a, t in zip(averagers, tensors, strict=True)
        ]
        await asyncio.wait_for(averagers[2].faults.triggered.wait(), 30)
        await asyncio.sleep(0.5)  # the others' streams and replies run meanwhile
        rounds[2].cancel()  # the process dies: its streams end with its connections
        await asyncio.gather(rounds[2], return_exceptions=True)
        await peers[2].close()
        results = await asyncio.gather(*rounds[:2])
        for peer, result in zip(peers[:2], results, strict=True):
            about = [r for r in result.refusals if r.peer == victim]
            own = [r for r in about if r.part == result.members.index(peer.peer_id)]
            assert own and all(r.action is RefusalAction.DROPPED for r in own), result.refusals
            assert not [r for r in about if r.action is RefusalAction.REFUSED], result.refusals
        gc.collect()  # a task whose failure nobody read is reported when it is collected
        loud = [r for r in caplog.records if r.levelno > logging.INFO]
        assert not [r for r in loud if victim.short in r.getMessage()], loud
        assert not [r for r in loud if r.levelno >= logging.ERROR], loud
    finally:
        for a in averagers:
            await a.close()
        await asyncio.gather(*(p.close() for p in peers[:2]))


@contextlib.asynccontextmanager
async def stalling_round(
    hosts: list[int], key: str
) -> AsyncIterator[tuple[list[Averager], list[torch.Tensor], list[asyncio.Task]]]:
    """A round of three peers whose third stops halfway through every part stream (8 chunks of
    1 MiB per part: it stops after 4) and stays connected: yields the averagers, tensors and
    round tasks once it stopped; cancels the rounds and closes everything after."""
    n, numel = 3, 8 << 20
    peers = await start_peers(hosts)
    config = fixed_group_config(n, key, aggregator="mean", stall_timeout_min_s=30.0)
    faults = [Fault.NONE, Fault.NONE, Fault.STALL_MID_STREAM]
    averagers = [Averager(p, config, fault=f) for p, f in zip(peers, faults, strict=True)]
    tensors = [make_tensor(i + 1, numel) for i in range(n)]
    rounds = [asyncio.create_task(a.average([t])) for a, t in zip(averagers, tensors, strict=True)]
    try:
        await asyncio.wait_for(averagers[2].faults.triggered.wait(), 30)
        yield averagers, tensors, rounds
    finally:
        for r in rounds:
            r.cancel()
        await asyncio.gather(*rounds, return_exceptions=True)
        for a in averagers:
            await a.close()
        await asyncio.gather(*(p.close() for p in peers))


@pytest.mark.timeout(90)
async def test_a_cancelled_round_stops_its_streams_with_it(caplog) -> None:
    """A round cancelled mid-stream (its peer closes, its caller gives up) cancels its senders
    and its own part's owner: before, they went on after the round was gone (a stalled stream
    until its timeout), and a loop closed under them left coroutines that raised "Event loop is
    closed" when collected. The streams its part still read end with it (410, at DEBUG): they
    went on into a worker pool that the averager's close then shut, each logged as a handler
    failure at WARNING."""
    async with stalling_round([137, 138, 139], "cancelled-mid-stream") as (averagers, _, rounds):
        for r in rounds:
            r.cancel()
        caplog.set_level(logging.DEBUG, logger="swarm.net.server")
        await asyncio.gather(*rounds, return_exceptions=True)
        left = [
            t.get_name()
            for t in asyncio.all_tasks()
            if t.get_name().startswith(("swarm-send-", "swarm-own-part")) and not t.done()
        ]
        assert left == []
        for a in averagers:
            await a.close()
        await asyncio.sleep(0.2)  # what the streams still read on do now, they do by then
        server = [r for r in caplog.records if r.name == "swarm.net.server"]
        assert [r.getMessage() for r in server if r.levelno > logging.INFO] == []
        assert any("ended here" in r.getMessage() for r in server)


@pytest.mark.timeout(90)
async def test_closing_an_averager_mid_round_fails_its_round() -> None:
    """An averager closed while its own round runs (a direct user's; the Swarm facade cancels
    its rounds first) calls the round off: its caller gets a failed result at once, as does a
    round that waited for it. Before, the round went on into the worker pool that close had
    shut, and raised its RuntimeError."""
    async with stalling_round([142, 143, 144], "closed-mid-round") as (averagers, tensors, rounds):
        queued = asyncio.create_task(averagers[0].average([tensors[0]]))  # waits for the lock
        await asyncio.sleep(0.1)
        await asyncio.wait_for(averagers[0].close(), 10)
        for result in await asyncio.wait_for(asyncio.gather(rounds[0], queued), 1):
            assert not result.averaged and result.reason == "the averager closed", result
        with pytest.raises(AveragingError, match="closed"):
            await averagers[0].average([tensors[0]])


async def test_a_stream_that_reaches_a_closed_averager_is_answered_gone_quietly(caplog) -> None:
    """A member's part stream that arrives after this peer's averager closed (the peer is
    leaving) is answered 410, which its sender reads as an owner that sends it nothing, and is
    logged at DEBUG: nothing the sender did. Before, it was refused 404 at WARNING."""
    peers = await start_peers([140, 141])
    averager = Averager(peers[0], fixed_group_config(2, "closed-averager"))
    try:
        await averager.close()
        caplog.set_level(logging.DEBUG, logger="swarm.net.server")
        header = {"g": bytes(16), "p": 0, "a": 0, "w": 1.0}
        with pytest.raises(TransportError) as refused:
            async with peers[1].transport.stream(
                peers[0].transport.record(), "avg.part", header, _no_chunks(), timeout=10
            ):
                pass
        assert refused.value.status == 410, refused.value
        server = [r for r in caplog.records if r.name == "swarm.net.server"]
        assert [r.getMessage() for r in server if r.levelno > logging.INFO] == []
        assert any("averager is closed" in r.getMessage() for r in server), server
    finally:
        await averager.close()
        await asyncio.gather(*(p.close() for p in peers))


async def _no_chunks() -> AsyncIterator[bytes]:
    return
    yield b""


class _HungUpReply:
    """The reply stream of a sender that hung up: every write finds the connection gone."""

    async def write(self, payload: bytes) -> None:
        raise TransportError("connection lost: ConnectionResetError()", lost=True)


async def _hold() -> None:
    await asyncio.sleep(3600)


async def _cancel_while_waiting(replies: PartReplies, writer: asyncio.Task[bool]) -> None:
    """The owner's handler waits for the verdict of a reply written by ``writer``; the server
    cancels it (its caller hung up)."""
    waiting = asyncio.create_task(replies.finish(_HungUpReply(), writer, 0))
    await asyncio.sleep(0.05)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    await asyncio.sleep(0)


async def _a_reply_that_failed(replies: PartReplies) -> None:
    replies.new_attempt()
    failed = replies.start(_HungUpReply(), 0)
    replies.publish(0, b"chunk", (0,))  # its write finds the connection gone
    await _cancel_while_waiting(replies, failed)
    assert failed.done()


async def test_an_owners_reply_to_a_sender_that_hung_up_leaves_no_unread_failure(caplog) -> None:
    """The server cancels the handler of a sender that hung up while the owner waits for the
    part's verdict. The reply's writer, which failed or still waits for chunks, is stopped and
    its failure read: before, asyncio logged "Task exception was never retrieved" at ERROR."""
    caplog.set_level(logging.ERROR, logger="asyncio")
    replies = PartReplies(chunks=2, hold=_hold)
    await _a_reply_that_failed(replies)
    gc.collect()  # a task whose failure nobody read is reported when it is collected
    assert "never retrieved" not in caplog.text

    replies.new_attempt()
    stalled = replies.start(_HungUpReply(), 0)  # no chunk averaged yet: it waits for one
    await _cancel_while_waiting(replies, stalled)
    assert stalled.cancelled()  # not left waiting for chunks of a reply nobody reads
