"""Matchmaking declarations in the DHT: this peer's, stored in the background, and others'.

A declaration (:class:`~swarm.averaging.groups.group.Declaration`) says "I look for a group under
this key until this deadline" (or that this peer leads a group of some size, or is busy). It
expires at the round's deadline; each update of one round expires a little later than the last,
so that it replaces it on every node (a later expiration wins per subkey).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Container
from typing import Any

from swarm.averaging.groups.group import Declaration
from swarm.errors import AveragingError, DHTError
from swarm.identity import PeerID
from swarm.protocols import Peer

logger = logging.getLogger(__name__)

UPDATE_BUMP_S = 1e-3  # each update of a round's declaration expires this much after the last


class DeclarationBoard:
    """Stores this peer's declarations (tracked tasks, cancelled on close) and reads others'."""

    def __init__(self, peer: Peer):
        self.peer = peer
        self._tasks: set[asyncio.Task[Any]] = set()
        # per key, the newest declaration not yet stored (with its expiration): updates that
        # come while a store of the key runs wait for it, and only the newest is stored then
        self._pending: dict[str, tuple[Declaration, float]] = {}
        self._storing: set[str] = set()  # keys with a store task running

    def declare(
        self,
        key: str,
        deadline: float,
        *,
        update: int,
        busy: bool = False,
        leading: bool = False,
        size: int = 1,
    ) -> None:
        """Store our declaration under ``key`` in the background; ``update`` counts the
        declarations of this round before it (it sets the later expiration)."""
        decl = Declaration(self.peer.transport.record(), deadline, busy, leading, size)
        self._pending[key] = (decl, deadline + update * UPDATE_BUMP_S)
        if key in self._storing:
            return
        self._storing.add(key)
        task = asyncio.create_task(self._store(key), name="swarm-mm-declare")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _store(self, key: str) -> None:
        try:
            while (newest := self._pending.pop(key, None)) is not None:
                decl, expiration = newest
                if expiration <= time.time():  # the round is over: nothing left to declare
                    continue
                try:
                    stored = await self.peer.dht.store(key, decl.serialize(), expiration, subkey="")
                except DHTError as e:
                    logger.warning("matchmaking declaration failed: %s", e)
                    continue
                if stored == 0:
                    logger.debug("no DHT node stored our matchmaking declaration")
        finally:
            self._storing.discard(key)

    async def read(self, key: str, gone: Container[PeerID]) -> dict[PeerID, Declaration]:
        """Unexpired, non-busy declarations of other peers of this run under ``key``, less
        those of peers known to be ``gone`` (a killed peer's declaration outlives it)."""
        try:
            entries = await self.peer.dht.get(key)
        except DHTError as e:
            logger.debug("matchmaking lookup failed: %s", e)
            return {}
        now = time.time()
        view: dict[PeerID, Declaration] = {}
        for (owner, _subkey), entry in entries.items():
            if owner == self.peer.peer_id or owner in gone:
                continue
            try:
                decl = Declaration.parse(entry.value, owner)
            except AveragingError as e:
                logger.debug("ignoring a declaration of %s: %s", owner.short, e)
                continue
            if decl.busy or decl.deadline <= now or decl.record.run_id != self.peer.run_id:
                continue
            view[owner] = decl
        return view

    async def close(self) -> None:
        self._pending.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
