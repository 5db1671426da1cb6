"""The owner's side of one part: reduce the senders' streams, stream the average back.

Every other member streams its compressed values of this part in chunks; each chunk is added
into the accumulator in a worker thread as it arrives (:class:`~swarm.averaging.reducer.
PartReducer`). As soon as every sender delivered chunk ``c`` (or was dropped), chunk ``c`` is
divided by its weight, compressed with the owner's error feedback, and written back on the reply
of every stream while later chunks still arrive. The reply's trailer gives the
:class:`PartOutcome`; receivers apply a part only after an ``ok`` trailer.

A sender that stops is dropped by the :class:`~swarm.averaging.stall.StallPolicy`. A dropped
sender whose chunks were already added *taints* the part: the owner stops, resets the part and
answers ``retry`` to the complete senders, which send again (once).

Reply header: ``{"ok": true}``; trailer: ``{"ok": true, "c": [member indices averaged]}``,
``{"retry": true}`` or ``{"ok": false, "why": ...}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from swarm.averaging.context import RoundContext
from swarm.averaging.outcome import FAILURES, MAX_ATTEMPTS, OwnedPart, PartOutcome
from swarm.averaging.reducer import PartReducer, SenderState
from swarm.averaging.result import Refusal
from swarm.averaging.stall import PartTiming
from swarm.errors import AuthError, AveragingError, CompressionError, TransportError
from swarm.net.streams import InboundStream, ReplyStream

logger = logging.getLogger(__name__)

_TICK_S = 0.2
# a sender that has not started this long into the attempt (or after another sender finished)
# is checked for life: a killed peer is dropped at once instead of after the stall limit
_SUSPECT_AFTER_S = 0.5


class PartOwner:
    """Reduces part ``me`` of a group and streams the average back to its senders.

    Args:
        ctx: the round; this member owns part ``ctx.me``.
        values: this member's values of the part (read-only during the round).
        acc: the part's slice of the staging buffer (receives the average).
        chunks: ``(start, end)`` of every chunk, relative to the part.
        start: the part's offset in the flat vector (for the error feedback).
    """

    def __init__(
        self,
        ctx: RoundContext,
        values: torch.Tensor,
        acc: torch.Tensor,
        chunks: tuple[tuple[int, int], ...],
        start: int,
    ):
        self.ctx = ctx
        self.group, self.me, self.weight = ctx.group, ctx.me, ctx.weight
        self.feedback, self.workers, self.stall = ctx.feedback, ctx.workers, ctx.stall
        self.deadline, self.faults = ctx.deadline, ctx.faults
        self.values, self.start = values, start
        group, me = ctx.group, ctx.me
        senders = [i for i in range(len(group.members)) if i != me and i not in ctx.excluded]
        self.reducer = PartReducer(acc, chunks, senders, ctx.aggregator, ctx.weight_cap)
        self.refusals: list[Refusal] = []
        self.bytes_sent = 0
        self.bytes_received = 0
        self._adding = [0] * len(chunks)  # adds into each chunk submitted and not finished
        self._begun = asyncio.Event()
        self._changed = asyncio.Event()
        self._outcomes: dict[int, asyncio.Future[tuple[PartOutcome, Any]]] = {}
        self._averaged: list[asyncio.Future[bytes | None]] = []  # None: the attempt stopped
        self._readers: dict[int, asyncio.Task[None]] = {}
        self._dropped: set[int] = set()
        self._activity: dict[int, float] = {}
        self._replies: set[asyncio.Task[Any]] = set()
        self._timing = PartTiming(time.monotonic())
        self._start_by: float | None = None  # senders that have not started by then are dropped

    # ---- the part

    async def run(self) -> OwnedPart:
        """Reduce the part until it is settled; never raises for a failed sender."""
        await self.workers.run(self.reducer.begin, self.values, self.weight)
        self.feedback.prepare_owner(self.start, self.start + self.values.numel())
        self._new_attempt()
        self._begun.set()
        reducer = self.reducer
        while True:
            attempt = reducer.attempt
            sent = await self._average_chunks()
            await self.workers.drain()
            contributors = reducer.contributors()
            can_retry = attempt + 1 < MAX_ATTEMPTS and time.monotonic() < self.deadline
            if reducer.tainted and can_retry and contributors:
                logger.debug("part %d tainted by %s: retrying", self.me, reducer.failed())
                self._stop_chunks()
                for s, e in reducer.chunks[:sent]:  # nobody applies what went out: no residual
                    self.feedback.forget_owned(s, e - s)
                await self.workers.run(reducer.restart)
                self._new_attempt()
                self._resolve(attempt, PartOutcome.RETRY, None)
                continue
            if reducer.tainted or not contributors or sent < len(reducer.chunks):
                self._stop_chunks()
                why = "a sender failed twice" if reducer.tainted else "no sender finished"
                if not reducer.tainted and contributors:
                    why = "the averaged part could not be encoded"
                self._resolve(attempt, PartOutcome.FAILED, why)
                return OwnedPart(None, f"own part {self.me}: {why}", self._report())
            averaged = tuple(sorted((self.me, *contributors)))
            self._resolve(attempt, PartOutcome.OK, averaged)
            failed = reducer.failed()
            note = f"part {self.me}: dropped {list(failed)}" if failed else ""
            return OwnedPart(averaged, note, self._report())

    def _report(self) -> tuple[Refusal, ...]:
        """Every sender this part refused, dropped, clipped or capped, logged once each."""
        peer = self.group.members
        found = list(self.refusals)
        for s, scale in sorted(self.reducer.clipped.items()):
            found.append(
                Refusal(peer[s].peer_id, "clipped", self.me, f"offset scaled by {scale:.2g}")
            )
        for s, claimed in sorted(self.reducer.capped.items()):
            found.append(
                Refusal(peer[s].peer_id, "weight-capped", self.me, f"claimed weight {claimed:.3g}")
            )
        for r in found:
            logger.warning("all-reduce %s: %s", self.group.group_id.hex()[:8], r)
        return tuple(found)

    async def close(self) -> None:
        """End the part: unanswered replies fail, reply writers stop, finished replies close."""
        for fut in self._outcomes.values():
            if not fut.done():
                fut.set_result((PartOutcome.FAILED, "the round ended"))
        self._stop_chunks()
        if self._replies:
            remaining = max(0.0, self.deadline - time.monotonic())
            _, late = await asyncio.wait(self._replies, timeout=remaining)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)

    def expect_by(self, when: float) -> None:
        """Drop senders that have not started by ``when`` even if nobody sent anything (this
        member's other streams are over: nothing else will give the stall policy a rate)."""
        self._start_by = when
        self._changed.set()

    def _new_attempt(self) -> None:
        self._timing = PartTiming(time.monotonic())
        loop = asyncio.get_running_loop()
        self._averaged = [loop.create_future() for _ in self.reducer.chunks]

    def _stop_chunks(self) -> None:
        """Reply writers waiting for averaged chunks of this attempt stop (they get None)."""
        for chunk in self._averaged:
            if not chunk.done():
                chunk.set_result(None)

    def _outcome(self, attempt: int) -> asyncio.Future[tuple[PartOutcome, Any]]:
        fut = self._outcomes.get(attempt)
        if fut is None:
            fut = self._outcomes[attempt] = asyncio.get_running_loop().create_future()
        return fut

    def _resolve(self, attempt: int, outcome: PartOutcome, value: Any) -> None:
        fut = self._outcome(attempt)
        if not fut.done():
            fut.set_result((outcome, value))

    async def _average_chunks(self) -> int:
        """Average and encode chunks in order as every sender delivers them, until the part is
        settled; returns how many went out (all of them, unless tainted or an encoding failed)."""
        reducer = self.reducer
        sent, n = 0, len(reducer.chunks)
        while True:
            self._changed.clear()
            self._watchdog()
            while sent < n and not reducer.tainted and self._chunk_ready(sent):
                total = reducer.chunk_total(sent)
                try:
                    payload = await self.workers.run(self._finish_chunk, sent, total)
                except CompressionError as e:
                    logger.warning("part %d: cannot encode the average: %s", self.me, e)
                    return sent
                self._averaged[sent].set_result(payload)
                sent += 1
            if reducer.settled() and (reducer.tainted or sent == n):
                return sent
            if reducer.settled() and not reducer.contributors():
                return sent  # every sender failed before sending: nothing to average
            with contextlib.suppress(asyncio.TimeoutError):  # a watchdog tick
                await asyncio.wait_for(self._changed.wait(), _TICK_S)

    def _added(self, index: int) -> None:
        self._adding[index] -= 1
        self._changed.set()

    def _chunk_ready(self, index: int) -> bool:
        return self._adding[index] == 0 and self.reducer.chunk_ready(index)

    def _finish_chunk(self, index: int, total: float) -> bytes:
        values = self.reducer.finish_chunk(index, total)
        self.faults.averaged(values)
        payload = self.feedback.encode_owned(values, self.reducer.chunks[index][0])
        return self.faults.averaged_payload(payload)

    def _watchdog(self) -> None:
        """Drop senders that stalled (:class:`StallPolicy`), or all live ones at the deadline."""
        now = time.monotonic()
        reducer = self.reducer
        streaming = {
            s: self._activity.get(s, now)
            for s in reducer.expected
            if reducer.state(s) is SenderState.STREAMING
        }
        pending = [s for s in reducer.expected if reducer.state(s) is SenderState.PENDING]
        if pending and (self._timing.completions or now - self._timing.start > _SUSPECT_AFTER_S):
            for s in pending:
                self.ctx.suspect(s)
        if now >= self.deadline:
            verdicts = [(s, "all-reduce deadline") for s in (*streaming, *pending)]
        else:
            verdicts = [
                (s, "its address refuses connections") for s in pending if s in self.ctx.gone
            ]
            verdicts = verdicts or self.stall.stalled(now, self._timing, streaming, pending)
            if self._start_by is not None and now >= self._start_by and not verdicts:
                verdicts = [(s, "never started; the rest of the round is over") for s in pending]
        for sender, why in verdicts:
            self._drop(sender, why)

    def _drop(self, sender: int, why: str) -> None:
        logger.info(
            "all-reduce %s: dropping %s from part %d: %s",
            self.group.group_id.hex()[:8],
            self.group.members[sender].peer_id.short,
            self.me,
            why,
        )
        self.reducer.fail(sender)
        self._dropped.add(sender)
        self.refusals.append(Refusal(self.group.members[sender].peer_id, "dropped", self.me, why))
        reader = self._readers.get(sender)
        if reader is not None:
            reader.cancel()
        self._changed.set()

    # ---- one sender's stream

    async def serve(
        self, request: InboundStream, reply: ReplyStream, sender: int, header: dict[str, Any]
    ) -> None:
        """Serve one sender's stream for this part (called by the averager's route).

        Raises:
            TransportError / AuthError: the stream is refused or failed (the sender is dropped).
        """
        reducer = self.reducer
        attempt, weight = header.get("a"), header.get("w")
        if header.get("p") != self.me or type(attempt) is not int or attempt != reducer.attempt:
            raise TransportError(f"wrong part or attempt {attempt}", status=409)
        await self._begun.wait()
        try:
            reducer.accept(sender, weight)  # type: ignore[arg-type]
        except AveragingError as e:
            peer_id = self.group.members[sender].peer_id
            self.refusals.append(Refusal(peer_id, "refused", self.me, str(e)[:200]))
            raise TransportError(str(e), status=409) from e
        self._activity[sender] = time.monotonic()
        reader = asyncio.create_task(self._consume(request, sender))
        self._readers[sender] = reader
        writer: asyncio.Task[bool] | None = None
        if not self.faults.owner_silent:
            await reply.prepare({"ok": True})
            writer = asyncio.create_task(self._write_chunks(reply, self._averaged))
        try:
            await reader
            reducer.complete(sender)
        except asyncio.CancelledError:
            await _cancel(writer)
            if sender in self._dropped and reader.cancelled():
                raise TransportError("dropped: stopped sending", status=408) from None
            reducer.fail(sender)
            self._changed.set()
            raise
        except FAILURES as e:
            await _cancel(writer)
            logger.info("part %d: stream from member %d failed: %s", self.me, sender, e)
            peer_id = self.group.members[sender].peer_id
            self.refusals.append(Refusal(peer_id, "refused", self.me, str(e)[:200]))
            reducer.fail(sender)
            self._changed.set()
            if isinstance(e, (AuthError, TransportError)):
                raise
            raise TransportError(f"refused: {e}", status=400) from e
        finally:
            self._readers.pop(sender, None)
        self._timing.completed(time.monotonic())
        self._changed.set()
        task = asyncio.current_task()
        if task is not None:
            self._replies.add(task)
        try:
            await self._finish_reply(reply, writer, attempt)
        finally:
            if task is not None:
                self._replies.discard(task)

    async def _consume(self, request: InboundStream, sender: int) -> None:
        reducer = self.reducer
        loop = asyncio.get_running_loop()
        async for payload in request:
            index = reducer.next_index(sender)
            self.bytes_received += len(payload)
            self._timing.received(time.monotonic(), len(payload))
            # counted before the add starts: a sender dropped (its task cancelled) while the worker
            # thread adds its chunk must taint the part, since the add completes regardless
            reducer.chunk_added(sender)
            self._adding[index] += 1
            cf = self.workers.submit(reducer.add_chunk, sender, index, payload)
            # counted down when the add finishes, also if this task is cancelled meanwhile
            cf.add_done_callback(functools.partial(_call_soon, loop, self._added, index))
            await asyncio.wrap_future(cf)
            self._activity[sender] = self._timing.last_byte = time.monotonic()

    async def _write_chunks(
        self, reply: ReplyStream, averaged: list[asyncio.Future[bytes | None]]
    ) -> bool:
        """Write the averaged chunks of one attempt as they come; False when it stopped."""
        for chunk in averaged:
            payload = await asyncio.shield(chunk)  # shared by every writer: never cancel it
            if payload is None:
                return False
            await reply.write(payload)
            self.bytes_sent += len(payload)
        return True

    async def _finish_reply(
        self, reply: ReplyStream, writer: asyncio.Task[bool] | None, attempt: int
    ) -> None:
        outcome, value = await self._outcome(attempt)
        if writer is None:  # a silent owner (fault injection) never answers
            await self.faults.hold()
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


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """For a worker thread's done callback: ``fn(*args)`` on the loop (the future is dropped)."""
    loop.call_soon_threadsafe(fn, *args[:-1])


async def _cancel(task: asyncio.Task[Any] | None) -> None:
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
