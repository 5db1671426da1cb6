"""Which all-reduce an inbound part stream belongs to: rounds by group id, bounded.

A member may start streaming to us before we heard that its group closed, so a stream for an
unknown group waits (a bounded time) for the round to start here. Finished groups are
remembered, so a late stream hears "over" at once; both kinds are bounded in number.

A repair's streams name the round it repairs (its *parent*). Once that round is settled here
(over, with its own repair if this member planned one), a repair that did not start here never
will: its streams, waiting or later, hear "over" at once instead of after the wait.
"""

from __future__ import annotations

import asyncio
from collections import deque

from swarm.averaging.butterfly.allreduce import AllReduce
from swarm.timeouts import wait_for

UNKNOWN_GROUP_WAIT_S = 5.0  # a member may start streaming before we heard the group closed
RECENT_GROUPS = 64  # finished groups remembered, and groups awaited before they start


class RoundRegistry:
    """The rounds of one averager by group id: started, awaited or finished."""

    def __init__(self) -> None:
        # inbound streams wait on their group's future: set to the round when it starts, to None
        # when it is over; at most RECENT_GROUPS of either kind are kept
        self._rounds: dict[bytes, asyncio.Future[AllReduce | None]] = {}
        self._finished: deque[bytes] = deque()
        self._settled: deque[bytes] = deque(maxlen=RECENT_GROUPS)  # parents whose rounds ended
        self._children: dict[bytes, set[bytes]] = {}  # parent -> groups awaited in its name
        self.closed = False

    def start(self, group_id: bytes, round_: AllReduce) -> None:
        """``round_`` runs now: streams of ``group_id`` (waiting or later) get it."""
        fut = self._future(group_id)
        if fut.done():  # a stream gave up waiting for this group: later ones find it
            fut = self._rounds[group_id] = asyncio.get_running_loop().create_future()
        fut.set_result(round_)

    def end(self, group_id: bytes) -> None:
        """The round of ``group_id`` is over: later streams for it are refused at once."""
        self._rounds[group_id] = fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        self._finished.append(group_id)
        while len(self._finished) > RECENT_GROUPS - 1:
            self._rounds.pop(self._finished.popleft(), None)

    def settle(self, parent: bytes) -> None:
        """The round of ``parent`` and its repair (if any) are over here: repairs of it that
        did not start here never will."""
        self._settled.append(parent)
        for group_id in self._children.pop(parent, ()):
            fut = self._rounds.get(group_id)
            if fut is not None and not fut.done():
                del self._rounds[group_id]
                fut.set_result(None)

    async def find(self, group_id: bytes, parent: bytes | None = None) -> AllReduce | None:
        """The round of ``group_id`` (a repair of ``parent``'s, when given): waits (a bounded
        time) for it to start; None when it is over or never starts here."""
        if self.closed:
            return None
        if group_id not in self._rounds and parent is not None and parent in self._settled:
            return None
        fut = self._future(group_id)
        if parent is not None and not fut.done():
            self._children.setdefault(parent, set()).add(group_id)
        try:
            return await wait_for(asyncio.shield(fut), UNKNOWN_GROUP_WAIT_S)
        except asyncio.TimeoutError:
            if self._rounds.get(group_id) is fut and not fut.done():
                del self._rounds[group_id]
                fut.set_result(None)
            return None
        finally:
            children = self._children.get(parent) if parent is not None else None
            if children is not None:
                children.discard(group_id)
                if not children:
                    del self._children[parent]

    def close(self) -> None:
        """Streams still waiting hear "over"; later ones too; those still read end."""
        self.closed = True
        for fut in self._rounds.values():
            if not fut.done():
                fut.set_result(None)
            elif (round_ := fut.result()) is not None:
                round_.stop_serving()

    def _future(self, group_id: bytes) -> asyncio.Future[AllReduce | None]:
        fut = self._rounds.get(group_id)
        if fut is None:
            awaited = [g for g, f in self._rounds.items() if not f.done()]
            if len(awaited) >= RECENT_GROUPS:  # bounded: streams for unknown groups give up
                self._rounds.pop(awaited[0]).set_result(None)
            fut = self._rounds[group_id] = asyncio.get_running_loop().create_future()
        return fut
