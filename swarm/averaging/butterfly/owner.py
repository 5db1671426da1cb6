"""The owner's side of one part: reduce the senders' streams, stream the average back.

Every other member streams its compressed values of this part in chunks, which the
:class:`~swarm.averaging.butterfly.intake.PartIntake` adds into the accumulator as they arrive. As
soon as every sender delivered chunk ``c`` (or was dropped), chunk ``c`` is divided by its weight,
compressed with the owner's error feedback, and written back on the reply of every stream while
later chunks still arrive (:class:`~swarm.averaging.butterfly.replies.PartReplies`, which also ends
each reply with the attempt's :class:`PartOutcome`).

In a pair under a sparse codec the owner sends back its own payload of each chunk instead, and
the shares of the mean in its answer's header (:mod:`~swarm.averaging.butterfly.pairs`).

A dropped sender whose chunks were already added *taints* the part: the owner stops, resets the
part and answers ``retry`` to the complete senders, which send again (once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import torch

from swarm.averaging.butterfly.context import RoundContext
from swarm.averaging.butterfly.echoes import PartEchoes
from swarm.averaging.butterfly.intake import PartIntake
from swarm.averaging.butterfly.outcome import MAX_ATTEMPTS, OwnedPart, PartOutcome
from swarm.averaging.butterfly.pairs import Shares
from swarm.averaging.butterfly.reducer import PartReducer
from swarm.averaging.butterfly.replies import PartReplies
from swarm.averaging.butterfly.scoring import PartScores, part_scores
from swarm.averaging.butterfly.staged import StagedAverages
from swarm.averaging.result import Refusal, RefusalAction
from swarm.errors import CompressionError, TransportError
from swarm.net.streams import InboundStream, ReplyStream
from swarm.timeouts import wait_for

logger = logging.getLogger(__name__)

_TICK_S = 0.2


class PartOwner:
    """Reduces part ``me`` of a group and streams the average back to its senders.

    Args:
        ctx: the round; this member owns part ``ctx.me``.
        values: this member's values of the part (read-only during the round).
        chunks: ``(start, end)`` of every chunk, relative to the part.
        start: the part's offset in the flat vector (for the error feedback).
        staged: where the average waits for the round's verdict, as the senders stage it.
    """

    def __init__(
        self,
        ctx: RoundContext,
        values: torch.Tensor,
        chunks: tuple[tuple[int, int], ...],
        start: int,
        staged: StagedAverages,
    ):
        self.ctx = ctx
        self.group, self.me = ctx.group, ctx.me
        self.feedback, self.workers, self.faults = ctx.feedback, ctx.workers, ctx.faults
        self.values, self.start, self.staged = values, start, staged
        senders = [i for i in range(len(ctx.group.members)) if i != ctx.me]
        senders = [i for i in senders if i not in ctx.excluded]
        self.reducer = PartReducer(
            chunks,
            senders,
            ctx.aggregator,
            ctx.weight_cap,
            ctx.trust,
            score=ctx.score,
            pairwise=ctx.pairwise,
            device=values.device,
        )
        # pairwise: the sender's shares of the mean, and this owner's own payload of each chunk
        # (encoded once: a retry sends the same bytes, and its error feedback moved once)
        self._shares: Shares = (1.0, 0.0)
        self._own_payloads: dict[int, bytes] = {}
        if ctx.echo is not None and self.reducer.alignment is not None:
            self.reducer.echoes = PartEchoes(ctx.echo, start, start + values.numel())
        if self.faults.active:
            self.reducer.observe_radius = self.faults.observe_radius
        self.intake = PartIntake(ctx, self.reducer)
        self.replies = PartReplies(len(chunks), self.faults.hold)
        self._begun = asyncio.Event()

    @property
    def bytes_sent(self) -> int:
        return self.replies.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.intake.bytes_received

    async def run(self) -> OwnedPart:
        """Reduce the part until it is settled; never raises for a failed sender."""
        await self.workers.run(self.reducer.begin, self.values, self.ctx.weight)
        self.feedback.prepare_owner(self.start, self.start + self.values.numel())
        self._new_attempt()
        self._begun.set()
        reducer = self.reducer
        while True:
            attempt = reducer.attempt
            sent = await self._average_chunks()
            await self.workers.drain()
            contributors = reducer.contributors()
            can_retry = attempt + 1 < MAX_ATTEMPTS and time.monotonic() < self.ctx.deadline
            if reducer.tainted and can_retry and contributors:
                logger.debug("part %d tainted by %s: retrying", self.me, reducer.failed())
                self.replies.stop()
                for s, e in reducer.chunks[:sent]:  # nobody applies what went out: no residual
                    self.feedback.forget_owned(s, e - s)
                await self.workers.run(reducer.restart)
                self._new_attempt()
                self.replies.resolve(attempt, PartOutcome.RETRY, None)
                continue
            if reducer.tainted or not contributors or sent < len(reducer.chunks):
                self.replies.stop()
                why = "a sender failed twice" if reducer.tainted else "no sender finished"
                if not reducer.tainted and contributors:
                    why = "the averaged part could not be encoded"
                self.replies.resolve(attempt, PartOutcome.FAILED, why)
                return OwnedPart(None, f"own part {self.me}: {why}", self._report())
            averaged = tuple(sorted((self.me, *contributors)))
            self.replies.resolve(attempt, PartOutcome.OK, averaged)
            failed = reducer.failed()
            note = f"part {self.me}: dropped {list(failed)}" if failed else ""
            return OwnedPart(averaged, note, self._report(), self._scores(contributors))

    async def serve(
        self, request: InboundStream, reply: ReplyStream, sender: int, header: dict[str, Any]
    ) -> None:
        """Serve one sender's stream for this part (called by the averager's route).

        Raises:
            TransportError / AuthError: the stream is refused or failed (the sender is dropped).
        """
        attempt, current = header.get("a"), self.reducer.attempt
        if header.get("p") != self.me or type(attempt) is not int or attempt != current:
            raise TransportError(f"wrong part or attempt {attempt}", status=409)
        await self._begun.wait()
        self.intake.accept(sender, header.get("w"))
        self.ctx.heard_order(sender, header.get("o"))
        answer: dict[str, Any] = {"ok": True}
        if self.ctx.order is not None:
            answer["o"] = self.faults.order(self.ctx.order)
        if self.ctx.pairwise:  # before any chunk: the sender stages what both will apply
            self._shares = self.reducer.pair_shares(sender)
            answer["b"] = list(self.faults.shares(self._shares))
        writer: asyncio.Task[bool] | None = None
        receiving = asyncio.ensure_future(self.intake.receive(request, sender))
        try:
            if not self.faults.owner_silent:
                await reply.prepare(answer)
                writer = self.replies.start(reply, sender)
            await receiving
        except BaseException:
            for task in (writer, receiving):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            # also when the reply broke before the read began: nobody waits for the stall limit
            self.intake.fail(sender)
            raise
        if writer is not None and self.faults.cuts_reply(sender, self.me):
            await asyncio.gather(writer, return_exceptions=True)
            raise TransportError("the reply broke before its verdict (fault injected)")
        await self.replies.finish(reply, writer, attempt)

    async def close(self, deadline: float | None = None) -> None:
        """End the part: streams still read end, unanswered replies fail, reply writers stop,
        finished replies close (replies still ending get until ``deadline``, by default the
        round's)."""
        self.intake.stop()
        await self.replies.close(self.ctx.deadline if deadline is None else deadline)

    def expect_by(self, when: float) -> None:
        """See :meth:`PartIntake.expect_by`."""
        self.intake.expect_by(when)

    def _new_attempt(self) -> None:
        self.staged.begin_part(self.me)  # what an attempt before staged is not the average
        self.intake.new_attempt()
        self.replies.new_attempt()

    def _scores(self, contributors: tuple[int, ...]) -> PartScores | None:
        """In an update round, each complete sender's score (see butterfly.scoring)."""
        alignment = self.reducer.alignment
        if alignment is None:
            return None
        members = {-1, *contributors}
        cosines, progress = alignment.cosines(members), alignment.progress(members)
        weights, balance = self.reducer.claimed_weights(), alignment.balance(members)
        echoes = self.reducer.echoes.cosines(members) if self.reducer.echoes else None
        for measure in (cosines, progress, weights, balance, echoes or {}):
            if -1 in measure:
                measure[self.me] = measure.pop(-1)
        return part_scores(cosines, self.me, progress, weights, balance, echoes)

    def _report(self) -> tuple[Refusal, ...]:
        """Every sender this part refused, dropped, clipped or capped, logged once each."""
        peer = self.group.members
        found = list(self.intake.refusals)
        for s, scale in sorted(self.reducer.clipped.items()):
            found.append(
                Refusal(
                    peer[s].peer_id,
                    RefusalAction.CLIPPED,
                    self.me,
                    f"offset scaled by {scale:.2g}" + ("" if self.ctx.updates else " (values)"),
                )
            )
        for s, claimed in sorted(self.reducer.capped.items()):
            found.append(
                Refusal(
                    peer[s].peer_id,
                    RefusalAction.WEIGHT_CAPPED,
                    self.me,
                    f"claimed weight {claimed:.3g}",
                )
            )
        for r in found:
            # clipping, capping and dropping are the aggregation doing its job (honest peers
            # meet them too: a late joiner's values, a peer that left); malformed bytes are not
            level = logging.WARNING if r.action is RefusalAction.REFUSED else logging.INFO
            logger.log(level, "all-reduce %s: %s", self.group.group_id.hex()[:8], r)
        return tuple(found)

    async def _average_chunks(self) -> int:
        """Average and encode chunks in order as every sender delivers them, until the part is
        settled; returns how many went out (all of them, unless tainted or an encoding failed)."""
        reducer, intake = self.reducer, self.intake
        sent, n = 0, len(reducer.chunks)
        while True:
            intake.changed.clear()
            intake.watch()
            while sent < n and not reducer.tainted and intake.chunk_ready(sent):
                total = reducer.chunk_total(sent)
                try:
                    payload = await self.workers.run(self._finish_chunk, sent, total)
                except CompressionError as e:
                    logger.warning("part %d: cannot encode the average: %s", self.me, e)
                    return sent
                self.replies.publish(sent, payload, reducer.delivered(sent))
                sent += 1
                intake.chunk_averaged(sent)
            if reducer.settled() and (reducer.tainted or sent == n):
                return sent
            if reducer.settled() and not reducer.contributors():
                return sent  # every sender failed before sending: nothing to average
            with contextlib.suppress(asyncio.TimeoutError):  # a watchdog tick
                await wait_for(intake.changed.wait(), _TICK_S)

    def _finish_chunk(self, index: int, total: float) -> bytes:
        """Average chunk ``index``, encode it and stage what it decodes to; the payload."""
        start = self.reducer.chunks[index][0]
        try:
            if self.ctx.pairwise:
                return self._finish_pair_chunk(index)
            values = self.reducer.finish_chunk(index, total)
            self.faults.averaged(values)
            payload = self.feedback.encode_owned(values, start)  # values := what it decodes to
            self.staged.stage_own(self.me, self.start + start, payload, values)
        finally:
            self.reducer.release(index)
        return self.faults.averaged_payload(payload)

    def _finish_pair_chunk(self, index: int) -> bytes:
        """Pairwise: this owner's own payload of chunk ``index`` (sent back in place of an
        average), with the chunk staged as both members apply it."""
        start, end = self.reducer.chunks[index]
        payload = self._own_payloads.get(index)
        if payload is None:
            payload = self.feedback.encode(self.values[start:end], self.start + start)
            self._own_payloads[index] = payload
        values, theirs = self.reducer.finish_pair_chunk(index, payload, self._shares)
        pair = None if theirs is None else (theirs, self._shares)
        self.staged.stage_own(self.me, self.start + start, payload, values, pair)
        return self.faults.averaged_payload(payload)
