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
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from swarm.averaging import regions
from swarm.averaging.allreduce import AllReduce
from swarm.averaging.context import RoundContext
from swarm.averaging.faults import Fault, FaultInjector
from swarm.averaging.feedback import FlatFeedback
from swarm.averaging.group import GROUP_ID_BYTES, GroupInfo, matchmaking_key
from swarm.averaging.matchmaking import Matchmaker
from swarm.averaging.plan import PartPlan, chunk_elems_for, schema_hash
from swarm.averaging.prober import Prober
from swarm.averaging.reducer import check_weight
from swarm.averaging.result import Refusal, RoundResult
from swarm.averaging.stall import StallPolicy
from swarm.averaging.workers import Workers
from swarm.compression import get_codec
from swarm.config import ROUND_CLEANUP_S, AveragingConfig
from swarm.errors import AuthError, AveragingError, ConfigError, TransportError
from swarm.identity import PeerID
from swarm.net.record import PeerRecord
from swarm.net.streams import InboundStream, ReplyStream
from swarm.protocols import Peer

logger = logging.getLogger(__name__)

_UNKNOWN_GROUP_WAIT_S = 5.0  # a member may start streaming before we heard the group closed
_RECENT_GROUPS = 64  # finished groups remembered, and groups awaited before they start


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
        self.grouping = config.grouping
        self.grouping_config = regions.GroupingConfig(
            config.min_group_size,
            config.target_group_size,
            cross_every=config.cross_every,
            region_rtt=config.region_rtt_s,
        )
        # a leader waits this long for the members its plan expects (latency/random grouping)
        self.patience = config.matchmaking_timeout_s / 2
        self._idle_reason = ""  # why the last planned round had no group for this peer
        self.rounds_started = 0  # average() calls
        self.order = 0  # the round order this averager plans with when the caller gives none
        self.peer = peer
        self.group_key = config.group_key
        self.fault = fault
        self.faults = FaultInjector(fault)
        self.fault_triggered = self.faults.triggered  # set when ``fault`` fires (tests wait on it)
        self.stream_name = f"{config.name}.part"
        self.stall = StallPolicy(config.stall_timeout_min_s, config.stall_factor)
        self.matchmaker = Matchmaker(
            peer,
            rpc_name=f"{config.name}.join",
            min_group_size=config.min_group_size,
            target_group_size=config.target_group_size,
            gather_window=config.gather_window_s or 0.0,
        )
        peer.transport.add_stream(self.stream_name, self._handle_part)
        if self.faults.active:
            announced = peer.transport.record().bandwidth
            peer.transport.update_record(bandwidth=self.faults.bandwidth(announced))
        self.current_group: GroupInfo | None = None  # the group of the round in progress
        # owners this peer accused of returning implausible averages: they own no part in this
        # peer's plans and their part streams are refused, for the rest of the run
        self.excluded: dict[PeerID, str] = {}
        self._chunk_elems = chunk_elems_for(self.codec)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            config.threads, thread_name_prefix="swarm-avg"
        )
        self._lock = asyncio.Lock()
        # inbound streams wait on their group's future: set to the round when it starts, to None
        # when it is over; at most _RECENT_GROUPS of either kind are kept
        self._rounds: dict[bytes, asyncio.Future[AllReduce | None]] = {}
        self._finished: deque[bytes] = deque()
        self._flat: torch.Tensor | None = None
        self._result: torch.Tensor | None = None
        self._feedback: FlatFeedback | None = None
        self._sync_feedback: FlatFeedback | None = None  # of the synced tensors (anchors)
        self._saved_feedback: dict[str, Any] | None = None
        self.prober = prober  # RTT probes and this peer's Vivaldi coordinate
        self._own_prober = prober is None and config.grouping != "fixed"
        if self._own_prober:
            self.prober = Prober(
                peer, period=config.probe_period_s, probes=config.probes_per_period
            )
            self.prober.start()
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
        self._check_tensors(tensors)
        weight = check_weight(weight)
        if self._closed:
            raise AveragingError("the averager is closed")
        numel = sum(t.numel() for t in tensors)
        syncing = list(sync) if sync is not None and sync_every > 0 else []
        self._check_tensors(syncing)
        async with self._lock:
            started = time.monotonic()
            if group_key:
                key_name, expected, leader = group_key, 0, None
            else:
                key_name, expected, leader = await self._round_key(round_, order)
            if key_name is None:
                return RoundResult(
                    False, self._idle_reason, matchmaking_s=time.monotonic() - started
                )
            # peers that would cut the vector differently never group
            spec = f"{self.codec.spec}|share={self.config.max_share:g}"
            if syncing:
                spec += f"|sync={sync_every}:{schema_hash(syncing, '')}"
            key = matchmaking_key(self.peer.run_id, key_name, schema_hash(tensors, spec))
            group = await self.matchmaker.form_group(
                key,
                self.config.matchmaking_timeout_s,
                expected=expected,
                patience=self.patience,
                leader=leader,
                order=max(0, self.order - 1) if round_ is None else round_,
            )
            matchmaking_s = time.monotonic() - started
            self._forget_gone(self.matchmaker.gone)
            if isinstance(group, str):
                logger.info("round not averaged: %s", group)
                return RoundResult(False, group, matchmaking_s=matchmaking_s)
            self.order = max(self.order, group.order + 1)
            deadline = started + self.config.round_timeout_s - ROUND_CLEANUP_S
            result = await self._allreduce(tensors, numel, weight, group, matchmaking_s, deadline)
            if not syncing or not syncs(group, sync_every):
                return result
            # the same members average the synced tensors under a derived group id
            derived = GroupInfo(
                hashlib.sha256(b"sync" + group.group_id).digest()[:16], group.members
            )
            synced = await self._allreduce(
                syncing,
                sum(t.numel() for t in syncing),
                weight,
                derived,
                0.0,
                deadline,
                feedback=self._sync_feedback_for,
            )
            return dataclasses.replace(
                result,
                synced=synced.averaged,
                bytes_sent=result.bytes_sent + synced.bytes_sent,
                bytes_received=result.bytes_received + synced.bytes_received,
                allreduce_s=result.allreduce_s + synced.allreduce_s,
            )

    async def _round_key(
        self, round_: int | None, order: int | None = None
    ) -> tuple[str | None, int, PeerRecord | None]:
        """This round's group key under ``grouping``, from the prober's view of the peers (None:
        sit this round out), the group size planned under it (0: unknown) and the record of the
        planned group's leader (its smallest PeerID; None: unknown)."""
        shared = round_ is not None
        # Without a shared round number, peers agree on the plan's order through their groups:
        # each group closes with its members' largest order and every member goes on from it,
        # so a restarted peer or one whose rounds failed falls back in step within a round.
        number = round_ if round_ is not None else max(self.order, order or 0)
        self.order = max(self.order, number + 1)
        self.rounds_started += 1
        if self.prober is None or self.grouping == "fixed":
            return self.group_key, 0, None
        try:  # one fresh read per round: peers that start a round together see the same peers
            await asyncio.wait_for(self.prober.refresh(), self.config.matchmaking_timeout_s / 4)
        except asyncio.TimeoutError:
            logger.debug("reading the peer records timed out: grouping with the last view")
        view, me = self.prober.view(), self.peer.peer_id
        if me not in view:  # cannot happen: the view always holds this peer
            return self.group_key, 0, None
        if len(view) == 1:  # nobody to wait for: do not sit through the matchmaking timeout
            self._idle_reason = "no other peer announced in this run"
            return None, 0, None
        plan_of = regions.random_plan if self.grouping == "random" else regions.plan_groups
        plan = plan_of(view, number, self.grouping_config)
        key = plan.key_of(me)
        if key is None:
            self._idle_reason = "alone in its region: sits regular rounds out until a cross one"
            return None, 0, None
        members = plan.groups[key]
        logger.debug("round %d: %s group %s of %d", number, plan.kind, key, len(members))
        leader = min(members, key=lambda p: p.digest)
        record = self.peer.transport.record() if leader == me else self.prober.records.get(leader)
        if not shared:
            key = regions.without_round(key)
        return f"{self.group_key}.{key}", len(members), record

    def state_dict(self) -> dict[str, Any]:
        """Error-feedback state, for checkpoints."""
        return {"feedback": self._feedback.state_dict() if self._feedback is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (applied when the tensors' size is known)."""
        saved = state.get("feedback") if isinstance(state, dict) else None
        self._saved_feedback = saved if isinstance(saved, dict) else None
        if self._feedback is not None and self._saved_feedback is not None:
            self._feedback.load_state_dict(self._saved_feedback)

    async def close(self) -> None:
        """Stop serving, cancel background work and release the worker threads."""
        self._closed = True
        for fut in self._rounds.values():
            if not fut.done():
                fut.set_result(None)
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
        feedback: Callable[[int, torch.device], FlatFeedback] | None = None,
    ) -> RoundResult:
        loop = asyncio.get_running_loop()
        me = group.index_of(self.peer.peer_id)
        # an owner this peer accused owns nothing in its plan (and its streams are refused)
        bandwidths = [
            0.0 if m.peer_id in self.excluded else b
            for m, b in zip(group.members, group.bandwidths, strict=True)
        ]
        plan = PartPlan.create(numel, bandwidths, self._chunk_elems, self.config.max_share)
        flat, result = await loop.run_in_executor(self._pool, self._gather, tensors, numel)
        flat, weight = self.faults.contribution(flat), self.faults.weight(weight)
        started = time.monotonic()
        ctx = RoundContext(
            group=group,
            me=me,
            weight=weight,
            feedback=(feedback or self._feedback_for)(numel, flat.device),
            workers=Workers(self._pool),
            stall=self.stall,
            deadline=deadline,
            faults=self.faults,
            aggregator=self.config.aggregator,
            weight_cap=self.config.weight_cap,
            excluded=frozenset(
                i for i, m in enumerate(group.members) if m.peer_id in self.excluded
            ),
        )
        round_ = AllReduce(
            self.peer.transport, self.stream_name, ctx, plan, flat, result, self.config.check_owners
        )
        fut = self._round_future(group.group_id)
        if fut.done():  # a stream gave up waiting for this group: later ones find it
            fut = self._rounds[group.group_id] = loop.create_future()
        fut.set_result(round_)
        self.current_group = group
        try:
            outcome = await round_.run()
        finally:
            self._end_round(group.group_id)
            self.current_group = None
        self._forget_gone({group.members[i].peer_id for i in ctx.gone})
        parts_idx, notes = outcome.parts, outcome.notes
        refusals = [
            Refusal(m.peer_id, "excluded", -1, self.excluded[m.peer_id])
            for m in group.members
            if m.peer_id in self.excluded
        ]
        for r in outcome.refusals:
            refusals.append(r)
            if r.action == "accused" and r.peer not in self.excluded:
                self.excluded[r.peer] = f"accused in round {group.group_id.hex()[:8]}: {r.why}"
        ranges = [plan.ranges[j] for j in sorted(parts_idx)]
        await loop.run_in_executor(self._pool, _scatter, tensors, result, ranges)
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

    def _check_tensors(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise AveragingError("average() takes float tensors")
            if not t.is_contiguous():
                raise AveragingError("average() takes contiguous tensors (use .contiguous())")

    def _gather(self, tensors: list[torch.Tensor], numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This peer's values as one flat float32 vector on the tensors' device, and the staging
        buffer (both reused). Tensors spread over several devices gather on the first one's."""
        device = tensors[0].device if tensors else torch.device("cpu")
        if self._result is None or self._result.numel() != numel or self._result.device != device:
            self._result = torch.empty(numel, dtype=torch.float32, device=device)
        single = tensors[0] if len(tensors) == 1 else None
        if single is not None and single.dtype == torch.float32 and single.is_contiguous():
            return single.detach().view(-1), self._result
        if self._flat is None or self._flat.numel() != numel or self._flat.device != device:
            self._flat = torch.empty(numel, dtype=torch.float32, device=device)
        offset = 0
        for t in tensors:
            n = t.numel()
            self._flat[offset : offset + n].copy_(t.detach().reshape(-1))
            offset += n
        return self._flat, self._result

    def _forget_gone(self, gone: set[PeerID]) -> None:
        """Plan no group with peers whose address refused us (until they sign a new record)."""
        if self.prober is not None:
            for peer_id in gone:
                self.prober.mark_gone(peer_id)
        gone.clear()

    def _sync_feedback_for(self, numel: int, device: torch.device) -> FlatFeedback:
        fb = self._sync_feedback
        if fb is None or fb.numel != numel or fb.device != device:
            self._sync_feedback = fb = FlatFeedback(self.codec, numel, device)
        return fb

    def _feedback_for(self, numel: int, device: torch.device) -> FlatFeedback:
        fb = self._feedback
        if fb is None or fb.numel != numel or fb.device != device:
            self._feedback = FlatFeedback(self.codec, numel, device)
            if self._saved_feedback is not None:
                self._feedback.load_state_dict(self._saved_feedback)
        return self._feedback

    # ---- serving part streams

    async def _handle_part(self, request: InboundStream, reply: ReplyStream) -> None:
        header = request.header
        group_id = header.get("g")
        if not isinstance(group_id, bytes) or len(group_id) != GROUP_ID_BYTES:
            raise TransportError("part stream without a valid group id", status=400)
        round_ = await self._round_for(group_id)
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

    def _round_future(self, group_id: bytes) -> asyncio.Future[AllReduce | None]:
        """The future an inbound stream of ``group_id`` waits on (created on first use)."""
        fut = self._rounds.get(group_id)
        if fut is None:
            awaited = [g for g, f in self._rounds.items() if not f.done()]
            if len(awaited) >= _RECENT_GROUPS:  # bounded: streams for unknown groups give up
                self._rounds.pop(awaited[0]).set_result(None)
            fut = self._rounds[group_id] = asyncio.get_running_loop().create_future()
        return fut

    def _end_round(self, group_id: bytes) -> None:
        self._rounds[group_id] = fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        self._finished.append(group_id)
        while len(self._finished) > _RECENT_GROUPS - 1:
            self._rounds.pop(self._finished.popleft(), None)

    async def _round_for(self, group_id: bytes) -> AllReduce | None:
        """The round of ``group_id``: waits (a bounded time) for it to start; None when it is
        over or never starts here."""
        if self._closed:
            return None
        fut = self._round_future(group_id)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), _UNKNOWN_GROUP_WAIT_S)
        except asyncio.TimeoutError:
            if self._rounds.get(group_id) is fut and not fut.done():
                del self._rounds[group_id]
                fut.set_result(None)
            return None


def _scatter(
    tensors: list[torch.Tensor], result: torch.Tensor, ranges: list[tuple[int, int]]
) -> None:
    """Copy ``result[start:end]`` for each range into the tensors (their device and dtype)."""
    bounds, offset = [], 0
    for t in tensors:
        bounds.append((offset, offset + t.numel()))
        offset += t.numel()
    for start, end in ranges:
        for t, (ts, te) in zip(tensors, bounds, strict=True):
            lo, hi = max(start, ts), min(end, te)
            if lo < hi:
                t.detach().view(-1)[lo - ts : hi - ts].copy_(result[lo:hi])


def syncs(group: GroupInfo, every: int) -> bool:
    """Whether ``group`` also averages the synced tensors: one group in about ``every``,
    decided by its id, which every member knows."""
    return every > 0 and int.from_bytes(group.group_id[:4], "big") % every == 0
