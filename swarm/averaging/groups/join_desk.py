"""A leader's side of matchmaking: the ``join`` RPC, and how long to wait for planned members.

A follower's join is answered when the leader's group closes (or cannot form). Each planned
member's lateness (seconds after the round started) is noted, and a leader of a regular round
waits for planned members twice the latest recent lateness plus a slack, at most what the
caller allows (:meth:`JoinDesk.patience`): a member that misses a round then costs little.

A planned member may ask before its leader opened the round (its plan was ready first, or the
leader's last round is still landing): its request waits for the round to open, as long as the
member said it would wait (``w``: what is left of its direct try, see
:meth:`Matchmaker._join_planned`), at most :data:`HOLD_EARLY_S`, one request per sender and
:data:`MAX_HELD` at once; a malformed request is answered at once. Turned away, it asked again
one round trip later, and over a slow link that came after a short patience had closed the
group without it: the member then sat the round out alone.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from swarm.averaging.groups.group import MAX_STATE_BYTES
from swarm.averaging.groups.match_round import Follower, MatchRound
from swarm.errors import SwarmError
from swarm.identity import PeerID
from swarm.net.record import PeerRecord
from swarm.net.streams import RemotePeer
from swarm.protocols import Peer

# Patience adapts to how late planned members joined in recent rounds: twice the latest of the
# last LAG_HISTORY arrivals plus PATIENCE_SLACK_S, once LAG_SAMPLES were seen.
LAG_HISTORY = 64
LAG_SAMPLES = 8
PATIENCE_SLACK_S = 0.2
# A join for a key this peer is not looking for waits this long for a round under it to open;
# one per sender and at most MAX_HELD at once (any authenticated peer can ask), others are
# turned away.
HOLD_EARLY_S = 1.0
MAX_HELD = 32
MAX_KEY_CHARS = 256


class JoinDesk:
    """Serves the join RPC for this peer's matchmaking round in progress.

    Args:
        peer: the started peer (its run id).
        target_group_size: a group takes no more members than this.
        declare: re-declares the round as a leading one (with its new size).
    """

    def __init__(
        self,
        peer: Peer,
        target_group_size: int,
        declare: Callable[..., None],
    ):
        self.peer = peer
        self.target_group_size = target_group_size
        self.declare = declare
        self.round: MatchRound | None = None  # the round in progress
        self.last: MatchRound | None = None  # the previous round (late joiners still count)
        # seconds after a round's start that planned members joined us, latest rounds
        self.lags: deque[float] = deque(maxlen=LAG_HISTORY)
        self._opened: asyncio.Future[None] | None = None  # resolved when a round opens
        self._holding: set[PeerID] = set()  # senders whose join waits for its round to open

    def patience(self, most: float) -> float:
        """``most`` until enough arrivals were seen, then twice the latest recent arrival (plus
        a slack), at most ``most``."""
        if len(self.lags) < LAG_SAMPLES:
            return most
        return min(most, 2 * max(self.lags) + PATIENCE_SLACK_S)

    @property
    def held(self) -> int:
        """Join requests waiting now for their round to open here."""
        return len(self._holding)

    def open(self, rnd: MatchRound) -> None:
        """``rnd`` is this peer's round now: joins waiting for its key go on."""
        self.round = rnd
        if self._opened is not None and not self._opened.done():
            self._opened.set_result(None)
        self._opened = None

    def end(self, rnd: MatchRound) -> None:
        """``rnd`` is over (late joiners for it still count, see :meth:`_arrived`)."""
        self.round, self.last = None, rnd

    async def rpc_join(self, sender: RemotePeer, payload: dict[str, Any]) -> dict[str, Any]:
        """A follower asks to join; answered when this peer's group closes (or cannot form)."""
        key = payload.get("k")
        self._arrived(sender.peer_id, key)
        follower = self._follower(sender, payload)
        if isinstance(follower, str):
            return {"ok": False, "why": follower}  # malformed: answered at once, never held
        rnd = self.round
        if rnd is None or key != rnd.key:
            rnd = await self._until_open(sender.peer_id, key, payload.get("w", 0.0))
        if rnd is None:
            return {"ok": False, "why": "not looking for this key"}
        if rnd.role in ("joining", "closed"):
            return {"ok": False, "why": "busy"}
        if len(rnd.followers) + 1 >= self.target_group_size:
            return {"ok": False, "why": "full"}
        rnd.followers[sender.peer_id] = follower
        rnd.role = "leader"
        rnd.changed.set()
        self.declare(rnd, leading=True)  # with the new size, for leaders that may merge
        try:
            group = await asyncio.shield(rnd.closed)
        except asyncio.CancelledError:
            if not rnd.closed.done():  # the follower hung up before we closed: forget it
                rnd.followers.pop(sender.peer_id, None)
                rnd.changed.set()
            raise
        if group is None or sender.peer_id not in group.peer_ids:
            return {"ok": False, "why": "no group formed"}
        return {"ok": True, "group": group.to_wire()}

    def _follower(self, sender: RemotePeer, payload: dict[str, Any]) -> Follower | str:
        """What the join says of its sender, or why it is refused."""
        deadline, raw = payload.get("d"), payload.get("r")
        if not isinstance(deadline, float) or not math.isfinite(deadline):
            return "bad deadline"
        if not isinstance(raw, bytes):
            return "bad record"
        try:
            record = PeerRecord.parse(raw)
        except SwarmError as e:
            return f"bad record: {e}"
        if record.peer_id != sender.peer_id or record.run_id != self.peer.run_id:
            return "record does not match the sender"
        if deadline <= time.time():
            return "deadline passed"
        state = payload.get("s", b"")
        if not isinstance(state, bytes) or len(state) > MAX_STATE_BYTES:
            return "bad state digest"
        return Follower(record, deadline, state)

    async def _until_open(self, sender: PeerID, key: Any, wait: Any) -> MatchRound | None:
        """This peer's round under ``key`` once it opens within ``wait`` seconds (the
        sender's word, at most :data:`HOLD_EARLY_S`); None if it does not, or when the sender
        will not wait, has a join held already, or :data:`MAX_HELD` are."""
        seconds = min(_seconds(wait), HOLD_EARLY_S)
        if (
            seconds <= 0
            or not isinstance(key, str)
            or len(key) > MAX_KEY_CHARS
            or sender in self._holding
            or len(self._holding) >= MAX_HELD
        ):
            return None
        end = time.monotonic() + seconds
        self._holding.add(sender)
        try:
            while (rnd := self.round) is None or rnd.key != key:
                left = end - time.monotonic()
                if left <= 0:
                    return None
                if self._opened is None:
                    self._opened = asyncio.get_running_loop().create_future()
                await asyncio.wait((self._opened,), timeout=left)  # (never cancels it)
        finally:
            self._holding.discard(sender)
        self._arrived(sender, key)  # on time for the round it waited for
        return rnd

    def _arrived(self, peer_id: PeerID, key: Any) -> None:
        """Note how late a planned member asked to join (this round's, or the last one's once
        it is over: a member too late for the patience must still count)."""
        for rnd in (self.round, self.last):
            if rnd is None or key != rnd.key:
                continue
            if peer_id not in rnd.arrived and any(r.peer_id == peer_id for r in rnd.planned):
                self.lags.append(max(0.0, time.time() - rnd.started))
                rnd.arrived.add(peer_id)
            return


def _seconds(value: Any) -> float:
    """A duration from the wire: a finite non-negative number, anything else 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return 0.0
    return max(0.0, float(value))
