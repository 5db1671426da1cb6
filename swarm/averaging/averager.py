"""The averager: matchmaking, then a butterfly all-reduce, then the averaged values in place.

::

    averager = Averager(peer, AveragingConfig(codec="int8", target_group_size=8))
    result = await averager.average(model_tensors, weight=samples_since_last_round)
    if not result.averaged:
        logger.warning("training on alone: %s", result.reason)

Memory per round beyond the tensors, on the tensors' device: one float32 staging buffer the size
of the tensors, plus a float32 copy of them unless they are a single contiguous float32 tensor
(then it is read in place); both are reused across rounds. Lossy codecs add their error-feedback
residual (one float per element, kept across rounds) and the compressed payloads of one part.
Only encoded bytes cross to the CPU.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swarm.averaging.butterfly.allreduce import AllReduce, RoundParts
from swarm.averaging.butterfly.context import RoundContext
from swarm.averaging.butterfly.flat import FlatStaging, check_tensors, scatter
from swarm.averaging.butterfly.parts import (
    PartPlan,
    chunk_bytes_for,
    chunk_elems_for,
    effective_bandwidths,
    schema_hash,
)
from swarm.averaging.butterfly.reducer import check_weight
from swarm.averaging.butterfly.repair import Repair
from swarm.averaging.butterfly.residuals import FlatFeedback
from swarm.averaging.butterfly.rounds import RoundRegistry
from swarm.averaging.butterfly.stall import StallPolicy
from swarm.averaging.butterfly.workers import Workers
from swarm.averaging.faults import Fault, FaultInjector
from swarm.averaging.groups.group import GROUP_ID_BYTES, GroupInfo, matchmaking_key
from swarm.averaging.groups.liveness import Liveness
from swarm.averaging.groups.matchmaking import Matchmaker
from swarm.averaging.groups.planner import GroupPlanner, RoundKey
from swarm.averaging.groups.prober import Prober
from swarm.averaging.groups.rates import PeerRates
from swarm.averaging.result import Refusal, RoundResult
from swarm.compression import get_codec
from swarm.config import ROUND_CLEANUP_S, AveragingConfig
from swarm.errors import AuthError, AveragingError, ConfigError, TransportError
from swarm.identity import PeerID
from swarm.net.streams import InboundStream, ReplyStream
from swarm.protocols import Peer

logger = logging.getLogger(__name__)


class Averager:
    """Averages tensors with a group of peers of the swarm.

    Args:
        peer: a started peer (:class:`swarm.peer.Peer`).
        config: how groups form and how long a round may take (:class:`AveragingConfig`).
        prober: a started :class:`Prober` to share (several averagers on one peer); default: this
            averager starts its own (and closes it).
        fault: misbehaviour for tests (:class:`Fault`).

    Raises:
        ConfigError: an unknown codec.
    """

    def __init__(
        self,
        peer: Peer,
        config: AveragingConfig | None = None,
        *,
        prober: Prober | None = None,
        fault: Fault = Fault.NONE,
    ):
        config = config if config is not None else AveragingConfig()
        if not isinstance(config, AveragingConfig):
            raise ConfigError("config must be an AveragingConfig")
        self.codec = get_codec(config.codec)  # raises ConfigError for an unknown codec
        self.config = config
        # a leader waits this long for the members its plan expects (latency/random grouping)
        self.patience = config.matchmaking_timeout_s / 2
        self.peer = peer
        self.fault = fault
        self.faults = FaultInjector(fault)
        self.fault_triggered = self.faults.triggered  # set when ``fault`` fires (tests wait on it)
        self.stream_name = f"{config.name}.part"
        self.stall = StallPolicy(config.stall_timeout_min_s, config.stall_factor)
        self.liveness = Liveness(peer)  # checks members that keep a round waiting
        self.rates = PeerRates()  # others' upload as this peer's owner side measured it
        self.matchmaker = Matchmaker(
            peer,
            rpc_name=f"{config.name}.join",
            min_group_size=config.min_group_size,
            target_group_size=config.target_group_size,
            gather_window=config.gather_window_s or 0.0,
            liveness=self.liveness,
            rates=self.rates,
        )
        peer.transport.add_stream(self.stream_name, self._handle_part)
        if self.faults.active:
            announced = peer.transport.record().bandwidth
            peer.transport.update_record(bandwidth=self.faults.bandwidth(announced))
        self.current_group: GroupInfo | None = None  # the group of the round in progress
        # owners this peer accused of returning implausible averages: they own no part in this
        # peer's plans and their part streams are refused, for the rest of the run
        self.excluded: dict[PeerID, str] = {}
        self._chunk_elems: dict[int, int] = {}  # chunk bytes -> elements, for this codec
        self._pool = concurrent.futures.ThreadPoolExecutor(
            config.threads, thread_name_prefix="swarm-avg"
        )
        self._lock = asyncio.Lock()
        self._rounds = RoundRegistry()
        # error feedback per kind of round, so that rounds taking turns keep their own
        # residuals; staging buffers per fragment (see RoundKind)
        self._feedbacks: dict[RoundKind, FlatFeedback] = {}
        self._stagings: dict[tuple[str, bool], FlatStaging] = {}
        self._saved_feedback: dict[str, dict[str, Any]] = {}  # by fragment label, until used
        self.prober = prober  # RTT probes and this peer's Vivaldi coordinate
        self._own_prober = prober is None and config.grouping != "fixed"
        if self._own_prober:
            self.prober = Prober(
                peer, period=config.probe_period_s, probes=config.probes_per_period
            )
            self.prober.start()
        self.planner = GroupPlanner(peer, config, self.prober, self.liveness)
        self._closed = False

    # ---- public API

    async def average(
        self,
        tensors: Sequence[torch.Tensor],
        weight: float = 1.0,
        *,
        group_key: str | None = None,
        round_: int | None = None,
        sync: Sequence[torch.Tensor] | None = None,
        sync_every: int = 0,
        order: int | None = None,
        purpose: str = "",
        fragment: str = "",
    ) -> RoundResult:
        """Average ``tensors`` in place with a group (a failed round is a result, not an error).

        Args:
            tensors: contiguous float tensors (any device); the same shapes and dtypes on every
                peer that should group with this one.
            weight: this peer's weight in the mean, e.g. samples processed since the last round.
            group_key: matchmaking key of this round; overrides the averager's ``grouping``.
            round_: the round number, the same on every peer (e.g. the training round): it
                decides which rounds mix regions and is part of the keys, so peers of different
                rounds never group. Default: this averager's count of calls, which is not
                part of the keys (peers that joined at different times still group).
            order: the round this peer believes the swarm is at (e.g. the training round,
                which a joiner copies from the peers it downloads from); it orders the planned
                groups like ``round_`` but is not part of the keys. The averager plans with the
                larger of it and its own order: one more than the last round it planned, or
                than the largest order of a group it was in (groups carry their members'
                largest, so peers fall back in step after failed rounds or a restart).
            purpose: what the tensors are, when peers average several kinds of the same shapes
                (e.g. "values" for the parameters themselves, "" for training rounds): rounds
                of different purposes never group.
            fragment: which fragment of the model the tensors are (Streaming DiLoCo: rounds
                take turns over fragments); rounds of different fragments never group, and each
                fragment keeps its own error feedback.
            sync / sync_every: more tensors (e.g. DiLoCo anchors) that about one group in
                ``sync_every`` averages as well, in a second all-reduce right after the first
                (its own error feedback; the choice comes from the group id, so every member
                makes the same one). Only peers with the same ``sync_every`` group together.

        Returns:
            A :class:`RoundResult`: which parts were averaged with whom, bytes, timings.

        Raises:
            AveragingError: invalid tensors or weight, or the averager is closed.
        """
        tensors = list(tensors)
        check_tensors(tensors)
        weight = check_weight(weight)
        if self._closed:
            raise AveragingError("the averager is closed")
        numel = sum(t.numel() for t in tensors)
        syncing = list(sync) if sync is not None and sync_every > 0 else []
        check_tensors(syncing)
        async with self._lock:
            started = time.monotonic()
            planned = RoundKey(group_key) if group_key else await self.planner.plan(round_, order)
            if planned.key is None:
                return RoundResult(False, planned.idle, matchmaking_s=time.monotonic() - started)
            # peers that would cut the vector differently never group
            spec = f"{self.codec.spec}|share={self.config.max_share:g}"
            if purpose:
                spec += f"|for={purpose}"
            if fragment:
                spec += f"|fragment={fragment}"
            if syncing:
                spec += f"|sync={sync_every}:{schema_hash(syncing, '')}"
            key = matchmaking_key(self.peer.run_id, planned.key, schema_hash(tensors, spec))
            group = await self.matchmaker.form_group(
                key,
                self.config.matchmaking_timeout_s,
                expected=planned.expected,
                # a one-off round (another purpose) waits the whole patience: its members arrive
                # when their training rounds end, not as the regular rounds' arrivals suggest
                patience=self.patience if purpose else self.matchmaker.patience(self.patience),
                leader=planned.leader,
                planned=planned.members,
                order=planned.order,
            )
            matchmaking_s = time.monotonic() - started
            self.planner.forget(self.liveness.gone)
            if isinstance(group, str):
                logger.info("round not averaged: %s", group)
                return RoundResult(False, group, matchmaking_s=matchmaking_s)
            self.planner.joined(group)
            deadline = started + self.config.round_timeout_s - ROUND_CLEANUP_S
            kind = RoundKind(purpose, fragment)
            result = await self._allreduce(
                tensors, numel, weight, group, matchmaking_s, deadline, kind
            )
            if not syncing or not syncs(group, sync_every):
                return result
            # the same members average the synced tensors under a derived group id
            derived = dataclasses.replace(
                group, group_id=hashlib.sha256(b"sync" + group.group_id).digest()[:GROUP_ID_BYTES]
            )
            synced = await self._allreduce(
                syncing,
                sum(t.numel() for t in syncing),
                weight,
                derived,
                0.0,
                deadline,
                dataclasses.replace(kind, synced=True),
            )
            return dataclasses.replace(
                result,
                synced=synced.averaged,
                bytes_sent=result.bytes_sent + synced.bytes_sent,
                bytes_received=result.bytes_received + synced.bytes_received,
                allreduce_s=result.allreduce_s + synced.allreduce_s,
            )

    @property
    def order(self) -> int:
        """The round order this peer's next round plans with (late joiners copy it)."""
        return self.planner.order

    def adopt_order(self, order: int, base: int) -> None:
        """Plan from the round order of the peers this joiner's state came from (see
        :meth:`GroupPlanner.adopt`), so that its first plans match theirs."""
        self.planner.adopt(order, base)

    def state_dict(self) -> dict[str, Any]:
        """Error-feedback state of the training rounds (of every fragment), for checkpoints."""
        saved = {
            kind.fragment: fb.state_dict() for kind, fb in self._feedbacks.items() if kind.saved
        }
        whole = saved.pop("", None)
        return {"feedback": whole, "fragments": saved} if saved else {"feedback": whole}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (applied when the tensors' size is known)."""
        if not isinstance(state, dict):
            return
        fragments = state.get("fragments")
        saved = dict(fragments) if isinstance(fragments, dict) else {}
        saved[""] = state.get("feedback")
        self._saved_feedback = {
            k: v for k, v in saved.items() if isinstance(k, str) and isinstance(v, dict)
        }
        for kind, fb in self._feedbacks.items():
            if kind.saved and kind.fragment in self._saved_feedback:
                fb.load_state_dict(self._saved_feedback[kind.fragment])

    async def close(self) -> None:
        """Stop serving, cancel background work and release the worker threads."""
        self._closed = True
        self._rounds.close()
        if self.prober is not None and self._own_prober:
            await self.prober.close()
        await self.matchmaker.close()
        await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown, True)

    async def __aenter__(self) -> Averager:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ---- one round

    async def _allreduce(
        self,
        tensors: list[torch.Tensor],
        numel: int,
        weight: float,
        group: GroupInfo,
        matchmaking_s: float,
        deadline: float,
        kind: RoundKind,
    ) -> RoundResult:
        loop = asyncio.get_running_loop()
        me = group.index_of(self.peer.peer_id)
        plan = self._plan(group, numel)
        staging = self._stagings.setdefault(kind.staging, FlatStaging())
        flat, result = await loop.run_in_executor(self._pool, staging.gather, tensors, numel)
        flat, weight = self.faults.contribution(flat), self.faults.weight(weight)
        started = time.monotonic()
        ctx = RoundContext(
            group=group,
            me=me,
            weight=weight,
            feedback=self._feedback_for(numel, flat.device, kind),
            workers=Workers(self._pool),
            stall=self.stall,
            deadline=deadline,
            faults=self.faults,
            aggregator=self.config.aggregator,
            weight_cap=self.config.weight_cap,
            excluded=self._excluded_in(group),
            liveness=self.liveness,
            rates=self.rates,
        )
        self.current_group = group
        try:
            outcome = await self._run(ctx, plan, flat, result)
        finally:
            self.current_group = None
        repair = Repair.plan(group, plan, me, set(outcome.parts))
        if repair is not None:
            outcome = await self._repair(repair, ctx, outcome, flat, result, started)
        self._rounds.settle(group.group_id)  # a repair that did not start here never will
        self.planner.forget(self.liveness.gone)
        parts_idx, notes = outcome.parts, outcome.notes
        refusals = [
            Refusal(m.peer_id, "excluded", -1, self.excluded[m.peer_id])
            for m in group.members
            if m.peer_id in self.excluded
        ]
        if not kind.synced:
            refusals.extend(unbelieved_claims(group))
        for r in outcome.refusals:
            refusals.append(r)
            if r.action == "accused" and r.peer not in self.excluded:
                self.excluded[r.peer] = f"accused in round {group.group_id.hex()[:8]}: {r.why}"
        ranges = [plan.ranges[j] for j in sorted(parts_idx)]
        await loop.run_in_executor(self._pool, scatter, tensors, result, ranges)
        allreduce_s = time.monotonic() - started
        ids = group.peer_ids
        parts = {j: tuple(ids[i] for i in idx) for j, idx in sorted(parts_idx.items())}
        averaged = any(len(p) > 1 for p in parts.values())
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
        )

    def _plan(self, group: GroupInfo, numel: int) -> PartPlan:
        bandwidths = effective_bandwidths(group.bandwidths, group.measured)
        # an owner this peer accused owns nothing in its plan (and its streams are refused)
        for i, m in enumerate(group.members):
            if m.peer_id in self.excluded:
                bandwidths[i] = 0.0
        chunk_bytes = chunk_bytes_for(group.measured, len(group.members))
        chunk_elems = self._chunk_elems.get(chunk_bytes)
        if chunk_elems is None:
            chunk_elems = self._chunk_elems[chunk_bytes] = chunk_elems_for(self.codec, chunk_bytes)
        return PartPlan.create(numel, bandwidths, chunk_elems, self.config.max_share)

    def _excluded_in(self, group: GroupInfo) -> frozenset[int]:
        return frozenset(i for i, m in enumerate(group.members) if m.peer_id in self.excluded)

    async def _run(
        self, ctx: RoundContext, plan: PartPlan, flat: torch.Tensor, result: torch.Tensor
    ) -> RoundParts:
        """One all-reduce of ``ctx.group``, registered so that its members' streams find it."""
        round_ = AllReduce(
            self.peer.transport, self.stream_name, ctx, plan, flat, result, self.config.check_owners
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
        result: torch.Tensor,
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
        sub_result = torch.empty_like(sub)
        plan = self._plan(repair.group, repair.numel)
        sub_ctx = dataclasses.replace(
            ctx,
            group=repair.group,
            me=repair.group.index_of(self.peer.peer_id),
            # its residuals would not line up with the round's: this short vector goes without
            feedback=FlatFeedback(self.codec, repair.numel, sub.device),
            deadline=deadline,
            excluded=self._excluded_in(repair.group),
            parent=ctx.group.group_id,
            gone=set(),
            suspected={},
        )
        fixed = await self._run(sub_ctx, plan, sub, sub_result)
        parts = repair.repaired(plan, fixed.parts, ctx.group)
        if parts:
            await loop.run_in_executor(self._pool, repair.scatter, sub_result, result, set(parts))
        notes = [f"part {j} averaged again among {len(c)} peers" for j, c in parts.items()]
        if len(parts) < len(repair.parts):
            notes.append(f"{len(repair.parts) - len(parts)} failed part(s) kept local values")
        return RoundParts(
            {**outcome.parts, **parts},
            [*outcome.notes, *notes],
            (*outcome.refusals, *fixed.refusals),
            outcome.bytes_sent + fixed.bytes_sent,
            outcome.bytes_received + fixed.bytes_received,
        )

    def _feedback_for(self, numel: int, device: torch.device, kind: RoundKind) -> FlatFeedback:
        """The error feedback of one kind of round, new when its size moved."""
        fb = self._feedbacks.get(kind)
        if fb is None or fb.numel != numel or fb.device != device:
            fb = self._feedbacks[kind] = FlatFeedback(self.codec, numel, device)
            if kind.saved and kind.fragment in self._saved_feedback:
                fb.load_state_dict(self._saved_feedback[kind.fragment])
        return fb

    # ---- serving part streams

    async def _handle_part(self, request: InboundStream, reply: ReplyStream) -> None:
        header = request.header
        group_id, parent = header.get("g"), header.get("r")
        if not _is_group_id(group_id):
            raise TransportError("part stream without a valid group id", status=400)
        if parent is not None and not _is_group_id(parent):
            raise TransportError("part stream with an invalid parent group id", status=400)
        round_ = await self._rounds.find(group_id, parent)
        if round_ is None:
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
            raise AuthError(f"{request.sender.peer_id.short} is excluded: it was accused")
        await round_.serve(request, reply, sender, header)


def unbelieved_claims(group: GroupInfo) -> list[Refusal]:
    """The members that plans size by less than half the bandwidth they announced: measured
    lower than they claim, or never measured and claiming more than twice the median."""
    planned = effective_bandwidths(group.bandwidths, group.measured)
    measured = group.measured or (0.0,) * len(group.members)
    return [
        Refusal(
            m.peer_id,
            "bandwidth-capped",
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


def syncs(group: GroupInfo, every: int) -> bool:
    """Whether ``group`` also averages the synced tensors: one group in about ``every``,
    decided by its id, which every member knows."""
    return every > 0 and int.from_bytes(group.group_id[:4], "big") % every == 0
