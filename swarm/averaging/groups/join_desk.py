"""A leader's side of matchmaking: the ``join`` RPC, and how long to wait for planned members.

A follower's join is answered when the leader's group closes (or cannot form). Each planned
member's lateness (seconds after the round started) is noted, and a leader of a regular round
waits for planned members twice the latest recent lateness plus a slack, at most what the
caller allows (:meth:`JoinDesk.patience`): a member that misses a round then costs little.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from swarm.averaging.groups.group import MAX_STATE_BYTES, is_order
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

    def patience(self, most: float) -> float:
        """``most`` until enough arrivals were seen, then twice the latest recent arrival (plus
        a slack), at most ``most``."""
        if len(self.lags) < LAG_SAMPLES:
            return most
        return min(most, 2 * max(self.lags) + PATIENCE_SLACK_S)

    async def rpc_join(self, sender: RemotePeer, payload: dict[str, Any]) -> dict[str, Any]:
        """A follower asks to join; answered when this peer's group closes (or cannot form)."""
        rnd = self.round
        self._arrived(sender.peer_id, payload.get("k"))
        if rnd is None or payload.get("k") != rnd.key:
            return {"ok": False, "why": "not looking for this key"}
        if rnd.role in ("joining", "closed"):
            return {"ok": False, "why": "busy"}
        if len(rnd.followers) + 1 >= self.target_group_size:
            return {"ok": False, "why": "full"}
        deadline, raw = payload.get("d"), payload.get("r")
        if not isinstance(deadline, float) or not math.isfinite(deadline):
            return {"ok": False, "why": "bad deadline"}
        if not isinstance(raw, bytes):
            return {"ok": False, "why": "bad record"}
        try:
            record = PeerRecord.parse(raw)
        except SwarmError as e:
            return {"ok": False, "why": f"bad record: {e}"}
        if record.peer_id != sender.peer_id or record.run_id != self.peer.run_id:
            return {"ok": False, "why": "record does not match the sender"}
        if deadline <= time.time():
            return {"ok": False, "why": "deadline passed"}
        order = payload.get("o", 0)
        if not is_order(order):
            return {"ok": False, "why": "bad order"}
        state = payload.get("s", b"")
        if not isinstance(state, bytes) or len(state) > MAX_STATE_BYTES:
            return {"ok": False, "why": "bad state digest"}
        rnd.followers[sender.peer_id] = Follower(record, deadline, order, state)
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
