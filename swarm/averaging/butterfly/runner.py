"""One peer's side of the all-reduces its groups run: plans, staging, error feedback, repairs,
the owners it excluded, and the route that serves other members' part streams.

:class:`~swarm.averaging.averager.Averager` forms a group (:mod:`swarm.averaging.groups`), then
hands it here: :meth:`ButterflyRunner.allreduce` plans the parts (sized by measured bandwidth,
nothing sent to an owner it excluded), runs the butterfly (:class:`AllReduce`), averages the parts
that failed again among the members left (:class:`Repair`), and writes only averaged parts back
into the tensors.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from swarm.averaging.butterfly.allreduce import AllReduce, RoundParts
from swarm.averaging.butterfly.context import RoundContext
from swarm.averaging.butterfly.echoes import UpdateHistory
from swarm.averaging.butterfly.exclusions import Exclusions
from swarm.averaging.butterfly.flat import FlatStaging
from swarm.averaging.butterfly.kept import KeptRanges
from swarm.averaging.butterfly.pairs import is_pairwise
from swarm.averaging.butterfly.parts import (
    PartPlan,
    chunk_bytes_for,
    chunk_elems_for,
    effective_bandwidths,
)
from swarm.averaging.butterfly.repair import Repair
from swarm.averaging.butterfly.residuals import FlatFeedback
from swarm.averaging.butterfly.rounds import RoundRegistry
from swarm.averaging.butterfly.scoring import LOWERED_BELOW, PartScores, Reputation
from swarm.averaging.butterfly.staged import StagedAverages, stage_decoded
from swarm.averaging.butterfly.stall import StallPolicy
from swarm.averaging.butterfly.workers import Workers
from swarm.averaging.faults import FaultInjector
from swarm.averaging.groups.apart import KeptApart
from swarm.averaging.groups.group import GROUP_ID_BYTES, GroupInfo
from swarm.averaging.groups.liveness import Liveness
from swarm.averaging.groups.rates import PeerRates
from swarm.averaging.result import Refusal, RefusalAction, RoundResult
from swarm.compression import Codec
from swarm.config import AveragingConfig
from swarm.errors import GONE, AuthError, AveragingError, TransportError
from swarm.net.streams import InboundStream, ReplyStream
from swarm.protocols import Peer

logger = logging.getLogger(__name__)


class ButterflyRunner:
    """Runs this peer's all-reduces and serves its part streams (route ``{name}.part``).

    Args:
        peer: a started peer.
        config: the averager's settings (aggregator, weight cap, shares, owner checks, stalls).
        codec: what parts travel in.
        pool: the averager's worker threads (tensor work off the event loop).
        faults: misbehaviour injected by tests.
        liveness: checks members that keep a round waiting.
        rates: others' upload as this peer's owner side measured it.
    """

    def __init__(
        self,
        peer: Peer,
        config: AveragingConfig,
        codec: Codec,
        pool: concurrent.futures.ThreadPoolExecutor,
        faults: FaultInjector,
        liveness: Liveness,
        rates: PeerRates,
    ):
        self.peer = peer
        self.config = config
        self.codec = codec
        self.faults = faults
        self.liveness = liveness
        self.rates = rates
        self.stream_name = f"{config.name}.part"
        self.stall = StallPolicy(config.stall_timeout_min_s, config.stall_factor)
        # owners this peer accused of returning implausible averages: it sends them nothing and
        # refuses their part streams, for a number of its rounds that doubles with each accusation
        self.excluded = Exclusions()
        # the peers this one will not be grouped with: those it excludes or that refused it
        self.apart = KeptApart()
        # this peer's record of the others' updates: the factor on their weight in its parts
        self.reputation = Reputation()
        self.history = UpdateHistory()  # the updates it applied lately (see butterfly.echoes)
        # the ranges this peer kept its own values of lately, per layout: a round of values
        # holds their averages to the blatant bound only (see butterfly.kept)
        self.kept = KeptRanges()
        # error feedback per kind of round, so that rounds taking turns keep their own
        # residuals; staging buffers per fragment (see RoundKind)
        self.feedbacks: dict[RoundKind, FlatFeedback] = {}
        self.saved_feedback: dict[str, dict[str, Any]] = {}  # by fragment label, until used
        self._stagings: dict[tuple[str, bool], FlatStaging] = {}
        self._chunk_elems: dict[tuple[str, int], int] = {}  # (codec, chunk bytes) -> elements
        self._pool = pool
        self._rounds = RoundRegistry()
        peer.transport.add_stream(self.stream_name, self.handle_part)

    def close(self) -> None:
        """Refuse part streams from now on."""
        self._rounds.close()

    async def allreduce(
        self,
        tensors: list[torch.Tensor],
        numel: int,
        weight: float,
        group: GroupInfo,
        matchmaking_s: float,
        deadline: float,
        kind: RoundKind,
        codec: Codec | None = None,
        updates: bool = False,
        keep_unsent: bool = False,
        order: int | None = None,
    ) -> RoundResult:
        """Average ``tensors`` (``numel`` values) in place with ``group``, by ``deadline``
        (monotonic), in ``codec`` (default: the averager's); only the parts that averaged are
        written back. With ``updates`` the tensors are updates (pseudo-gradients): the parts
        this peer owns score and weigh their senders by its record of them (unless the
        averager's ``score_updates`` is off); with ``keep_unsent`` too, the caller keeps what
        its payloads leave out (``RoundResult.unsent``), so none is carried to this round;
        ``order``: the round order to claim in this peer's streams (``RoundResult.orders``)."""
        self.excluded.start_round()
        score = updates and self.config.score_updates
        codec = codec if codec is not None else self.codec
        loop = asyncio.get_running_loop()
        me = group.index_of(self.peer.peer_id)
        plan = self._plan(group, numel, codec)
        staging = self._stagings.setdefault(kind.staging, FlatStaging())
        gathered, in_place = await loop.run_in_executor(self._pool, staging.gather, tensors, numel)
        # a faulty contribution (tests' attackers) is a tensor of its own: the average still
        # lands in the tensors
        flat = self.faults.contribution(gathered, updates)
        weight = self.faults.weight(weight)
        started = time.monotonic()
        layout = (kind.fragment, numel)
        feedback = self.feedback_for(numel, flat.device, kind, codec)
        ctx = RoundContext(
            group=group,
            me=me,
            weight=weight,
            feedback=feedback,
            workers=Workers.for_chunks(self._pool, plan.largest_chunk(), flat.device),
            stall=self.stall,
            deadline=deadline,
            faults=self.faults,
            aggregator=self.config.aggregator,
            weight_cap=self.config.weight_cap,
            excluded=self._excluded_in(group),
            liveness=self.liveness,
            rates=self.rates,
            updates=updates,
            score=score,
            trust=self._trust_in(group, me) if score else {},
            echo=self.history.sample(layout, numel) if score else None,
            kept=() if updates else self.kept.recent(layout),
            accused=frozenset(
                i for i, m in enumerate(group.members) if self.excluded.accused(m.peer_id)
            ),
            pairwise=is_pairwise(updates, codec, len(group.members)),
            order=order,
        )
        into = staging.result(numel, flat.device) if stage_decoded(codec) else None
        staged = StagedAverages(flat, ctx.kept, ctx.accused, into, codec.name)
        owes = updates and ctx.feedback.enabled  # a residual of what this peer's payloads left out
        if owes and keep_unsent:
            await loop.run_in_executor(self._pool, ctx.feedback.drop_sent, [(0, numel)])
        outcome = await self._run(ctx, plan, flat, staged)
        # (the own part too where this peer sent it as a payload of its own: in a pair)
        kept = [
            plan.ranges[j]
            for j in range(len(plan))
            if (j != me or ctx.pairwise) and j not in outcome.parts
        ]
        if owes and kept:  # where this peer keeps its own values, nothing left out is owed
            await loop.run_in_executor(self._pool, ctx.feedback.drop_sent, kept)
        repair = Repair.plan(group, plan, me, set(outcome.parts))
        if repair is not None:
            outcome = await self._repair(repair, ctx, outcome, flat, staged, started)
        self._rounds.settle(group.group_id)  # a repair that did not start here never will
        parts_idx, notes = outcome.parts, outcome.notes
        if not kind.synced:  # a sync's failed part leaves the anchors as they were
            alone = [plan.ranges[j] for j in plan.owned() if len(parts_idx.get(j, ())) < 2]
            self.kept.record(layout, alone, any(len(c) > 1 for c in parts_idx.values()))
        refusals = [
            Refusal(m.peer_id, RefusalAction.EXCLUDED, -1, self.excluded.why(m.peer_id))
            for m in group.members
            if m.peer_id in self.excluded
        ]
        for peer in [r.peer for r in refusals] + [group.peer_ids[j] for j in ctx.refused_us]:
            self.apart.add(peer)
        if not kind.synced:
            refusals.extend(unbelieved_claims(group))
        refusals.extend(self._file_scores(group, outcome.scores))
        for r in outcome.refusals:
            refusals.append(r)
            if r.action is RefusalAction.ACCUSED and r.peer not in self.excluded:
                why = f"accused in round {group.group_id.hex()[:8]}: {r.why}"
                if self.excluded.accuse(r.peer, why):
                    logger.warning("excluding %s: accused again (%s)", r.peer.short, r.why)
                    self.apart.add(r.peer)
        targets = [gathered] if in_place else tensors
        await loop.run_in_executor(self._pool, staged.apply, targets, sorted(parts_idx))
        allreduce_s = time.monotonic() - started
        ids = group.peer_ids
        parts = {j: tuple(ids[i] for i in idx) for j, idx in sorted(parts_idx.items())}
        averaged = any(len(p) > 1 for p in parts.values())
        if score and averaged:  # a gather of at most SAMPLE values: no need for a thread
            self.history.record(layout, targets)
        reason = "; ".join(notes[:4]) if notes else ""
        if not averaged and not reason:
            reason = "no part was averaged"
        logger.info(
            "round %s: %d peers, %d/%d parts averaged, %.2f s + %.2f s%s%s",
            group.group_id.hex()[:8],
            len(ids),
            len(parts),
            len(plan.owned()),
            matchmaking_s,
            allreduce_s,
            f" ({reason})" if reason else "",
            f"; refused: {'; '.join(map(str, refusals))}" if refusals else "",
        )
        return RoundResult(
            averaged=averaged,
            reason=reason,
            group_id=group.group_id,
            members=ids,
            parts=parts,
            bytes_sent=outcome.bytes_sent,
            bytes_received=outcome.bytes_received,
            matchmaking_s=matchmaking_s,
            allreduce_s=allreduce_s,
            refusals=tuple(refusals),
            trust={p: self.reputation.trust(p) for p in ids if p != self.peer.peer_id}
            if score
            else {},
            unsent=ctx.feedback.unsent() if updates else None,
            orders=tuple(ctx.orders.values()),
        )

    def _plan(self, group: GroupInfo, numel: int, codec: Codec) -> PartPlan:
        """The group's plan: every member computes the same one from the group's agreed info
        (this peer's own exclusions change what it sends, never the plan)."""
        bandwidths = effective_bandwidths(group.bandwidths, group.measured)
        chunk_bytes = chunk_bytes_for(group.measured, len(group.members))
        chunk_elems = self._chunk_elems.get((codec.spec, chunk_bytes))
        if chunk_elems is None:
            chunk_elems = chunk_elems_for(codec, chunk_bytes)
            self._chunk_elems[(codec.spec, chunk_bytes)] = chunk_elems
        # with update scoring the layout turns with every group, so that each member's part
        # covers a different slice of the model from round to round: an owner's record of a
        # member then measures its whole update over time, not always the same layer
        first = 0
        if self.config.score_updates:
            first = int.from_bytes(group.group_id[:4], "big") % len(group.members)
        return PartPlan.create(numel, bandwidths, chunk_elems, self.config.max_share, first)

    def _trust_in(self, group: GroupInfo, me: int) -> dict[int, float]:
        return {i: self.reputation.trust(m.peer_id) for i, m in enumerate(group.members) if i != me}

    def _file_scores(self, group: GroupInfo, scores: PartScores | None) -> list[Refusal]:
        """File this round's alignments in the record; the members whose record is now low."""
        if scores is None:
            return []
        peers = {i: m.peer_id for i, m in enumerate(group.members)}
        lowered = []
        for i, standing in self.reputation.observe(scores, peers).items():
            if standing.trust < LOWERED_BELOW:
                text = f"weight x{standing.trust:.2f} after {standing.rounds} scored rounds"
                lowered.append(
                    Refusal(
                        peers[i],
                        RefusalAction.DOWNWEIGHTED,
                        i,
                        f"{text} ({standing.low or standing.why})",
                    )
                )
        return lowered

    def _excluded_in(self, group: GroupInfo) -> frozenset[int]:
        return frozenset(i for i, m in enumerate(group.members) if m.peer_id in self.excluded)

    async def _run(
        self, ctx: RoundContext, plan: PartPlan, flat: torch.Tensor, staged: StagedAverages
    ) -> RoundParts:
        """One all-reduce of ``ctx.group``, registered so that its members' streams find it."""
        round_ = AllReduce(
            self.peer.transport, self.stream_name, ctx, plan, flat, staged, self.config.check_owners
        )
        self._rounds.start(ctx.group.group_id, round_)
        try:
            return await round_.run()
        finally:
            self._rounds.end(ctx.group.group_id)

    async def _repair(
        self,
        repair: Repair,
        ctx: RoundContext,
        outcome: RoundParts,
        flat: torch.Tensor,
        staged: StagedAverages,
        started: float,
    ) -> RoundParts:
        """Average the round's failed parts again among the members left (see
        :mod:`swarm.averaging.butterfly.repair`); the outcome with the parts that it averaged."""
        now = time.monotonic()
        # it moves less than the round did; a member that never joins must not hold it long
        deadline = min(ctx.deadline, now + 2 * (now - started) + 4 * self.stall.floor_s)
        if deadline - now < self.stall.floor_s:
            return outcome
        loop = asyncio.get_running_loop()
        sub = await loop.run_in_executor(self._pool, repair.gather, flat)
        codec = ctx.feedback.codec
        plan = self._plan(repair.group, repair.numel, codec)
        sub_ctx = dataclasses.replace(
            ctx,
            group=repair.group,
            me=repair.group.index_of(self.peer.peer_id),
            # its residuals would not line up with the round's: this short vector goes without
            feedback=FlatFeedback(codec, repair.numel, sub.device),
            deadline=deadline,
            excluded=self._excluded_in(repair.group),
            trust=self._trust_in(repair.group, repair.group.index_of(self.peer.peer_id))
            if ctx.score
            else {},
            score=False,  # scores are filed from the round itself
            kept=(),  # its vector is laid out otherwise
            parent=ctx.group.group_id,
            gone=set(),
            suspected={},
        )
        sub_staged = StagedAverages(sub, sub_ctx.kept, sub_ctx.accused, codec=codec.name)
        fixed = await self._run(sub_ctx, plan, sub, sub_staged)
        parts = repair.repaired(plan, fixed.parts, ctx.group)
        if parts:
            await loop.run_in_executor(
                self._pool, repair.stage, sub_staged, fixed.parts, staged, set(parts)
            )
        notes = [f"part {j} averaged again among {len(c)} peers" for j, c in parts.items()]
        if len(parts) < len(repair.parts):
            notes.append(f"{len(repair.parts) - len(parts)} failed part(s) kept local values")
        return RoundParts(
            {**outcome.parts, **parts},
            [*outcome.notes, *notes],
            (*outcome.refusals, *fixed.refusals),
            outcome.bytes_sent + fixed.bytes_sent,
            outcome.bytes_received + fixed.bytes_received,
            outcome.scores,
        )

    def feedback_for(
        self, numel: int, device: torch.device, kind: RoundKind, codec: Codec | None = None
    ) -> FlatFeedback:
        """The error feedback of one kind of round, new when its size or codec moved."""
        codec = codec if codec is not None else self.codec
        fb = self.feedbacks.get(kind)
        if fb is None or fb.numel != numel or fb.device != device or fb.codec.spec != codec.spec:
            turning = self.config.score_updates
            # only training rounds add up what was rounded off: see residuals.py
            fb = self.feedbacks[kind] = FlatFeedback(codec, numel, device, turning, kind.saved)
            if kind.saved and kind.fragment in self.saved_feedback:
                fb.load_state_dict(self.saved_feedback[kind.fragment])
        return fb

    async def handle_part(self, request: InboundStream, reply: ReplyStream) -> None:
        """Route ``{name}.part``: a member's stream of one part, for the round it names."""
        header = request.header
        group_id, parent = header.get("g"), header.get("r")
        if not _is_group_id(group_id):
            raise TransportError("part stream without a valid group id", status=400)
        if parent is not None and not _is_group_id(parent):
            raise TransportError("part stream with an invalid parent group id", status=400)
        round_ = await self._rounds.find(group_id, parent)
        if round_ is None:
            if self._rounds.closed:  # this peer is leaving: nothing the sender did
                raise TransportError("this member's averager is closed", status=GONE)
            raise TransportError("unknown or finished group", status=404)
        try:
            sender = round_.group.index_of(request.sender.peer_id)
        except AveragingError:
            raise AuthError(
                f"{request.sender.peer_id.short} is not a member of group {group_id.hex()[:8]}"
            ) from None
        if sender == round_.me:
            raise AuthError("a member does not stream to itself")
        if request.sender.peer_id in self.excluded:
            # 403, not 401: the sender learns that this member sends nothing to its part either
            # (and stops waiting for it) rather than that its credentials failed
            raise TransportError(
                f"{request.sender.peer_id.short} is excluded: it was accused", status=403
            )
        await round_.serve(request, reply, sender, header)


def unbelieved_claims(group: GroupInfo) -> list[Refusal]:
    """The members that plans size by less than half the bandwidth they announced: measured
    lower than they claim, or never measured and claiming more than twice the median."""
    planned = effective_bandwidths(group.bandwidths, group.measured)
    measured = group.measured or (0.0,) * len(group.members)
    return [
        Refusal(
            m.peer_id,
            RefusalAction.BANDWIDTH_CAPPED,
            -1,
            f"announced {m.bandwidth:.3g} B/s, planned with {bw:.3g} B/s "
            + ("(measured)" if rate > 0 else "(not measured yet: the group's median claim)"),
        )
        for m, bw, rate in zip(group.members, planned, measured, strict=True)
        if bw < m.bandwidth / 2
    ]


def _is_group_id(value: object) -> bool:
    return isinstance(value, bytes) and len(value) == GROUP_ID_BYTES


@dataclass(frozen=True)
class RoundKind:
    """What an all-reduce averages; it keys the error feedback and staging buffers."""

    purpose: str  # "" for training rounds (see ``average``)
    fragment: str  # the model fragment ("" for a whole model)
    synced: bool = False  # the synced tensors (anchors) rather than the averaged ones

    @property
    def saved(self) -> bool:
        """Checkpoints keep its residuals: a training round's averaged tensors."""
        return not self.purpose and not self.synced

    @property
    def staging(self) -> tuple[str, bool]:
        """Its staging buffers: one-off rounds of another purpose reuse the training rounds'
        (the same tensors, so the same sizes)."""
        return self.fragment, self.synced
