"""The averager: matchmaking, then a butterfly all-reduce, then the averaged values in place.

::

    averager = Averager(peer, codec="int8", target_group_size=8)
    result = await averager.average(model_tensors, weight=samples_since_last_round)
    if not result.averaged:
        logger.warning("training on alone: %s", result.reason)

Memory per round beyond the tensors: one float32 staging buffer the size of the tensors, plus a
float32 copy of them unless they are a single contiguous float32 CPU tensor (then it is read in
place); both are reused across rounds. Lossy codecs add their error-feedback residual (one float
per element, kept across rounds) and the compressed payloads of one part.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from swarm.averaging import regions
from swarm.averaging.allreduce import AllReduceRunner, AllReduceSettings
from swarm.averaging.feedback import FlatFeedback
from swarm.averaging.group import GROUP_ID_BYTES, GroupInfo, matchmaking_key
from swarm.averaging.matchmaking import Matchmaker
from swarm.averaging.plan import PartPlan, chunk_elems_for, schema_hash
from swarm.averaging.prober import Prober
from swarm.averaging.reducer import check_weight
from swarm.averaging.result import Fault, RoundResult
from swarm.compression import Codec, get_codec
from swarm.errors import AuthError, AveragingError, ConfigError, TransportError
from swarm.net.record import PeerRecord
from swarm.net.streams import InboundStream, ReplyStream

logger = logging.getLogger(__name__)

_UNKNOWN_GROUP_WAIT_S = 5.0  # a member may start streaming before we heard the group closed
_RECENT_GROUPS = 64
GROUPINGS = ("latency", "random", "fixed")


class Averager:
    """Averages tensors with a group of peers of the swarm.

    Args:
        peer: a started :class:`swarm.peer.Peer`.
        codec: compression of what is sent (``none``, ``fp16``, ``bf16``, ``int8``,
            ``topk:0.01``, ``1bit``, or a :class:`~swarm.compression.Codec`); error feedback is
            always on for lossy codecs. Peers with different codecs never group.
        min_group_size: average only with at least this many peers (this one included).
        target_group_size: a group closes as soon as it has this many members.
        matchmaking_timeout: how long to look for a group. A peer alone pays it every round;
            increase it if groups form too small on a slow DHT.
        allreduce_timeout: upper bound of one all-reduce; an owner that never answers costs this
            much. Set it above payload / slowest link rate with a good margin.
        gather_window: wait after declaring before choosing a leader, so that peers arriving at
            about the same time end up in one group. Increase it for large swarms. Default:
            0.5 s, or a quarter of ``matchmaking_timeout`` when that is shorter.
        stall_timeout_min: a sender is never dropped sooner than this after its last chunk;
            beyond it, the limit is ``stall_factor`` chunk-times at the rate measured so far.
        stall_factor: see ``stall_timeout_min``; increase both on very jittery links.
        group_key: matchmaking key prefix: averagers with different keys never group.
        grouping: how groups are chosen each round. ``latency`` (default): near peers by
            Vivaldi coordinates in regular rounds, regions mixed every ``cross_every``-th round
            (:mod:`swarm.averaging.regions`); ``random``: the same group sizes, random members
            (a baseline); ``fixed``: every peer declares under ``group_key`` alone.
        cross_every: period of cross-region rounds; None never mixes regions (experiments only:
            regions then never agree).
        region_rtt: seconds; peers within this predicted RTT of each other form a region.
        probe_period: seconds between rounds of RTT probes (``latency``/``random`` only).
        probes_per_period: peers pinged per probe round (see :class:`Prober`).
        prober: a started :class:`Prober` to share (several averagers on one peer); default: this
            averager starts its own (and closes it).
        name: route prefix (``{name}.join``, ``{name}.part``), to run several averagers on one peer.
        fault: misbehaviour for tests (:class:`Fault`).
        threads: worker threads for compression and reduction.
    """

    def __init__(
        self,
        peer: Any,
        *,
        codec: str | Codec = "none",
        min_group_size: int = 2,
        target_group_size: int = 8,
        matchmaking_timeout: float = 15.0,
        allreduce_timeout: float = 120.0,
        gather_window: float | None = None,
        stall_timeout_min: float = 3.0,
        stall_factor: float = 8.0,
        group_key: str = "default",
        grouping: str = "latency",
        cross_every: int | None = 4,
        region_rtt: float = 0.05,
        probe_period: float = 5.0,
        probes_per_period: int = 4,
        prober: Prober | None = None,
        name: str = "avg",
        fault: Fault = Fault.NONE,
        threads: int = 2,
    ):
        if not 2 <= min_group_size <= target_group_size:
            raise ConfigError("need 2 <= min_group_size <= target_group_size")
        if not matchmaking_timeout > 0 or not allreduce_timeout > 0:
            raise ConfigError("matchmaking_timeout and allreduce_timeout must be positive")
        if gather_window is None:
            gather_window = min(0.5, matchmaking_timeout / 4)
        if not 0 <= gather_window < matchmaking_timeout:
            raise ConfigError("gather_window must be within [0, matchmaking_timeout)")
        if not stall_timeout_min > 0 or not stall_factor >= 1:
            raise ConfigError("stall_timeout_min must be positive and stall_factor >= 1")
        if not isinstance(group_key, str) or not group_key or "/" in group_key:
            raise ConfigError("group_key must be a non-empty string without '/'")
        if threads < 1:
            raise ConfigError("threads must be >= 1")
        if grouping not in GROUPINGS:
            raise ConfigError(f"grouping must be one of {GROUPINGS}, not {grouping!r}")
        self.grouping = grouping
        self.grouping_config = regions.GroupingConfig(
            min_group_size, target_group_size, cross_every=cross_every, region_rtt=region_rtt
        )
        # a leader waits this long for the members its plan expects (latency/random grouping)
        self.patience = matchmaking_timeout / 2
        self._idle_reason = ""  # why the last planned round had no group for this peer
        self.rounds_started = 0  # average() calls, the round number when the caller gives none
        self.peer = peer
        self.codec = get_codec(codec) if isinstance(codec, str) else codec
        self.min_group_size = min_group_size
        self.target_group_size = target_group_size
        self.matchmaking_timeout = matchmaking_timeout
        self.group_key = group_key
        self.fault = fault
        self.settings = AllReduceSettings(
            stream_name=f"{name}.part",
            timeout=allreduce_timeout,
            stall_timeout_min=stall_timeout_min,
            stall_factor=stall_factor,
            fault=fault,
        )
        self.matchmaker = Matchmaker(
            peer,
            rpc_name=f"{name}.join",
            min_group_size=min_group_size,
            target_group_size=target_group_size,
            gather_window=gather_window,
        )
        peer.transport.add_stream(self.settings.stream_name, self._handle_part)
        self.fault_triggered = asyncio.Event()  # set when ``fault`` fires (tests wait on it)
        self.current_group: GroupInfo | None = None  # the group of the round in progress
        self._chunk_elems = chunk_elems_for(self.codec)
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="swarm-avg")
        self._lock = asyncio.Lock()
        self._runners: dict[bytes, AllReduceRunner] = {}
        self._finished: deque[bytes] = deque(maxlen=_RECENT_GROUPS)
        self._flat: torch.Tensor | None = None
        self._result: torch.Tensor | None = None
        self._feedback: FlatFeedback | None = None
        self._saved_feedback: dict[str, Any] | None = None
        self.prober = prober  # RTT probes and this peer's Vivaldi coordinate
        self._own_prober = prober is None and grouping != "fixed"
        if self._own_prober:
            self.prober = Prober(peer, period=probe_period, probes=probes_per_period)
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
        async with self._lock:
            started = time.monotonic()
            if group_key:
                key_name, expected, leader = group_key, 0, None
            else:
                key_name, expected, leader = await self._round_key(round_)
            if key_name is None:
                return RoundResult(
                    False, self._idle_reason, matchmaking_s=time.monotonic() - started
                )
            key = matchmaking_key(self.peer.run_id, key_name, schema_hash(tensors, self.codec.spec))
            group = await self.matchmaker.form_group(
                key,
                self.matchmaking_timeout,
                expected=expected,
                patience=self.patience,
                leader=leader,
            )
            matchmaking_s = time.monotonic() - started
            if isinstance(group, str):
                logger.info("round not averaged: %s", group)
                return RoundResult(False, group, matchmaking_s=matchmaking_s)
            return await self._allreduce(tensors, numel, weight, group, matchmaking_s)

    async def _round_key(self, round_: int | None) -> tuple[str | None, int, PeerRecord | None]:
        """This round's group key under ``grouping``, from the prober's view of the peers (None:
        sit this round out), the group size planned under it (0: unknown) and the record of the
        planned group's leader (its smallest PeerID; None: unknown)."""
        shared = round_ is not None
        number = round_ if round_ is not None else self.rounds_started
        self.rounds_started += 1
        if self.prober is None or self.grouping == "fixed":
            return self.group_key, 0, None
        try:  # one fresh read per round: peers that start a round together see the same peers
            await asyncio.wait_for(self.prober.refresh(), self.matchmaking_timeout / 4)
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
    ) -> RoundResult:
        loop = asyncio.get_running_loop()
        me = group.index_of(self.peer.peer_id)
        plan = PartPlan.create(numel, group.bandwidths, self._chunk_elems)
        flat, result = await loop.run_in_executor(self._pool, self._gather, tensors, numel)
        started = time.monotonic()
        runner = AllReduceRunner(
            self.peer.transport,
            group,
            me,
            plan,
            flat,
            result,
            weight,
            self._feedback_for(numel),
            self._pool,
            self.settings,
            self.fault_triggered,
        )
        self._runners[group.group_id] = runner
        self.current_group = group
        try:
            parts_idx, notes = await runner.run()
        finally:
            self._runners.pop(group.group_id, None)
            self._finished.append(group.group_id)
            self.current_group = None
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
            "round %s: %d peers, %d/%d parts averaged, %.2f s + %.2f s%s",
            group.group_id.hex()[:8],
            len(ids),
            len(parts),
            len(plan.owned()),
            matchmaking_s,
            allreduce_s,
            f" ({reason})" if reason else "",
        )
        return RoundResult(
            averaged=averaged,
            reason=reason,
            group_id=group.group_id,
            members=ids,
            parts=parts,
            bytes_sent=runner.bytes_sent,
            bytes_received=runner.bytes_received,
            matchmaking_s=matchmaking_s,
            allreduce_s=allreduce_s,
        )

    def _check_tensors(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise AveragingError("average() takes float tensors")
            if not t.is_contiguous():
                raise AveragingError("average() takes contiguous tensors (use .contiguous())")

    def _gather(self, tensors: list[torch.Tensor], numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This peer's values as one flat float32 CPU vector, and the staging buffer (reused)."""
        if self._result is None or self._result.numel() != numel:
            self._result = torch.empty(numel, dtype=torch.float32)
        single = tensors[0] if len(tensors) == 1 else None
        if (
            single is not None
            and single.dtype == torch.float32
            and single.device.type == "cpu"
            and single.is_contiguous()
        ):
            return single.detach().view(-1), self._result
        if self._flat is None or self._flat.numel() != numel:
            self._flat = torch.empty(numel, dtype=torch.float32)
        offset = 0
        for t in tensors:
            n = t.numel()
            self._flat[offset : offset + n].copy_(t.detach().reshape(-1))
            offset += n
        return self._flat, self._result

    def _feedback_for(self, numel: int) -> FlatFeedback:
        if self._feedback is None or self._feedback.numel != numel:
            self._feedback = FlatFeedback(self.codec, numel)
            if self._saved_feedback is not None:
                self._feedback.load_state_dict(self._saved_feedback)
        return self._feedback

    # ---- serving part streams

    async def _handle_part(self, request: InboundStream, reply: ReplyStream) -> None:
        header = request.header
        group_id = header.get("g")
        if not isinstance(group_id, bytes) or len(group_id) != GROUP_ID_BYTES:
            raise TransportError("part stream without a valid group id", status=400)
        runner = await self._runner_for(group_id)
        if runner is None:
            raise TransportError("unknown or finished group", status=404)
        try:
            sender = runner.group.index_of(request.sender.peer_id)
        except AveragingError:
            raise AuthError(
                f"{request.sender.peer_id.short} is not a member of group {group_id.hex()[:8]}"
            ) from None
        if sender == runner.me:
            raise AuthError("a member does not stream to itself")
        await runner.handle_part(request, reply, sender, header)

    async def _runner_for(self, group_id: bytes) -> AllReduceRunner | None:
        waited = 0.0
        while not self._closed:
            runner = self._runners.get(group_id)
            if runner is not None or group_id in self._finished:
                return runner
            if waited >= _UNKNOWN_GROUP_WAIT_S:
                return None
            await asyncio.sleep(0.02)
            waited += 0.02
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
