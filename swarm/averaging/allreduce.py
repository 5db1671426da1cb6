"""Butterfly all-reduce of one group: reduce-scatter, then all-gather, on the same streams.

Member ``i`` opens one stream per part owner ``j`` (route ``{name}.part``) and streams its
compressed values of part ``j`` in chunks; owner ``j`` adds each chunk into its accumulator as it
arrives (:class:`~swarm.averaging.reducer.PartReducer`). As soon as every sender has delivered
chunk ``c`` (or been dropped), the owner divides it by its total weight, compresses it (with its
own error feedback) and writes it back on the reply of each stream, while later chunks still
arrive: the all-gather is pipelined with the reduce-scatter chunk by chunk, so no link idles
while an owner waits for the last bytes of its part. The reply's trailer (sent with its END
frame) gives the outcome; receivers stage averaged chunks and apply a part only after an ``ok``
trailer. All of a member's streams are in flight at once; encoding, decoding and reduction run in
a thread pool.

Failures:

- a sender that stops sending is dropped after a stall timeout derived from the rate measured on
  this part (``stall_factor`` times the time a chunk takes at that rate, at least
  ``stall_timeout_min``); a stream that fails authentication or carries a malformed chunk is
  dropped at once;
- a dropped sender whose chunks were already added *taints* the part: the owner stops sending
  averaged chunks, resets the part and answers ``retry`` to the complete senders, which discard
  what they staged and send the part again (once);
- a part whose owner fails, times out or answers ``ok: false`` keeps this member's own values;
  averaged values land in a staging buffer and are applied only for parts received completely.

Stream header (request): ``{"g": group id, "p": part, "a": attempt, "w": weight}``.
Reply header: ``{"ok": true}`` (the stream was accepted), then the averaged chunks; reply trailer:
``{"ok": true, "c": [member indices averaged]}``, ``{"retry": true}`` or ``{"ok": false, "why":
...}``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from swarm.averaging.feedback import FlatFeedback
from swarm.averaging.group import GroupInfo
from swarm.averaging.plan import PartPlan
from swarm.averaging.reducer import PartReducer, SenderState
from swarm.averaging.result import Fault
from swarm.compression import decode_into, read_header
from swarm.errors import AuthError, AveragingError, CompressionError, TransportError
from swarm.net.streams import InboundStream, ReplyStream

logger = logging.getLogger(__name__)

T = TypeVar("T")
MAX_ATTEMPTS = 2  # the first try, and one retry after a tainted part
_TICK_S = 0.2
_FAULT_SLEEP_S = 3600.0
_FAILURES = (AuthError, TransportError, CompressionError, AveragingError)


@dataclass(frozen=True)
class AllReduceSettings:
    """Knobs of the all-reduce (see :class:`swarm.averaging.Averager` for their meaning)."""

    stream_name: str
    timeout: float  # upper bound of one all-reduce
    stall_timeout_min: float  # never drop a sender sooner than this after its last chunk
    stall_factor: float  # drop after this many chunk-times (at the measured rate) of silence
    fault: Fault = Fault.NONE


class AllReduceRunner:
    """One member's side of one group's all-reduce.

    Args:
        transport: the peer's transport.
        group: the agreed group; ``me`` is this peer's index in it.
        plan: the part plan derived from the group.
        flat: this peer's values (float32, CPU, contiguous); read-only during the round.
        result: staging buffer of the same size; part ``j`` is valid when :meth:`run` says so.
        weight: this peer's weight.
        feedback: error-feedback residuals of this averager.
        pool: thread pool for tensor work.
        fault_triggered: set when a :class:`Fault` fires (tests wait on it).
    """

    def __init__(
        self,
        transport: Any,
        group: GroupInfo,
        me: int,
        plan: PartPlan,
        flat: torch.Tensor,
        result: torch.Tensor,
        weight: float,
        feedback: FlatFeedback,
        pool: concurrent.futures.ThreadPoolExecutor,
        settings: AllReduceSettings,
        fault_triggered: asyncio.Event | None = None,
    ):
        self.transport = transport
        self.group = group
        self.me = me
        self.plan = plan
        self.flat = flat
        self.result = result
        self.weight = weight
        self.feedback = feedback
        self.pool = pool
        self.settings = settings
        self.fault_triggered = fault_triggered or asyncio.Event()
        self.deadline = time.monotonic() + settings.timeout
        self.bytes_sent = 0
        self.bytes_received = 0
        start, end = plan.ranges[me]
        self._start = start
        rel = tuple((s - start, e - start) for s, e in plan.chunks(me))
        senders = [i for i in range(len(group.members)) if i != me]
        self.reducer = PartReducer(result[start:end], rel, senders) if end > start else None
        self._adding = [0] * len(rel)  # adds into each chunk submitted and not finished
        self._inflight: set[concurrent.futures.Future[Any]] = set()
        self._begun = asyncio.Event()
        self._changed = asyncio.Event()
        self._outcomes: dict[int, asyncio.Future[tuple[str, Any]]] = {}
        self._averaged: list[asyncio.Future[bytes | None]] = []  # None: the attempt stopped
        self._readers: dict[int, asyncio.Task[None]] = {}
        self._dropped: set[int] = set()
        self._activity: dict[int, float] = {}
        self._replies: set[asyncio.Task[Any]] = set()
        self._reset_timing()

    # ---- helpers

    def _submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Run ``fn`` in the pool, tracked until it finishes (a cancelled caller does not stop
        it, and it still touches the buffers: see :meth:`_drain`)."""
        cf = self.pool.submit(fn, *args)
        self._inflight.add(cf)
        cf.add_done_callback(self._inflight.discard)
        return cf

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(self._submit(fn, *args))

    async def _drain(self) -> None:
        """Wait for thread work started by cancelled tasks (it still touches the buffers)."""
        while self._inflight:
            pending = [asyncio.wrap_future(cf) for cf in list(self._inflight)]
            await asyncio.gather(*pending, return_exceptions=True)

    def _remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def _reset_timing(self) -> None:
        self._attempt_start = time.monotonic()
        self._first_byte: float | None = None
        self._last_byte = 0.0
        self._part_bytes = 0
        self._part_chunks = 0
        self._complete_times: list[float] = []

    def _resolve(self, attempt: int, kind: str, value: Any) -> None:
        fut = self._outcome(attempt)
        if not fut.done():
            fut.set_result((kind, value))

    def _outcome(self, attempt: int) -> asyncio.Future[tuple[str, Any]]:
        fut = self._outcomes.get(attempt)
        if fut is None:
            fut = self._outcomes[attempt] = asyncio.get_running_loop().create_future()
        return fut

    # ---- the round

    async def run(self) -> tuple[dict[int, tuple[int, ...]], list[str]]:
        """Run the all-reduce; returns ``{part: member indices averaged}`` and failure notes.

        Never raises for a failed peer; parts missing from the dict keep their own values.
        """
        tasks: list[asyncio.Task[tuple[int, tuple[int, ...] | None, str]]] = []
        if self.reducer is not None:
            start, end = self.plan.ranges[self.me]
            await self._in_thread(self.reducer.begin, self.flat[start:end], self.weight)
            self.feedback.prepare_owner(start, end)
            self._new_attempt()
            self._begun.set()
            tasks.append(asyncio.create_task(self._own_part(), name="swarm-own-part"))
        for j in self.plan.owned():
            if j != self.me:
                tasks.append(asyncio.create_task(self._send_part(j), name=f"swarm-send-{j}"))
        done, pending = await asyncio.wait(tasks, timeout=self._remaining() + 1.0)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for fut in self._outcomes.values():
            if not fut.done():
                fut.set_result(("failed", "the round ended"))
        self._stop_chunks()
        await self._close_replies()
        await self._drain()
        parts: dict[int, tuple[int, ...]] = {}
        notes: list[str] = [f"a part timed out after {self.settings.timeout} s"] if pending else []
        for task in done:
            j, contributors, note = task.result()
            if contributors is not None:
                parts[j] = contributors
            if note:
                notes.append(note)
        return parts, notes

    async def _close_replies(self) -> None:
        if self._replies:
            _, late = await asyncio.wait(self._replies, timeout=self._remaining())
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)

    # ---- owner side

    def _new_attempt(self) -> None:
        self._reset_timing()
        loop = asyncio.get_running_loop()
        assert self.reducer is not None
        self._averaged = [loop.create_future() for _ in self.reducer.chunks]

    def _stop_chunks(self) -> None:
        """Reply writers waiting for averaged chunks of this attempt stop (they get None)."""
        for chunk in self._averaged:
            if not chunk.done():
                chunk.set_result(None)

    async def _own_part(self) -> tuple[int, tuple[int, ...] | None, str]:
        reducer = self.reducer
        assert reducer is not None  # run() only starts this task with a part to own
        while True:
            attempt = reducer.attempt
            sent = await self._average_chunks()
            await self._drain()
            contributors = reducer.contributors()
            retry_ok = attempt + 1 < MAX_ATTEMPTS and self._remaining() > 0
            if reducer.tainted and retry_ok and contributors:
                logger.debug("part %d tainted by %s: retrying", self.me, reducer.failed())
                self._stop_chunks()
                for s, e in reducer.chunks[:sent]:  # nobody applies what went out: no residual
                    self.feedback.forget_owned(s, e - s)
                await self._in_thread(reducer.restart)
                self._new_attempt()
                self._resolve(attempt, "retry", None)
                continue
            if reducer.tainted or not contributors or sent < len(reducer.chunks):
                self._stop_chunks()
                why = "a sender failed twice" if reducer.tainted else "no sender finished"
                if not reducer.tainted and contributors:
                    why = "the averaged part could not be encoded"
                self._resolve(attempt, "failed", why)
                return self.me, None, f"own part {self.me}: {why}"
            averaged = tuple(sorted((self.me, *contributors)))
            self._resolve(attempt, "ok", averaged)
            note = f"part {self.me}: dropped {list(reducer.failed())}" if reducer.failed() else ""
            return self.me, averaged, note

    async def _average_chunks(self) -> int:
        """Average and encode chunks in order as every sender delivers them, until the part is
        settled; returns how many went out (all of them, unless tainted or an encoding failed)."""
        reducer = self.reducer
        assert reducer is not None
        sent, n = 0, len(reducer.chunks)
        while True:
            self._changed.clear()
            self._watchdog()
            while sent < n and not reducer.tainted and self._chunk_ready(sent):
                total = reducer.chunk_total(sent)
                try:
                    payload = await self._in_thread(self._finish_chunk, sent, total)
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
        assert self.reducer is not None
        return self._adding[index] == 0 and self.reducer.chunk_ready(index)

    def _finish_chunk(self, index: int, total: float) -> bytes:
        assert self.reducer is not None
        values = self.reducer.finish_chunk(index, total)
        return self.feedback.encode_owned(values, self.reducer.chunks[index][0])

    def _watchdog(self) -> None:
        """Drop senders that stalled, judged by the rate this part has been receiving at."""
        reducer = self.reducer
        if reducer is None:
            return
        now = time.monotonic()
        floor = self.settings.stall_timeout_min
        factor = self.settings.stall_factor
        active = [
            s
            for s in reducer.expected
            if reducer.state(s) in (SenderState.PENDING, SenderState.STREAMING)
        ]
        for s in active:
            if now >= self.deadline:
                self._drop(s, "all-reduce deadline")
                continue
            if reducer.state(s) is SenderState.STREAMING:
                # the rate while data flowed (it must not decay while everyone waits)
                elapsed = self._last_byte - (self._first_byte or self._last_byte)
                rate = self._part_bytes / elapsed if elapsed > 0 else 0.0  # bytes/s, all senders
                chunk = self._part_bytes / max(1, self._part_chunks)
                per_sender = rate / max(1, len(active))
                limit = max(floor, factor * chunk / per_sender) if per_sender > 0 else floor * 4
                if now - self._activity.get(s, now) > limit:
                    self._drop(s, f"silent for {now - self._activity[s]:.1f} s (limit {limit:.1f})")
            else:
                if self._complete_times:
                    limit = max(floor, factor * max(self._complete_times))
                elif self._first_byte is not None:
                    limit = max(floor, factor * (self._first_byte - self._attempt_start))
                else:
                    continue  # nobody sent anything yet: only the deadline applies
                if now - self._attempt_start > limit:
                    self._drop(s, f"never started (limit {limit:.1f} s)")

    def _drop(self, sender: int, why: str) -> None:
        assert self.reducer is not None
        logger.info(
            "all-reduce %s: dropping %s from part %d: %s",
            self.group.group_id.hex()[:8],
            self.group.members[sender].peer_id.short,
            self.me,
            why,
        )
        self.reducer.fail(sender)
        self._dropped.add(sender)
        reader = self._readers.get(sender)
        if reader is not None:
            reader.cancel()
        self._changed.set()

    async def handle_part(
        self, request: InboundStream, reply: ReplyStream, sender: int, header: dict[str, Any]
    ) -> None:
        """Serve one sender's stream for this member's part (called by the averager's route).

        Raises:
            TransportError / AuthError: the stream is refused or failed (the sender is dropped).
        """
        reducer = self.reducer
        attempt, weight = header.get("a"), header.get("w")
        if reducer is None:
            raise TransportError("this member owns no part", status=409)
        if header.get("p") != self.me or type(attempt) is not int or attempt != reducer.attempt:
            raise TransportError(f"wrong part or attempt {attempt}", status=409)
        await self._begun.wait()
        try:
            reducer.accept(sender, weight)  # type: ignore[arg-type]
        except AveragingError as e:
            raise TransportError(str(e), status=409) from e
        self._activity[sender] = time.monotonic()
        reader = asyncio.create_task(self._consume(request, sender))
        self._readers[sender] = reader
        writer: asyncio.Task[bool] | None = None
        if self.settings.fault is not Fault.SKIP_REPLY:
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
        except _FAILURES as e:
            await _cancel(writer)
            logger.info("part %d: stream from member %d failed: %s", self.me, sender, e)
            reducer.fail(sender)
            self._changed.set()
            if isinstance(e, (AuthError, TransportError)):
                raise
            raise TransportError(f"refused: {e}", status=400) from e
        finally:
            self._readers.pop(sender, None)
        self._complete_times.append(time.monotonic() - self._attempt_start)
        self._changed.set()
        task = asyncio.current_task()
        if task is not None:
            self._replies.add(task)
        try:
            await self._finish_reply(reply, writer, attempt)  # type: ignore[arg-type]
        finally:
            if task is not None:
                self._replies.discard(task)

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
        kind, value = await self._outcome(attempt)
        if writer is None:  # Fault.SKIP_REPLY: an owner that never answers
            self.fault_triggered.set()
            await asyncio.sleep(_FAULT_SLEEP_S)
            return
        complete = await writer
        if kind == "retry":
            reply.set_trailer({"retry": True})
        elif kind == "ok" and complete:
            reply.set_trailer({"ok": True, "c": list(value)})
        elif kind == "ok":
            reply.set_trailer({"ok": False, "why": "the round ended before the part was sent"})
        else:
            reply.set_trailer({"ok": False, "why": str(value)})

    async def _consume(self, request: InboundStream, sender: int) -> None:
        reducer = self.reducer
        assert reducer is not None
        async for payload in request:
            index = reducer.next_index(sender)
            now = time.monotonic()
            if self._first_byte is None:
                self._first_byte = now
            self.bytes_received += len(payload)
            self._part_bytes += len(payload)
            self._part_chunks += 1
            # counted before the add starts: a sender dropped (its task cancelled) while the worker
            # thread adds its chunk must taint the part, since the add completes regardless
            reducer.chunk_added(sender)
            self._adding[index] += 1
            cf = self._submit(reducer.add_chunk, sender, index, payload)
            # counted down when the add finishes, also if this task is cancelled meanwhile
            cf.add_done_callback(
                functools.partial(_call_soon, asyncio.get_running_loop(), self._added, index)
            )
            await asyncio.wrap_future(cf)
            self._activity[sender] = self._last_byte = time.monotonic()

    # ---- sender side

    async def _send_part(self, j: int) -> tuple[int, tuple[int, ...] | None, str]:
        owner = self.group.members[j]
        chunks = self.plan.chunks(j)
        stored: list[bytes] | None = [] if self.feedback.enabled else None
        attempt = 0
        try:
            while True:
                header = {"g": self.group.group_id, "p": j, "a": attempt, "w": self.weight}
                body = self._body(chunks, stored, attempt)
                outcome = await asyncio.wait_for(
                    self._exchange(owner, header, body, j, chunks), self._remaining()
                )
                if outcome is not None:
                    return j, outcome, ""
                attempt += 1
                if attempt >= MAX_ATTEMPTS:
                    raise AveragingError("owner asked for too many retries")
        except (*_FAILURES, asyncio.TimeoutError) as e:
            reason = str(e) or type(e).__name__
            logger.info("part %d (owner %s) not averaged: %s", j, owner.peer_id.short, reason)
            return j, None, f"part {j}: {reason}"

    async def _body(
        self, chunks: tuple[tuple[int, int], ...], stored: list[bytes] | None, attempt: int
    ) -> AsyncIterator[bytes]:
        for i, (s, e) in enumerate(chunks):
            if self.settings.fault is Fault.STALL_MID_STREAM and i >= len(chunks) // 2:
                self.fault_triggered.set()
                await asyncio.sleep(_FAULT_SLEEP_S)
            if attempt > 0 and stored is not None:
                payload = stored[i]
            else:
                payload = await self._in_thread(self.feedback.encode, self.flat[s:e], s)
                if stored is not None:
                    stored.append(payload)
            self.bytes_sent += len(payload)
            yield payload

    async def _exchange(
        self,
        owner: Any,
        header: dict[str, Any],
        body: AsyncIterator[bytes],
        j: int,
        chunks: tuple[tuple[int, int], ...],
    ) -> tuple[int, ...] | None:
        """One stream to owner ``j``; returns the contributors, or None when asked to retry."""
        name = self.settings.stream_name
        timeout = max(1.0, self._remaining())
        async with self.transport.stream(owner, name, header, body, timeout=timeout) as s:
            if s.header.get("ok") is not True:
                raise AveragingError(f"owner refused: {s.header.get('why')!s:.200}")
            received = 0
            async for payload in s:  # staged in ``result``; applied after an ok trailer only
                if received >= len(chunks):
                    raise AveragingError("owner sent more chunks than the part has")
                cs, ce = chunks[received]
                await self._in_thread(self._apply_chunk, payload, cs, ce)
                self.bytes_received += len(payload)
                received += 1
            outcome = s.trailer
        if outcome.get("retry") is True:
            return None
        if outcome.get("ok") is not True:
            raise AveragingError(f"owner gave up: {outcome.get('why')!s:.200}")
        if received != len(chunks):
            raise AveragingError(f"owner sent {received} of {len(chunks)} chunks")
        return self._check_contributors(outcome.get("c"), j)

    def _check_contributors(self, value: Any, j: int) -> tuple[int, ...]:
        n = len(self.group.members)
        if (
            not isinstance(value, list)
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in value)
            or len(set(value)) != len(value)
            or not all(0 <= i < n for i in value)
            or j not in value
            or self.me not in value
        ):
            raise AveragingError("owner sent an invalid contributor list")
        return tuple(sorted(value))

    def _apply_chunk(self, payload: bytes, start: int, end: int) -> None:
        header = read_header(payload, max_numel=end - start)
        if header.numel != end - start:
            raise CompressionError(f"averaged chunk holds {header.numel}, expected {end - start}")
        out = self.result[start:end]
        out.zero_()
        decode_into(payload, out, 1.0)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """For a worker thread's done callback: ``fn(*args)`` on the loop (the future is dropped)."""
    loop.call_soon_threadsafe(fn, *args[:-1])


async def _cancel(task: asyncio.Task[Any] | None) -> None:
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
