"""Matchmaking: find partners in the DHT and agree on one group (leader-based).

One round (see :mod:`swarm.averaging.groups.group` for why stale views cannot split a group):

1. declare ``Declaration(record, deadline)`` under the matchmaking key, expiring at the deadline;
2. after a short gather window, read the key; join the leader (:func:`choose_leader`) with the
   ``join`` RPC, which the leader answers when it closes the group; or, when this peer is the
   leader, wait for followers;
   When the caller planned the group (``expected`` members, e.g. latency-aware groups), the
   window ends as soon as that many have declared;
3. a leader closes at the target size, at the planned size, when every looking candidate it sees
   has joined (and the group has the minimum size), or at the earliest deadline of its members;
4. members re-declare themselves busy, so late peers do not wait for them.

A refused or unreachable leader is skipped; a leader that times out (it may have counted us) ends
the round for this peer. Nobody waits past its deadline plus one RPC slack. A planned member that
has not joined by the end of the gather window is checked for life (:mod:`.liveness`): a killed
peer's record outlives it, and a leader does not wait for a member whose address refuses
connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from swarm.averaging.groups.declarations import DeclarationBoard
from swarm.averaging.groups.group import (
    Declaration,
    GroupInfo,
    NoGroup,
    choose_leader,
)
from swarm.averaging.groups.join_desk import HOLD_EARLY_S, JoinDesk
from swarm.averaging.groups.liveness import Liveness
from swarm.averaging.groups.match_round import MatchRound
from swarm.averaging.groups.rates import PeerRates
from swarm.errors import AuthError, AveragingError, TransportError
from swarm.identity import PeerID
from swarm.net.record import PeerRecord
from swarm.protocols import Peer

logger = logging.getLogger(__name__)

_JOIN_SLACK_S = 3.0  # a follower waits this much past the leader's deadline for its answer
_GATHER_POLL_S = 0.02  # between DHT reads while gathering the planned members


class Matchmaker:
    """Forms groups for one averager; serves the ``{name}.join`` RPC on the peer's transport.

    Args:
        peer: a started :class:`swarm.peer.Peer` (its transport, DHT and identity are used).
        rpc_name: route of the join RPC.
        min_group_size / target_group_size: group size bounds, this peer included.
        gather_window: seconds to wait after declaring before choosing a leader, so that peers
            that start a round at about the same time see each other.
        liveness: checks planned members that do not join; refusals land in its ``gone``.
        rates: this peer's measurements of others' upload, handed to the members of the groups
            it leads (:attr:`GroupInfo.measured`); default: none measured.
        poll_interval: seconds between DHT reads while waiting.
    """

    def __init__(
        self,
        peer: Peer,
        *,
        rpc_name: str,
        min_group_size: int,
        target_group_size: int,
        gather_window: float,
        liveness: Liveness | None = None,
        rates: PeerRates | None = None,
        poll_interval: float = 0.25,
    ):
        self.peer = peer
        self.rpc_name = rpc_name
        self.min_group_size = min_group_size
        self.target_group_size = target_group_size
        self.gather_window = gather_window
        self.poll_interval = poll_interval
        self.board = DeclarationBoard(peer)
        self.liveness = liveness if liveness is not None else Liveness(peer)
        self.rates = rates
        self.desk = JoinDesk(peer, target_group_size, self._declare)
        peer.transport.add_rpc(rpc_name, self.desk.rpc_join)

    @property
    def peer_id(self) -> PeerID:
        return self.peer.peer_id

    async def form_group(
        self,
        key: str,
        timeout: float,
        *,
        expected: int = 0,
        patience: float = 0.0,
        leader: PeerRecord | None = None,
        planned: tuple[PeerRecord, ...] = (),
        state: bytes = b"",
    ) -> GroupInfo | NoGroup:
        """Look for a group under ``key`` for at most ``timeout`` seconds.

        ``expected``: how many members the caller planned under ``key`` (e.g. latency-aware
        groups); a leader then closes early, when every candidate it sees has joined, only once
        that many joined or ``patience`` seconds passed, so that a member a little late (a far
        peer whose DHT reads are slower) is not left alone for the whole round.

        ``leader``: the planned group's leader (its smallest PeerID), when the caller planned the
        members: a follower then joins it at once instead of waiting for DHT reads (which cross
        the WAN even for a group of neighbours), and the leader skips the gather window. If that
        leader does not take it within the gather window (another view, not started yet), the
        round goes on through the DHT as usual.

        ``planned``: the records of the other planned members; those that have not joined when
        the gather window ends are checked for life, and the gone ones are not waited for.

        ``state``: a digest of the values this peer would sync after the round; the group says
        whether every member joined with the same one (:attr:`GroupInfo.agreed`).

        Returns:
            The agreed group, or :class:`NoGroup` with a short reason (never raises for that).
        """
        now = time.time()
        patience = min(patience, timeout)
        rnd = MatchRound(key, now + timeout, now, expected, now + patience, leader, planned, state)
        self.desk.open(rnd)
        group: GroupInfo | NoGroup = NoGroup("matchmaking did not finish")
        try:
            self._declare(rnd)
            group = await self._match(rnd)
            return group
        finally:
            self.desk.end(rnd)
            if not rnd.closed.done():
                rnd.closed.set_result(None)  # followers still waiting hear "no group"
            if isinstance(group, GroupInfo) and rnd.deadline > time.time():
                self._declare(rnd, busy=True)  # (an expired declaration is gone already)

    def patience(self, most: float) -> float:
        """How long a leader of a regular round waits for planned members (see
        :meth:`JoinDesk.patience`)."""
        return self.desk.patience(most)

    async def close(self) -> None:
        await self.liveness.close()
        await self.board.close()

    # ---- the round

    async def _match(self, rnd: MatchRound) -> GroupInfo | NoGroup:
        refused: set[PeerID] = set()
        planned = rnd.planned_leader
        if planned is None:
            await self._gather(rnd)
        elif planned.peer_id == self.peer_id:
            await self._await_planned(rnd)
        else:
            outcome = await self._join_planned(rnd, planned)
            if outcome is not None:
                return outcome
        seen = 0
        self._check_missing(rnd)
        while True:
            now = time.time()
            if rnd.role == "leader":
                size = len(rnd.followers) + 1
                expected = self._expected(rnd)
                if size >= self.target_group_size:
                    return self._close(rnd)
                if expected and size >= max(expected, self.min_group_size):
                    return self._close(rnd)  # everyone planned under this key (and alive) is in
                if now >= rnd.close_by():
                    if size >= self.min_group_size:
                        return self._close(rnd)
                    return NoGroup(f"only {size} of the {self.min_group_size} peers needed joined")
                view = await self._candidates(rnd)
                size = len(rnd.followers) + 1
                merge_into = self._smaller_leader(view, size, refused)
                if merge_into is not None and size < self.target_group_size:
                    logger.debug("merging a group of %d into %s's", size, merge_into.short)
                    self._disband(rnd)
                    outcome = await self._follow(rnd, view[merge_into], refused)
                    if outcome is not None:
                        return outcome
                    continue
                waiting_for = [
                    p for p, d in view.items() if not d.leading and p not in rnd.followers
                ]
                patient = size < expected and now < rnd.patient_until
                # a planned leader past its patience stops waiting for unplanned candidates too:
                # keys outlive rounds, so a declaration may be a peer's from an earlier round
                waited = bool(expected) and now >= rnd.patient_until
                ready = size >= self.min_group_size and (waited or not waiting_for)
                ready = ready and not patient
                if ready and rnd.role == "leader":
                    return self._close(rnd)
                await self._wait(rnd, self.poll_interval)
                continue
            if now >= rnd.deadline:
                return NoGroup(f"no group formed (saw {seen} other candidates)")
            if rnd.planned and all(r.peer_id in self.liveness.gone for r in rnd.planned):
                return NoGroup("every other planned member is gone")
            view = await self._candidates(rnd)
            seen = max(seen, len(view))
            if rnd.role != "candidate":  # a follower joined while we read the DHT
                continue
            coming = [p for p in view if p not in refused]
            if rnd.expected and not coming and now >= rnd.patient_until:
                # its planned members planned other groups (views differ) or are gone, and the
                # declarations left refused us (an earlier round's): whether it would lead or
                # follow, do not sit through the whole timeout
                return NoGroup("no planned member came")
            leading = [p for p, d in view.items() if d.leading]
            leader = choose_leader([*view, self.peer_id], leading, refused)
            if leader is None or leader == self.peer_id:
                await self._wait(rnd, self.poll_interval)
                continue
            outcome = await self._follow(rnd, view[leader], refused)
            if outcome is not None:
                return outcome

    async def _follow(
        self, rnd: MatchRound, leader: Declaration, refused: set[PeerID], wait: float = 0.0
    ) -> GroupInfo | NoGroup | None:
        """Join ``leader``: the group, why to give up the round, or None when refused
        (``leader`` is then added to ``refused`` and this peer is a candidate again).
        ``wait``: seconds the leader may hold the request until it opens the round."""
        rnd.role = "joining"
        outcome = await self._join(rnd, leader, wait)
        if outcome is None:
            refused.add(leader.record.peer_id)
            rnd.role = "candidate"
            return None
        rnd.role = "closed"
        return outcome

    def _smaller_leader(
        self, view: dict[PeerID, Declaration], size: int, refused: set[PeerID]
    ) -> PeerID | None:
        """The smallest leader below this peer's PeerID whose group has room for ours."""
        fits = [
            p
            for p, d in view.items()
            if d.leading
            and p not in refused
            and p.digest < self.peer_id.digest
            and d.size + size <= self.target_group_size
        ]
        return min(fits, key=lambda p: p.digest) if fits else None

    def _disband(self, rnd: MatchRound) -> None:
        """Stop leading before closing: waiting followers hear "no group formed" and look
        again (they find the leader this peer is about to join)."""
        rnd.closed.set_result(None)
        rnd.closed = asyncio.get_running_loop().create_future()
        rnd.followers.clear()
        rnd.role = "joining"
        self._declare(rnd)

    async def _join_planned(
        self, rnd: MatchRound, leader: PeerRecord
    ) -> GroupInfo | NoGroup | None:
        """Join the planned leader directly, retrying while it has not started the round;
        None: it did not take us in time (go on through the DHT). In time: the gather window,
        or, when longer, as long as the leader may hold a request (it answers the moment it
        opens the round) within the patience for planned members."""
        now = time.time()
        held = min(rnd.patient_until, now + HOLD_EARLY_S)
        end = min(max(now + self.gather_window, held), rnd.deadline)
        declaration = Declaration(leader, rnd.deadline)
        while (
            rnd.role == "candidate"
            and time.time() < end
            and leader.peer_id not in self.liveness.gone
        ):
            # a refusal here is not final (the leader may not have started): no refused set
            outcome = await self._follow(rnd, declaration, set(), wait=end - time.time())
            if outcome is not None:
                return outcome
            await self._wait(rnd, min(_GATHER_POLL_S, end - time.time()))
        return None

    async def _await_planned(self, rnd: MatchRound) -> None:
        """As the planned leader: wait (no DHT reads) for the planned members to join, at most
        the gather window."""
        end = min(time.time() + self.gather_window, rnd.deadline)
        while time.time() < end and len(rnd.followers) + 1 < self._expected(rnd):
            await self._wait(rnd, end - time.time())

    async def _gather(self, rnd: MatchRound) -> None:
        """Wait the gather window, so that peers starting at about the same time see each
        other; when the caller planned ``expected`` members, only until that many declared."""
        end = min(time.time() + self.gather_window, rnd.deadline)
        if rnd.expected <= 1:
            await self._wait(rnd, end - time.time())
            return
        while rnd.role == "candidate" and time.time() < end:
            if len(await self._candidates(rnd)) + 1 >= self._expected(rnd):
                return
            await self._wait(rnd, min(_GATHER_POLL_S, end - time.time()))

    def _expected(self, rnd: MatchRound) -> int:
        """Members planned under the round's key, less those found gone (0: none planned)."""
        if not rnd.expected:
            return 0
        gone = self.liveness.gone
        return max(1, rnd.expected - sum(r.peer_id in gone for r in rnd.planned))

    def _check_missing(self, rnd: MatchRound) -> None:
        """Check (once a round, in the background) the planned members that have not joined."""
        for record in rnd.planned:
            if record.peer_id in rnd.followers or record.peer_id in rnd.checked:
                continue
            rnd.checked.add(record.peer_id)
            self.liveness.check(record).add_done_callback(lambda _: rnd.changed.set())

    def _close(self, rnd: MatchRound) -> GroupInfo:
        rnd.role = "closed"
        followers = rnd.followers.values()
        members = [self.peer.transport.record()] + [f.record for f in followers]
        measured = (
            self.rates.estimates([m.peer_id for m in members], self.peer_id)
            if self.rates is not None
            else None
        )
        agreed = bool(rnd.state) and all(f.state == rnd.state for f in followers)
        group = GroupInfo.create(members, measured, agreed=agreed)
        rnd.closed.set_result(group)
        logger.debug("closed group %s of %d", group.group_id.hex()[:8], len(members))
        return group

    async def _wait(self, rnd: MatchRound, seconds: float) -> None:
        rnd.changed.clear()
        with contextlib.suppress(asyncio.TimeoutError):  # a poll tick, not an error
            await asyncio.wait_for(rnd.changed.wait(), max(0.0, seconds))

    async def _join(
        self, rnd: MatchRound, leader: Declaration, wait: float = 0.0
    ) -> GroupInfo | NoGroup | None:
        """Ask ``leader`` to take us (it may hold the request ``wait`` seconds until it opens
        the round). Returns the group, None (refused: try another), or the reason to give up
        (the leader timed out: it may have counted us)."""
        payload: dict[str, object] = {
            "k": rnd.key,
            "d": rnd.deadline,
            "r": self.peer.transport.record().serialize(),
        }
        if wait > 0:
            payload["w"] = wait
        if rnd.state:
            payload["s"] = rnd.state
        timeout = max(1.0, min(leader.deadline, rnd.deadline) - time.time() + _JOIN_SLACK_S)
        started = time.monotonic()
        try:
            reply = await self.peer.transport.call(
                leader.record, self.rpc_name, payload, timeout=timeout
            )
        except (TransportError, AuthError) as e:
            if time.monotonic() - started >= timeout - 0.5:
                return NoGroup(f"leader {leader.record.peer_id.short} did not answer: {e}")
            if isinstance(e, TransportError) and e.refused:
                self.liveness.refused(leader.record.peer_id)
            logger.debug("leader %s unreachable: %s", leader.record.peer_id.short, e)
            return None
        if reply.get("ok") is not True:
            logger.debug("leader %s refused: %s", leader.record.peer_id.short, reply.get("why"))
            return None
        try:
            return GroupInfo.from_wire(
                reply.get("group"), me=self.peer_id, leader=leader.record.peer_id
            )
        except AveragingError as e:
            return NoGroup(f"leader {leader.record.peer_id.short} sent an invalid group: {e}")

    async def _candidates(self, rnd: MatchRound) -> dict[PeerID, Declaration]:
        """Unexpired, non-busy declarations of other live peers under the round's key."""
        return await self.board.read(rnd.key, self.liveness.gone)

    def _declare(self, rnd: MatchRound, *, busy: bool = False, leading: bool = False) -> None:
        """Store our declaration in the background (tracked, cancelled on close)."""
        size = len(rnd.followers) + 1 if leading else 1
        update, rnd.declared = rnd.declared, rnd.declared + 1
        self.board.declare(
            rnd.key, rnd.deadline, update=update, busy=busy, leading=leading, size=size
        )
