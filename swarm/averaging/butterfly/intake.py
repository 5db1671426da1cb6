"""What a part owner receives: every sender's stream read into the reducer, stalled ones dropped.

Each chunk a sender streams is added into the part's accumulator in a worker thread as it arrives
(:class:`~swarm.averaging.butterfly.reducer.PartReducer`); a chunk is ready to average once every
sender delivered it and no add into it is still running. The
:class:`~swarm.averaging.butterfly.stall.StallPolicy` decides when a silent sender is dropped; a
pending sender is checked for life first, so a killed peer is dropped at once instead of after the
stall limit.

A sender may run at most :data:`WINDOW_CHUNKS` chunks ahead of the chunks the owner has
averaged: its stream is not read further until the others catch up (TCP holds it back). Under
CenteredClip every chunk in flight holds a row per sender, so without the window a sender
ahead of a slow one filled rows for the whole part (the vector's size, summed over a member's
part: as much again as the vector itself).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from swarm.averaging.butterfly.context import RoundContext
from swarm.averaging.butterfly.outcome import FAILURES
from swarm.averaging.butterfly.reducer import PartReducer, SenderState
from swarm.averaging.butterfly.stall import PartTiming, StreamTiming
from swarm.averaging.result import Refusal, RefusalAction
from swarm.errors import GONE, AuthError, AveragingError, TransportError
from swarm.net.streams import InboundStream
from swarm.timeouts import wait_for

logger = logging.getLogger(__name__)

# a sender that has not started this long into the attempt (or after another sender finished)
# is checked for life: a killed peer is dropped at once instead of after the stall limit
_SUSPECT_AFTER_S = 0.5
WINDOW_CHUNKS = 4  # how far a sender may run ahead of the chunks averaged
_WINDOW_TICK_S = 0.2  # a held reader checks its window at least this often


class PartIntake:
    """The senders' streams of part ``ctx.me``, as its owner reads them into ``reducer``.

    :attr:`changed` is set whenever a chunk may have become ready or a sender settled.
    """

    def __init__(self, ctx: RoundContext, reducer: PartReducer):
        self.ctx, self.reducer = ctx, reducer
        self.refusals: list[Refusal] = []
        self.bytes_received = 0
        self.changed = asyncio.Event()
        self._adding = [0] * len(reducer.chunks)  # adds into each chunk submitted, not finished
        self._readers: dict[int, asyncio.Task[None]] = {}
        self._dropped: set[int] = set()
        self._activity: dict[int, float] = {}
        self._timing = PartTiming(time.monotonic())
        self._start_by: float | None = None  # senders that have not started by then are dropped
        self._streams: dict[int, StreamTiming] = {}  # this attempt's streams, by sender
        self.averaged = 0  # chunks of this attempt averaged so far (in order)
        self._moved = asyncio.Event()  # the window moved or the part was tainted
        self._held: set[int] = set()  # senders waiting for the window (not silent)
        self._stopped = False  # the part is over here: streams still read end at once

    def new_attempt(self) -> None:
        self._timing = PartTiming(time.monotonic())
        self._streams = {}
        self.chunk_averaged(0)

    def chunk_averaged(self, averaged: int) -> None:
        """The owner averaged the first ``averaged`` chunks: senders held back may go on."""
        self.averaged = averaged
        self._moved.set()

    def completed_streams(self) -> dict[int, StreamTiming]:
        """The current attempt's streams that were read to their end, by sender."""
        return {s: t for s, t in self._streams.items() if t.complete}

    def chunk_ready(self, index: int) -> bool:
        """Every sender delivered chunk ``index`` (or was dropped) and its adds are done."""
        return self._adding[index] == 0 and self.reducer.chunk_ready(index)

    def expect_by(self, when: float) -> None:
        """Drop senders that have not started by ``when`` even if nobody sent anything (this
        member's other streams are over: nothing else will give the stall policy a rate)."""
        self._start_by = when
        self.changed.set()

    def accept(self, sender: int, weight: object) -> None:
        """Take ``sender``'s stream of the current attempt, with the weight it claims.

        Raises:
            TransportError: refused (status 409): a bad weight, or a second stream.
        """
        try:
            self.reducer.accept(sender, weight)  # type: ignore[arg-type]
        except AveragingError as e:
            self._record(sender, RefusalAction.REFUSED, str(e))
            raise TransportError(str(e), status=409) from e
        self._activity[sender] = time.monotonic()

    async def receive(self, request: InboundStream, sender: int) -> None:
        """Read an accepted sender's stream into the reducer, to its end.

        Raises:
            TransportError / AuthError: the stream failed (the sender is dropped).
        """
        reducer = self.reducer
        if self._stopped:
            self.fail(sender)
            raise TransportError("the round is over at its owner", status=GONE)
        reader = asyncio.create_task(self._consume(request, sender))
        self._readers[sender] = reader
        try:
            await reader
            reducer.complete(sender)
            if sender in self._streams:
                self._streams[sender].complete = True
        except asyncio.CancelledError:
            if sender in self._dropped and reader.cancelled():
                # this owner ended the stream (its stall policy): not a refusal (a slow honest
                # link meets it too); the drop itself is logged at INFO and reported
                raise TransportError("dropped: stopped sending", status=GONE) from None
            self.fail(sender)
            if self._stopped and reader.cancelled():
                raise TransportError("the round is over at its owner", status=GONE) from None
            # the server cancels the handler of a connection that closed: the sender died,
            # hung up or gave up, which says nothing of what it sent (dropped, as a stall)
            self._record(sender, RefusalAction.DROPPED, "its connection closed mid-stream")
            raise
        except FAILURES as e:
            logger.info("part %d: stream from member %d failed: %s", self.ctx.me, sender, e)
            # a connection that broke says nothing of what came through it: the sender died,
            # hung up or gave up (dropped, like a stall); bytes that failed a check are refused
            lost = isinstance(e, TransportError) and e.lost
            self._record(sender, RefusalAction.DROPPED if lost else RefusalAction.REFUSED, str(e))
            self.fail(sender)
            if isinstance(e, (AuthError, TransportError)):
                raise
            raise TransportError(f"refused: {e}", status=400) from e
        finally:
            self._readers.pop(sender, None)
        self._timing.completed(time.monotonic())
        self.changed.set()

    def stop(self) -> None:
        """The part is over here (its round ended or was called off): streams still read end
        now, refused with status 410, instead of feeding a reducer nobody reads (or a worker
        pool that is shutting down)."""
        self._stopped = True
        for reader in self._readers.values():
            reader.cancel()

    def fail(self, sender: int) -> None:
        """``sender``'s stream ended before it was read to its end (a complete one stays)."""
        self.reducer.fail(sender)
        self._changed()

    def _changed(self) -> None:
        self.changed.set()
        self._moved.set()  # a failure may taint the part: held senders then read on

    def watch(self) -> None:
        """Drop the senders the stall policy gives up on; check slow starters' life."""
        ctx, reducer, now = self.ctx, self.reducer, time.monotonic()
        streaming = {
            s: now if s in self._held else self._activity.get(s, now)
            for s in reducer.expected
            if reducer.state(s) is SenderState.STREAMING
        }
        pending = [s for s in reducer.expected if reducer.state(s) is SenderState.PENDING]
        if pending and (self._timing.completions or now - self._timing.start > _SUSPECT_AFTER_S):
            for s in pending:
                ctx.suspect(s)
        drops = ctx.stall.drops(
            now,
            self._timing,
            streaming,
            pending,
            deadline=ctx.deadline,
            gone=ctx.gone,
            start_by=self._start_by,
        )
        for sender, why in drops:
            self._drop(sender, why)

    def _record(self, sender: int, action: RefusalAction, why: str) -> None:
        peer_id = self.ctx.group.members[sender].peer_id
        self.refusals.append(Refusal(peer_id, action, self.ctx.me, why[:200]))

    def _drop(self, sender: int, why: str) -> None:
        group = self.ctx.group
        peer_id = group.members[sender].peer_id
        logger.info(
            "all-reduce %s: dropping %s from part %d: %s",
            group.group_id.hex()[:8],
            peer_id.short,
            self.ctx.me,
            why,
        )
        self.reducer.fail(sender)
        self._dropped.add(sender)
        self.refusals.append(Refusal(peer_id, RefusalAction.DROPPED, self.ctx.me, why))
        reader = self._readers.get(sender)
        if reader is not None:
            reader.cancel()
        self._changed()

    async def _within_window(self, sender: int, stream: StreamTiming) -> None:
        """Wait until ``sender``'s next chunk is within :data:`WINDOW_CHUNKS` of the chunks
        averaged (at once when the part is tainted: the attempt is over for every sender). The
        wait is not the sender's: its stream's measured rate leaves it out."""
        reducer = self.reducer
        began = None
        while (
            not reducer.tainted
            and not self._stopped
            and reducer.chunks_from(sender) >= self.averaged + WINDOW_CHUNKS
        ):
            began = time.monotonic() if began is None else began
            self._held.add(sender)
            self._moved.clear()
            try:
                await wait_for(self._moved.wait(), _WINDOW_TICK_S)
            except asyncio.TimeoutError:
                pass
            finally:
                self._held.discard(sender)
        if began is None:
            return
        now = self._activity[sender] = time.monotonic()  # held is not silent
        stream.held(now - began)

    async def _consume(self, request: InboundStream, sender: int) -> None:
        reducer = self.reducer
        loop = asyncio.get_running_loop()
        stream = self._streams[sender] = StreamTiming()
        chunks = aiter(request)
        while True:
            await self._within_window(sender, stream)
            try:
                payload = await anext(chunks)
            except StopAsyncIteration:
                return
            if self._stopped or sender in self._dropped:
                # stopped even where the reader's cancellation was lost on the way (as
                # asyncio.wait_for lost them before Python 3.12: see swarm.timeouts)
                raise asyncio.CancelledError
            index = reducer.next_index(sender)
            self.bytes_received += len(payload)
            now = time.monotonic()
            self._timing.received(now, len(payload))
            stream.received(now, len(payload))
            # counted before the add starts: a sender dropped (its task cancelled) while the worker
            # thread adds its chunk must taint the part, since the add completes regardless
            reducer.chunk_added(sender)
            self._adding[index] += 1
            cf = self.ctx.workers.submit(reducer.add_chunk, sender, index, payload)
            # counted down when the add finishes, also if this task is cancelled meanwhile
            cf.add_done_callback(functools.partial(_call_soon, loop, self._added, sender, index))
            await asyncio.wrap_future(cf)
            self._activity[sender] = self._timing.last_byte = time.monotonic()

    def _added(self, sender: int, index: int, add: concurrent.futures.Future[Any]) -> None:
        if add.cancelled() or add.exception() is not None:
            # failed in the same step that makes the chunk ready: its row (a refused payload,
            # half decoded) must never be averaged, as it was when the reader failed it later
            self.reducer.fail(sender)
        self._adding[index] -= 1
        self._changed()


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """For a worker thread's done callback: ``fn(*args)`` on the loop (args end with the
    finished future)."""
    loop.call_soon_threadsafe(fn, *args)
