"""The sender's side of one part: stream this member's share to its owner, stage the average.

Member ``i`` opens one stream to the owner of part ``j`` (route ``{name}.part``) with the header
``{"g": group id, "p": part, "a": attempt, "w": weight, "o": round order}`` (the owner's
answer claims its round order too; see :meth:`RoundContext.heard_order`) and streams its
compressed values of part ``j`` chunk by chunk (with its error feedback). The averaged chunks
come back on the reply while later chunks still go out; they are staged compressed
(:class:`~swarm.averaging.butterfly.staged.StagedAverages`), and the part counts as averaged
only after the owner's ``ok`` trailer, with every chunk received and a valid contributor list.
A ``retry`` trailer starts the part again (once), its chunks encoded afresh. In a pair under a
sparse codec the owner's chunks are its own payloads, each staged with this member's payload
of the chunk and the shares of the mean (:mod:`~swarm.averaging.butterfly.pairs`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import torch

from swarm.averaging.butterfly.context import RoundContext
from swarm.averaging.butterfly.outcome import FAILURES, MAX_ATTEMPTS, SentPart
from swarm.averaging.butterfly.pairs import Shares, check_shares
from swarm.averaging.butterfly.staged import StagedAverages
from swarm.averaging.result import Refusal, RefusalAction
from swarm.compression import Codec
from swarm.errors import GONE, AveragingError, CompressionError, TransportError
from swarm.protocols import StreamTransport

logger = logging.getLogger(__name__)

T = TypeVar("T")
_TICK_S = 0.2


class OwnerStalled(AveragingError):
    """The owner of a part stopped making progress."""


class OwnerLied(AveragingError):
    """The owner sent back an averaged chunk that does not decode (malformed, NaN or inf):
    the stream is authenticated, so the bytes are the owner's own."""


class PartSender:
    """Streams this member's values of part ``part`` to its owner and stages the average.

    Args:
        ctx: the round.
        transport: the peer's transport.
        stream_name: the owner's route.
        part: the part (and its owner's index).
        chunks: absolute ``(start, end)`` of every chunk of the part.
        flat: this member's values (read-only during the round).
        staged: where the averaged chunks wait for the round's verdict.
    """

    def __init__(
        self,
        ctx: RoundContext,
        transport: StreamTransport,
        stream_name: str,
        part: int,
        chunks: tuple[tuple[int, int], ...],
        flat: torch.Tensor,
        staged: StagedAverages,
    ):
        self.ctx = ctx
        self.transport, self.stream_name = transport, stream_name
        self.group, self.me, self.part, self.chunks = ctx.group, ctx.me, part, chunks
        self.flat, self.staged, self.weight = flat, staged, ctx.weight
        self.feedback, self.workers = ctx.feedback, ctx.workers
        self.deadline, self.faults = ctx.deadline, ctx.faults
        self.bytes_sent = 0
        self.bytes_received = 0
        # kept for a retry, so that it sends what its error feedback counted as sent, and in a
        # pair to compose the average; but payloads of a byte or more per value (int8: in a
        # group of 4, 0.19 of the vector's float32 size per round) leave a residual of a
        # rounding's size, and a retry encodes those afresh (see FlatFeedback.encode_again)
        keep = ctx.pairwise or (ctx.feedback.enabled and not _dense(ctx.feedback.codec))
        self._stored: list[bytes] | None = [] if keep else None
        self._encoded = 0  # chunks whose encoding moved the error feedback (in any attempt)
        self._progress: list[float] = [time.monotonic()]  # when chunks went out or came back

    def _remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    async def run(self) -> SentPart:
        """Send the part (and once more if the owner asks); never raises for a failed owner."""
        owner = self.group.members[self.part]
        try:
            for attempt in range(MAX_ATTEMPTS):
                header = {"g": self.group.group_id, "p": self.part, "a": attempt, "w": self.weight}
                if self.ctx.order is not None:
                    header["o"] = self.faults.order(self.ctx.order)
                if self.ctx.parent is not None:
                    header["r"] = self.ctx.parent  # a repair: owners that settled it answer now
                contributors = await self._attempt(owner, header)
                if contributors is not None:
                    return SentPart(self.part, contributors, "")
            raise AveragingError("owner asked for too many retries")
        except OwnerStalled as e:
            # INFO, as an owner drops a stalled sender: a busy honest owner stalls too, and the
            # part only keeps this member's values (the round's report names it)
            logger.info("part %d: dropping owner %s: %s", self.part, owner.peer_id.short, e)
            refusal = Refusal(owner.peer_id, RefusalAction.DROPPED, self.part, str(e))
            return SentPart(self.part, None, f"part {self.part}: owner {e}", (refusal,))
        except OwnerLied as e:
            logger.warning("part %d: accusing owner %s: %s", self.part, owner.peer_id.short, e)
            refusal = Refusal(owner.peer_id, RefusalAction.ACCUSED, self.part, str(e)[:200])
            return SentPart(self.part, None, f"part {self.part}: owner accused", (refusal,))
        except (*FAILURES, asyncio.TimeoutError) as e:
            if isinstance(e, TransportError) and e.refused:
                self.ctx.mark_gone(self.part)
            elif isinstance(e, TransportError) and e.status in (403, 404, GONE):
                # the group is not the owner's (404), the owner's round or averager is over
                # (410), or the owner excluded this member (403): either way it will not send
                # to this member's part, so nobody waits for it
                self.ctx.gone.add(self.part)
                if e.status == 403:
                    self.ctx.refused_us.add(self.part)
            elif not isinstance(e, asyncio.TimeoutError):
                self.ctx.suspect(self.part, now=True)  # the owner may have died mid-round
            reason = str(e) or type(e).__name__
            logger.info(
                "part %d (owner %s) not averaged: %s", self.part, owner.peer_id.short, reason
            )
            return SentPart(self.part, None, f"part {self.part}: {reason}")

    async def _attempt(self, owner: Any, header: dict[str, Any]) -> tuple[int, ...] | None:
        """One attempt's stream, opened once more when the connection failed before the owner
        answered: the owner never took it (a second stream of the same attempt would be
        refused), and a caller that reused a connection its peer was closing met a reset."""
        try:
            return await self._watched(self._exchange(owner, header, self._body()))
        except TransportError as e:
            if not e.unanswered or e.refused:
                raise
            logger.info(
                "part %d: stream to %s lost before an answer (%s): once more",
                self.part,
                owner.peer_id.short,
                e,
            )
        return await self._watched(self._exchange(owner, header, self._body()))

    async def _watched(self, exchange: Coroutine[Any, Any, T]) -> T:
        """Run one exchange until it ends, the deadline passes, or the owner stalls: nothing
        went out or came back for longer than the stall policy allows at the pace measured on
        this stream (a frozen owner costs seconds, not the round)."""
        task = asyncio.ensure_future(exchange)
        self._progress = [time.monotonic()]
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_TICK_S)
                if done:
                    return task.result()
                now = time.monotonic()
                if now >= self.deadline:
                    raise asyncio.TimeoutError("all-reduce deadline")
                marks = self._progress
                pace = (marks[-1] - marks[0]) / (len(marks) - 1) if len(marks) > 1 else None
                limit = self.ctx.stall.reply_limit(pace)
                if now - marks[-1] > limit:
                    raise OwnerStalled(
                        f"stalled: no progress for {now - marks[-1]:.1f} s (limit {limit:.1f} s)"
                    )
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _body(self) -> AsyncIterator[bytes]:
        """The part's payloads. A retry (the owner discarded what it had) sends a chunk
        encoded before from its stored copy, or encodes it afresh where payloads are not kept
        (:meth:`~swarm.averaging.butterfly.residuals.FlatFeedback.encode_again`)."""
        stored = self._stored
        for i, (s, e) in enumerate(self.chunks):
            await self.faults.before_chunk(i, len(self.chunks))
            if stored is not None and i < len(stored):
                payload = stored[i]
            elif i < self._encoded:
                payload = await self.workers.run(self.feedback.encode_again, self.flat[s:e], s)
            else:
                payload = await self.workers.run(self.feedback.encode, self.flat[s:e], s)
                self._encoded = i + 1
                if stored is not None:
                    stored.append(payload)
            payload = self.faults.payload(payload)
            self.bytes_sent += len(payload)
            yield payload
            self._progress.append(time.monotonic())  # the previous chunk was taken

    async def _exchange(
        self, owner: Any, header: dict[str, Any], body: AsyncIterator[bytes]
    ) -> tuple[int, ...] | None:
        """One stream to the owner; returns the contributors, or None when asked to retry."""
        chunks = self.chunks
        timeout = max(1.0, self._remaining())
        async with self.transport.stream(
            owner, self.stream_name, header, body, timeout=timeout
        ) as s:
            if s.header.get("ok") is not True:
                raise AveragingError(f"owner refused: {s.header.get('why')!s:.200}")
            self.ctx.heard_order(self.part, s.header.get("o"))
            shares = self._shares(s.header)
            received = 0
            self.staged.begin_part(self.part)  # a retry's chunks replace the last attempt's
            async for payload in s:  # staged; applied after an ok trailer only
                if received >= len(chunks):
                    raise AveragingError("owner sent more chunks than the part has")
                cs, ce = chunks[received]
                pair = None
                if shares is not None:  # a pair stores its payloads (see __init__)
                    stored = self._stored or []
                    if received >= len(stored):
                        raise OwnerLied("sent a chunk back before it had this member's")
                    pair = (stored[received], shares)
                await self.workers.run(self._stage_chunk, payload, cs, ce, pair)
                self.bytes_received += len(payload)
                received += 1
                self._progress.append(time.monotonic())
            outcome = s.trailer
        if outcome.get("retry") is True:
            return None
        if outcome.get("ok") is not True:
            raise AveragingError(f"owner gave up: {outcome.get('why')!s:.200}")
        if received != len(chunks):
            raise AveragingError(f"owner sent {received} of {len(chunks)} chunks")
        return self._check_contributors(outcome.get("c"))

    def _check_contributors(self, value: Any) -> tuple[int, ...]:
        n = len(self.group.members)
        if (
            not isinstance(value, list)
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in value)
            or len(set(value)) != len(value)
            or not all(0 <= i < n for i in value)
            or self.part not in value
            or self.me not in value
        ):
            raise AveragingError("owner sent an invalid contributor list")
        return tuple(sorted(value))

    def _shares(self, header: dict[str, Any]) -> Shares | None:
        """In a pair, the shares of the mean the owner's answer gives (else None).

        Raises:
            OwnerLied: missing, malformed, or more than the owner's due.
            AveragingError: an owner of a pair gave shares where this member expects none.
        """
        if not self.ctx.pairwise:
            if "b" in header:
                raise AveragingError("owner answered as in a pair")
            return None
        try:
            return check_shares(
                header.get("b"), self.ctx.aggregator == "centered_clip", self.ctx.weight_cap
            )
        except AveragingError as e:
            raise OwnerLied(str(e)) from e

    def _stage_chunk(
        self, payload: bytes, start: int, end: int, pair: tuple[bytes, Shares] | None
    ) -> None:
        try:
            self.staged.stage(self.part, start, end, payload, pair)
        except CompressionError as e:
            raise OwnerLied(f"sent an averaged chunk that does not decode: {e}") from e


def _dense(codec: Codec) -> bool:
    """Whether ``codec``'s payloads take a byte or more per value (``int8``, ``fp16``)."""
    return codec.estimate_size(1 << 20) >= 1 << 20
