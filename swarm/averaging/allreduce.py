"""Butterfly all-reduce of one group: reduce-scatter, then all-gather, on the same streams.

Member ``i`` owns part ``i`` of the flat vector (:class:`~swarm.averaging.plan.PartPlan`): its
:class:`~swarm.averaging.owner.PartOwner` reduces what the others stream to it and streams the
average back chunk by chunk, while one :class:`~swarm.averaging.sender.PartSender` per other
part streams this member's share to that part's owner and stages the average it returns. All of
a member's streams are in flight at once; tensor work runs in worker threads. A part whose owner
fails keeps this member's own values: nothing half-received is ever applied.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass

import torch

from swarm.averaging.context import RoundContext
from swarm.averaging.faults import FaultInjector
from swarm.averaging.feedback import FlatFeedback
from swarm.averaging.group import GroupInfo
from swarm.averaging.outcome import OwnedPart, SentPart
from swarm.averaging.owner import PartOwner
from swarm.averaging.plan import PartPlan
from swarm.averaging.sender import PartSender
from swarm.averaging.stall import StallPolicy
from swarm.averaging.workers import Workers
from swarm.errors import TransportError
from swarm.net.streams import InboundStream, ReplyStream
from swarm.protocols import StreamTransport


@dataclass(frozen=True)
class RoundParts:
    """What one member's all-reduce produced."""

    parts: dict[int, tuple[int, ...]]  # part -> member indices averaged (missing: kept own)
    notes: list[str]  # what went wrong, part by part
    bytes_sent: int
    bytes_received: int


class AllReduce:
    """One member's side of one group's all-reduce.

    Args:
        transport: the peer's transport.
        stream_name: the route of part streams.
        group: the agreed group; ``me`` is this peer's index in it.
        plan: the part plan derived from the group.
        flat: this peer's values (float32, contiguous, any device); read-only during the round.
        result: staging buffer of the same size; part ``j`` is valid when :meth:`run` says so.
        weight: this peer's weight.
        feedback: error-feedback residuals of this averager.
        pool: thread pool for tensor work.
        stall: when to drop a silent peer.
        deadline: monotonic time by which the all-reduce ends.
        faults: this averager's fault hooks.
    """

    def __init__(
        self,
        transport: StreamTransport,
        stream_name: str,
        group: GroupInfo,
        me: int,
        plan: PartPlan,
        flat: torch.Tensor,
        result: torch.Tensor,
        weight: float,
        feedback: FlatFeedback,
        pool: concurrent.futures.ThreadPoolExecutor,
        stall: StallPolicy,
        deadline: float,
        faults: FaultInjector,
    ):
        self.group, self.me, self.deadline = group, me, deadline
        ctx = RoundContext(group, me, weight, feedback, Workers(pool), stall, deadline, faults)
        self.workers = ctx.workers
        start, end = plan.ranges[me]
        self.owner: PartOwner | None = None
        if end > start:
            rel = tuple((s - start, e - start) for s, e in plan.chunks(me))
            self.owner = PartOwner(ctx, flat[start:end], result[start:end], rel, start)
        self.senders = [
            PartSender(ctx, transport, stream_name, j, plan.chunks(j), flat, result)
            for j in plan.owned()
            if j != me
        ]

    async def run(self) -> RoundParts:
        """Run the all-reduce; never raises for a failed peer."""
        tasks: list[asyncio.Task[OwnedPart | SentPart]] = [
            asyncio.create_task(s.run(), name=f"swarm-send-{s.part}") for s in self.senders
        ]
        if self.owner is not None:
            tasks.append(asyncio.create_task(self.owner.run(), name="swarm-own-part"))
        remaining = max(0.0, self.deadline - time.monotonic())
        done, pending = await asyncio.wait(tasks, timeout=remaining + 1.0)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if self.owner is not None:
            await self.owner.close()
        await self.workers.drain()
        parts: dict[int, tuple[int, ...]] = {}
        notes = ["a part did not finish by the all-reduce deadline"] if pending else []
        for task in done:
            outcome = task.result()
            part = outcome.part if isinstance(outcome, SentPart) else self.me
            if outcome.contributors is not None:
                parts[part] = outcome.contributors
            if outcome.note:
                notes.append(outcome.note)
        sides = [*self.senders, *([self.owner] if self.owner is not None else [])]
        return RoundParts(
            parts,
            notes,
            sum(s.bytes_sent for s in sides),
            sum(s.bytes_received for s in sides),
        )

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
