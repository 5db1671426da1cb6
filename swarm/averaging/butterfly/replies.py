"""What a part owner streams back to its senders: the averaged chunks, then a verdict.

Every sender's reply carries the same averaged chunks of the current attempt, written as the
owner encodes them, and ends with a trailer that gives the attempt's :class:`PartOutcome`:
``{"ok": true, "c": [member indices averaged]}``, ``{"retry": true}`` or
``{"ok": false, "why": ...}``. Receivers apply a part only after an ``ok`` trailer.

A chunk goes on the replies of the senders that delivered it, the only ones averaged into it,
and its payload is let go once each of them wrote it (an owner kept every payload of its part
until the round's end: with ``none``, a quarter of the vector in a group of 4). A reply is
matched to its sender, not counted: a dropped sender's writer that woke before it was stopped
must neither get the chunk nor take it from a sender that delivered it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from swarm.averaging.butterfly.outcome import PartOutcome
from swarm.net.streams import ReplyStream


class PartReplies:
    """The replies of one part's owner to its senders, over every attempt.

    Args:
        chunks: how many chunks the part has.
        hold: awaited instead of answering when the owner stays silent (fault injection).
    """

    def __init__(self, chunks: int, hold: Callable[[], Awaitable[None]]):
        self.bytes_sent = 0
        self._chunks = chunks
        self._hold = hold
        self._outcomes: dict[int, asyncio.Future[tuple[PartOutcome, Any]]] = {}
        self._averaged = _Chunks(0)  # the current attempt's
        self._waiting: set[asyncio.Task[Any]] = set()  # replies waiting for their verdict

    def new_attempt(self) -> None:
        """Later writers get the chunks of a new attempt (earlier ones keep theirs)."""
        self._averaged = _Chunks(self._chunks)

    def publish(self, index: int, payload: bytes, readers: Collection[int]) -> None:
        """Chunk ``index`` of the current attempt is averaged and encoded: send it on the
        replies of ``readers``, the senders that delivered it (let go once they wrote it)."""
        self._averaged.publish(index, payload, readers)

    def stop(self) -> None:
        """Writers waiting for chunks of the current attempt stop (they get None)."""
        self._averaged.stop()

    def resolve(self, attempt: int, outcome: PartOutcome, value: Any) -> None:
        """Give ``attempt``'s verdict: the contributors (OK), the reason (FAILED) or None."""
        fut = self._outcome(attempt)
        if not fut.done():
            fut.set_result((outcome, value))

    def start(self, reply: ReplyStream, sender: int) -> asyncio.Task[bool]:
        """Write the current attempt's chunks on ``sender``'s ``reply`` as they come (True: all
        of them; False at the first it did not deliver). The task's failure (the connection
        broke) is raised where :meth:`finish` awaits it."""
        writer = asyncio.create_task(self._write_chunks(reply, self._averaged, sender))
        # a reply whose verdict never came (the round ended, the handler was cancelled) is not
        # awaited: its failure is then retrieved here, not reported as never retrieved
        writer.add_done_callback(_retrieve)
        return writer

    async def finish(
        self, reply: ReplyStream, writer: asyncio.Task[bool] | None, attempt: int
    ) -> None:
        """Wait for ``attempt``'s verdict and end ``reply`` with it (``writer`` None: the owner
        stays silent)."""
        task = asyncio.current_task()
        if task is not None:
            self._waiting.add(task)
        try:
            await self._finish(reply, writer, attempt)
        finally:
            if task is not None:
                self._waiting.discard(task)
            if writer is not None and not writer.done():  # no verdict came: stop writing
                writer.cancel()

    async def close(self, deadline: float) -> None:
        """Unanswered attempts fail, writers stop; replies still ending get until ``deadline``."""
        for fut in self._outcomes.values():
            if not fut.done():
                fut.set_result((PartOutcome.FAILED, "the round ended"))
        self.stop()
        if self._waiting:
            remaining = max(0.0, deadline - time.monotonic())
            _, late = await asyncio.wait(self._waiting, timeout=remaining)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)

    def _outcome(self, attempt: int) -> asyncio.Future[tuple[PartOutcome, Any]]:
        fut = self._outcomes.get(attempt)
        if fut is None:
            fut = self._outcomes[attempt] = asyncio.get_running_loop().create_future()
        return fut

    async def _write_chunks(self, reply: ReplyStream, averaged: _Chunks, sender: int) -> bool:
        for index, chunk in enumerate(averaged.ready):
            # shared by every writer: never cancel it
            payload = averaged.payload(index, sender) if await asyncio.shield(chunk) else None
            if payload is None:  # stopped, or the sender did not deliver the chunk (dropped)
                return False
            await reply.write(payload)
            self.bytes_sent += len(payload)
            averaged.written(index, sender)
        return True

    async def _finish(
        self, reply: ReplyStream, writer: asyncio.Task[bool] | None, attempt: int
    ) -> None:
        outcome, value = await self._outcome(attempt)
        if writer is None:
            await self._hold()
            return
        complete = await writer
        if outcome is PartOutcome.RETRY:
            reply.set_trailer({"retry": True})
        elif outcome is PartOutcome.OK and complete:
            reply.set_trailer({"ok": True, "c": list(value)})
        elif outcome is PartOutcome.OK:
            reply.set_trailer({"ok": False, "why": "the round ended before the part was sent"})
        else:
            reply.set_trailer({"ok": False, "why": str(value)})


class _Chunks:
    """One attempt's averaged chunks, published in order, each held until its readers (the
    senders that delivered it) wrote it."""

    def __init__(self, count: int):
        loop = asyncio.get_running_loop() if count else None
        # True: published; False: the attempt stopped first
        self.ready: list[asyncio.Future[bool]] = [loop.create_future() for _ in range(count)]
        self._payloads: list[bytes | None] = [None] * count
        self._readers: list[set[int]] = [set() for _ in range(count)]

    def publish(self, index: int, payload: bytes, readers: Collection[int]) -> None:
        if readers:
            self._payloads[index], self._readers[index] = payload, set(readers)
        self.ready[index].set_result(True)

    def stop(self) -> None:
        for chunk in self.ready:
            if not chunk.done():
                chunk.set_result(False)

    def payload(self, index: int, sender: int) -> bytes | None:
        """Chunk ``index`` for ``sender``'s reply: None unless it is one of its readers."""
        return self._payloads[index] if sender in self._readers[index] else None

    def written(self, index: int, sender: int) -> None:
        readers = self._readers[index]
        readers.discard(sender)
        if not readers:
            self._payloads[index] = None


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()
