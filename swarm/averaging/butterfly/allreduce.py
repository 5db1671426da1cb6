"""Butterfly all-reduce of one group: reduce-scatter, then all-gather, on the same streams.

Member ``i`` owns part ``i`` of the flat vector
(:class:`~swarm.averaging.butterfly.parts.PartPlan`): its
:class:`~swarm.averaging.butterfly.owner.PartOwner` reduces what the others stream to it and streams
the average back chunk by chunk, while one :class:`~swarm.averaging.butterfly.sender.PartSender` per
other part streams this member's share to that part's owner and stages the average it returns. All
of a member's streams are in flight at once; tensor work runs in worker threads. A part whose owner
fails keeps this member's own values: nothing half-received is ever applied.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from swarm.averaging.butterfly.checks import NOT_FINITE, implausible_parts, not_finite
from swarm.averaging.butterfly.context import RoundContext
from swarm.averaging.butterfly.outcome import OwnedPart, SentPart
from swarm.averaging.butterfly.owner import PartOwner
from swarm.averaging.butterfly.parts import PartPlan
from swarm.averaging.butterfly.scoring import PartScores
from swarm.averaging.butterfly.sender import PartSender
from swarm.averaging.butterfly.staged import StagedAverages
from swarm.averaging.groups.rates import stream_upload_rate
from swarm.averaging.result import Refusal, RefusalAction
from swarm.errors import TransportError
from swarm.net.streams import InboundStream, ReplyStream
from swarm.protocols import StreamTransport

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundParts:
    """What one member's all-reduce produced."""

    parts: dict[int, tuple[int, ...]]  # part -> member indices averaged (missing: kept own)
    notes: list[str]  # what went wrong, part by part
    refusals: tuple[Refusal, ...]  # peers clipped, capped, dropped, refused or accused
    bytes_sent: int
    bytes_received: int
    scores: PartScores | None = None  # the alignments in this member's part


class AllReduce:
    """One member's side of one group's all-reduce.

    Args:
        transport: the peer's transport.
        stream_name: the route of part streams.
        ctx: the round (group, this member's index and weight, feedback, workers, stall policy,
            deadline, faults, aggregator, excluded members).
        plan: the part plan derived from the group.
        flat: this peer's values (float32, contiguous, any device); read-only during the round.
        staged: where the averages wait for their verdict; part ``j`` holds its average when
            :meth:`run` says so.
        check_owners: refuse parts whose average is implausibly far from this member's values
            (:mod:`swarm.averaging.butterfly.checks`) and accuse their owners.
    """

    def __init__(
        self,
        transport: StreamTransport,
        stream_name: str,
        ctx: RoundContext,
        plan: PartPlan,
        flat: torch.Tensor,
        staged: StagedAverages,
        check_owners: bool = True,
    ):
        self.group, self.me, self.deadline = ctx.group, ctx.me, ctx.deadline
        self.plan, self.flat, self.staged = plan, flat, staged
        self.stall_floor = ctx.stall.floor_s
        self.check_owners = check_owners
        self.workers, self.rates = ctx.workers, ctx.rates
        start, end = plan.ranges[ctx.me]
        self.owner: PartOwner | None = None
        if end > start:
            rel = tuple((s - start, e - start) for s, e in plan.chunks(ctx.me))
            # the own part is staged chunk by chunk as it goes out, like the others' averages
            self.owner = PartOwner(ctx, flat[start:end], rel, start, staged)
        # an owner this member accused gets nothing from it, and its average is not applied;
        # the plan is the group's, the same for every member (the part is repaired instead)
        self.senders = [
            PartSender(ctx, transport, stream_name, j, plan.chunks(j), flat, staged)
            for j in plan.owned()
            if j != ctx.me and j not in ctx.excluded
        ]

    async def run(self) -> RoundParts:
        """Run the all-reduce; never raises for a failed peer."""
        tasks: list[asyncio.Task[OwnedPart | SentPart]] = [
            asyncio.create_task(s.run(), name=f"swarm-send-{s.part}") for s in self.senders
        ]
        idle: asyncio.Task[None] | None = None
        if self.owner is not None:
            idle = asyncio.create_task(self._idle_owner(self.owner, list(tasks)))
            tasks.append(asyncio.create_task(self.owner.run(), name="swarm-own-part"))
        remaining = max(0.0, self.deadline - time.monotonic())
        try:
            done, pending = await asyncio.wait(tasks, timeout=remaining + 1.0)
        except asyncio.CancelledError:
            # the round is called off (its peer closes): its streams end with it, not after
            await self._cancel([*tasks, *([idle] if idle is not None else [])])
            raise
        if idle is not None:
            idle.cancel()
            await asyncio.gather(idle, return_exceptions=True)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if self.owner is not None:
            await self.owner.close()
            self._measure(self.owner)
        await self.workers.drain()
        parts: dict[int, tuple[int, ...]] = {}
        refusals: list[Refusal] = []
        scores: PartScores | None = None
        notes = ["a part did not finish by the all-reduce deadline"] if pending else []
        for task in done:
            outcome = task.result()
            part = outcome.part if isinstance(outcome, SentPart) else self.me
            if outcome.contributors is not None:
                parts[part] = outcome.contributors
            if outcome.note:
                notes.append(outcome.note)
            refusals.extend(outcome.refusals)
            if isinstance(outcome, OwnedPart):
                scores = outcome.scores
        if parts:
            refusals.extend(await self._check_parts(parts, notes))
        sides = [*self.senders, *([self.owner] if self.owner is not None else [])]
        return RoundParts(
            parts,
            notes,
            tuple(refusals),
            sum(s.bytes_sent for s in sides),
            sum(s.bytes_received for s in sides),
            scores,
        )

    async def _cancel(self, tasks: list[asyncio.Task[Any]]) -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.owner is not None:
            await self.owner.close(deadline=time.monotonic())
        # chunks already in worker threads finish before the caller's buffers are reused
        await self.workers.drain()

    def _measure(self, owner: PartOwner) -> None:
        """File the upload rate of every sender whose stream of our part was read whole."""
        if self.rates is None:
            return
        for sender, t in owner.intake.completed_streams().items():
            rate = stream_upload_rate(
                t.bytes_after_first, t.chunks, t.elapsed, self.plan.streams(sender)
            )
            self.rates.observe(self.group.members[sender].peer_id, rate)

    async def _idle_owner(self, owner: PartOwner, sending: list[asyncio.Task[Any]]) -> None:
        """Once this member's own streams are over, its part's senders get a few floors to
        start (a member that excluded this one, or a plan that differs, never will)."""
        await asyncio.gather(*sending, return_exceptions=True)
        owner.expect_by(time.monotonic() + 4 * self.stall_floor)

    async def _check_parts(
        self, parts: dict[int, tuple[int, ...]], notes: list[str]
    ) -> list[Refusal]:
        """Refuse (drop from ``parts``) the parts whose average is not finite, or with
        ``check_owners`` implausible; accuse their owners. Nothing non-finite is ever applied."""
        deviations, lenient = await self.workers.run(self.staged.deviations, list(parts))
        judge = self.check_owners
        if judge and self.owner is not None and self.owner.reducer.own_clipped:
            # Its own values are the outliers of its own part: every honest average lies far
            # from them, by however far its values drifted in each part (which differs from part
            # to part), so distances from them tell nothing about the owners.
            logger.info("this member's values are the odd ones out: owners not judged this round")
            judge = False
        mixed = {j for j, averaged in parts.items() if any(m != self.me for m in averaged)}
        verdicts = (
            implausible_parts(deviations, mixed=mixed, contributors=parts, lenient=lenient)
            if judge
            else not_finite(deviations, lenient)
        )
        accused = []
        for j, why in verdicts.items():
            if j == self.me:  # this member computed its own part: only refuse it if not finite
                if why == NOT_FINITE:
                    del parts[j]
                    notes.append(f"own part {j}: {why}")
                continue
            del parts[j]
            owner = self.group.members[j].peer_id
            logger.warning("part %d: accusing owner %s: %s", j, owner.short, why)
            notes.append(f"part {j}: owner {owner.short} accused")
            accused.append(Refusal(owner, RefusalAction.ACCUSED, j, why))
        return accused

    def stop_serving(self) -> None:
        """This member's averager closes: its part's streams still read end now."""
        if self.owner is not None:
            self.owner.intake.stop()

    async def serve(
        self, request: InboundStream, reply: ReplyStream, sender: int, header: dict[str, object]
    ) -> None:
        """Serve a member's stream for this member's part (the averager's route calls it).

        Raises:
            TransportError / AuthError: the stream is refused or failed.
        """
        if self.owner is None:
            raise TransportError("this member owns no part", status=409)
        await self.owner.serve(request, reply, sender, dict(header))
