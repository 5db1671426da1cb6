"""The averager: matchmaking, then a butterfly all-reduce, then the averaged values in place.

::

    averager = Averager(peer, AveragingConfig(codec="int8", target_group_size=8))
    result = await averager.average(model_tensors, weight=samples_since_last_round)
    if not result.averaged:
        logger.warning("training on alone: %s", result.reason)

Memory per round beyond the tensors: a float32 copy of them on their device unless they lie end
to end in one float32 storage (then they are read in place), reused across rounds; the averages
waiting for their verdict, in host memory as the owners sent them (compressed; ``none`` decodes
them into a reused float32 buffer the size of the tensors instead); this member's own part in a
float32 buffer of the part's size, and the rows of the chunks an owner is reducing.
Lossy codecs add their error-feedback residual (one bfloat16 per element, kept across rounds).
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
from typing import Any

import torch

from swarm.averaging.butterfly.flat import check_tensors
from swarm.averaging.butterfly.parts import schema_hash
from swarm.averaging.butterfly.reducer import check_weight
from swarm.averaging.butterfly.runner import ButterflyRunner, RoundKind
from swarm.averaging.digest import state_digest
from swarm.averaging.faults import Fault, FaultInjector
from swarm.averaging.groups.group import GROUP_ID_BYTES, GroupInfo, NoGroup, matchmaking_key
from swarm.averaging.groups.liveness import Liveness
from swarm.averaging.groups.matchmaking import Matchmaker
from swarm.averaging.groups.planner import GroupPlanner, RoundKey
from swarm.averaging.groups.prober import Prober
from swarm.averaging.groups.rates import PeerRates
from swarm.averaging.result import RoundResult
from swarm.averaging.under_way import RoundUnderWay
from swarm.compression import Codec, get_codec
from swarm.config import ROUND_CLEANUP_S, AveragingConfig
from swarm.errors import AveragingError, ConfigError
from swarm.protocols import Peer

logger = logging.getLogger(__name__)

# of its matchmaking timeout, that a converging round's leader waits for its planned members:
# a grid's members arrive as their last groups end, later round after round (64 peers in 2
# processes: 1.3 s apart in the first of 6 rounds, 14 s in the last; with half of a 5 s timeout
# 32 peers lost 6 of 128 rounds, with 0.9 of it 64 peers closed 72 of 384 groups short)
CONVERGE_PATIENCE = 0.9


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
        self._codecs: dict[str, Codec] = {}  # of synced tensors, by spec (see average)
        self.config = config
        # a leader waits this long for the members its plan expects (latency/random grouping)
        self.patience = config.matchmaking_timeout_s / 2
        self.peer = peer
        self.fault = fault
        self.faults = FaultInjector(fault)
        self.fault_triggered = self.faults.triggered  # set when ``fault`` fires (tests wait on it)
        self.liveness = Liveness(peer)  # checks members that keep a round waiting
        self.rates = PeerRates()  # others' upload as this peer's owner side measured it
        self.matchmaker = Matchmaker(
            peer,
            rpc_name=f"{config.name}.join",
            min_group_size=config.min_group_size,
            target_group_size=config.target_group_size,
            gather_window=config.gather_window,
            liveness=self.liveness,
            rates=self.rates,
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(
            config.threads, thread_name_prefix="swarm-avg"
        )
        self.butterfly = ButterflyRunner(
            peer, config, self.codec, self._pool, self.faults, self.liveness, self.rates
        )
        if config.score_updates:  # the peers it holds below half weight go in its progress
            peer.progress.records = self.butterfly.reputation
        if self.faults.active:
            announced = peer.transport.record().bandwidth
            peer.transport.update_record(bandwidth=self.faults.bandwidth(announced))
        self._lock = asyncio.Lock()
        self.prober = prober  # RTT probes and this peer's Vivaldi coordinate
        self._own_prober = prober is None and config.grouping != "fixed"
        if self._own_prober:
            self.prober = Prober(
                peer,
                period=config.probe_period_s,
                probes=config.probes_per_period,
                region_rtt=config.region_rtt_s,
            )
            self.prober.start()
        if self.prober is not None:  # the prober's record lists whom the planners keep apart
            self.prober.apart = self.butterfly.apart
            self.butterfly.apart.on_new = self.prober.tell_apart  # before the next plans
        self.planner = GroupPlanner(
            peer, config, self.prober, self.liveness, apart=self.butterfly.apart
        )
        self._closed = False
        self._under_way = RoundUnderWay()

    # ---- public API

    def _matchmaking_timeout(self, converge: bool) -> float:
        """How long to look for a group: a grid's round waits for members late from their last
        one (up to half the round's timeout: the all-reduce keeps the other half)."""
        cfg = self.config
        if converge:
            return max(cfg.matchmaking_timeout_s, cfg.round_timeout_s / 2)
        return cfg.matchmaking_timeout_s

    def _patience(self, purpose: str, converge: bool, patience_s: float | None) -> float:
        """How long a planned leader waits for its planned members."""
        if converge:  # a grid's rounds follow each other: members come as their last one ends
            return CONVERGE_PATIENCE * self._matchmaking_timeout(converge)
        most = self.patience
        if patience_s is not None:
            most = min(self.config.matchmaking_timeout_s, max(most, patience_s))
        if purpose:  # a one-off round arrives when training rounds end, not as rounds suggest
            return most
        return self.matchmaker.patience(most)

    async def average(
        self,
        tensors: Sequence[torch.Tensor],
        weight: float = 1.0,
        *,
        group_key: str | None = None,
        round_: int | None = None,
        sync: Sequence[torch.Tensor] | None = None,
        sync_every: int = 0,
        sync_codec: str | None = None,
        codec: str | None = None,
        order: int | None = None,
        purpose: str = "",
        fragment: str = "",
        updates: bool = False,
        keep_unsent: bool = False,
        converge: bool = False,
        unless_equal: bool = False,
        patience_s: float | None = None,
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
            order: the round this peer believes the swarm is at (e.g. the instant of rounds on
                the clock, or a resumed peer's round count); it orders the planned groups like
                ``round_`` but is not part of the keys. The averager plans with the larger of
                it and its own order: one more than the last round it planned, or than the
                second largest order its last group's members claimed in their part streams
                (the larger in a pair; see GroupPlanner.settle), so peers fall back in step
                after failed rounds or a restart, and one member alone cannot move its group.
            purpose: what the tensors are, when peers average several kinds of the same shapes
                (e.g. "values" for the parameters themselves, "" for training rounds): rounds
                of different purposes never group.
            fragment: which fragment of the model the tensors are (Streaming DiLoCo: rounds
                take turns over fragments); rounds of different fragments never group, and each
                fragment keeps its own error feedback.
            sync / sync_every: more tensors (e.g. DiLoCo anchors) that about one group in
                ``sync_every`` averages as well, in a second all-reduce right after the first
                (its own error feedback; the choice comes from the group id, so every member
                makes the same one), unless every member joined with the same digest of them
                (:attr:`GroupInfo.agreed`): a group of a whole healthy swarm never pays for it.
                Only peers with the same ``sync_every`` group together.
            sync_codec: the codec of that second all-reduce (default: the averager's), e.g. a
                dense ``int8`` for raw weights when the first one is sparse; only peers with
                the same one group together.
            codec: the codec of this round's own all-reduce (default: the averager's), e.g. a
                dense one for a round of raw values under a sparse training codec; only peers
                with the same one group together.
            updates: the tensors are updates (e.g. DiLoCo pseudo-gradients), not values: the
                parts this peer owns score each sender's alignment with the group's robust mean
                and weigh it by this peer's record of it (see
                :mod:`swarm.averaging.butterfly.scoring`); the robust aggregator only.
            keep_unsent: with ``updates`` under a lossy codec, the caller keeps what the
                payloads leave out (:attr:`RoundResult.unsent`) in its own values (e.g. the
                training engine, in its model): the round adds nothing an earlier one left out.
            converge: plan groups that bring the whole swarm to one model in the fewest
                rounds (a grid across regions, :mod:`.groups.converge`) instead of near
                groups: for rounds meant to end with one model (e.g. at the end of training).
                Such a round waits longer for its planned members (see ``CONVERGE_PATIENCE``).
            unless_equal: skip the all-reduce when every member joined with the same digest of
                ``tensors`` (:attr:`GroupInfo.agreed`): averaging equal values moves nothing
                but a lossy codec's rounding, and a whole model's round costs minutes on a home
                uplink (e.g. a swarm that averages as one group, at the end of training). The
                result is averaged, with no bytes sent. Only peers that ask for it group
                together; not with ``sync``.
            patience_s: how long to wait for the planned members when that is longer than the
                default, half the matchmaking timeout (at most all of it): for a caller that
                trains while it waits (an overlapped round), until its next round falls due.
                Peers of equal speed whose rounds start about one round apart (the later one
                arriving as the earlier one's next round starts) otherwise lost one round in
                7-9 wherever a round took longer than half the timeout.

        Returns:
            A :class:`RoundResult`: which parts were averaged with whom, bytes, timings.

        Raises:
            AveragingError: invalid tensors or weight, or the averager is closed.
            ConfigError: an unknown ``sync_codec``.
        """
        tensors = list(tensors)
        check_tensors(tensors)
        weight = check_weight(weight)
        if self._closed:
            raise AveragingError("the averager is closed")
        numel = sum(t.numel() for t in tensors)
        syncing = list(sync) if sync is not None and sync_every > 0 else []
        check_tensors(syncing)
        if unless_equal and syncing:
            raise AveragingError("unless_equal and sync exclude each other")
        digested = tensors if unless_equal else syncing
        sync_with = self._codec(sync_codec) if syncing else self.codec
        round_codec = self._codec(codec)

        async def run() -> RoundResult:
            started = time.monotonic()
            loop = asyncio.get_running_loop()
            # the digest (a pass over the synced tensors, or over ``tensors`` unless equal) runs
            # while the round is planned
            digest = loop.run_in_executor(self._pool, state_digest, digested) if digested else None
            try:
                planned = (
                    RoundKey(group_key)
                    if group_key
                    else await self.planner.plan(round_, order, converge)
                )
            finally:
                state = await digest if digest is not None else b""
            if planned.key is None:
                return RoundResult(False, planned.idle, matchmaking_s=time.monotonic() - started)
            # peers that would cut the vector differently never group
            spec = f"{round_codec.spec}|share={self.config.max_share:g}"
            if self.config.score_updates:
                spec += "|turned"  # its part layout turns with every group (butterfly.scoring)
            if purpose:
                spec += f"|for={purpose}"
            if fragment:
                spec += f"|fragment={fragment}"
            if syncing:
                spec += f"|sync={sync_every}:{schema_hash(syncing, sync_with.spec)}"
            if unless_equal:
                spec += "|unless-equal"
            key = matchmaking_key(self.peer.run_id, planned.key, schema_hash(tensors, spec))
            group = await self.matchmaker.form_group(
                key,
                self._matchmaking_timeout(converge),
                expected=planned.expected,
                patience=self._patience(purpose, converge, patience_s),
                leader=planned.leader,
                planned=planned.members,
                state=state,
            )
            matchmaking_s = time.monotonic() - started
            self.planner.forget(self.liveness.gone)
            if isinstance(group, NoGroup):
                logger.info("round not averaged: %s", group)
                return RoundResult(False, group.reason, matchmaking_s=matchmaking_s)
            if unless_equal and group.agreed:
                logger.info(
                    "round %s: every member holds the same values", group.group_id.hex()[:8]
                )
                return equal_values(group, matchmaking_s)
            deadline = started + self.config.round_timeout_s - ROUND_CLEANUP_S
            kind = RoundKind(purpose, fragment)
            result = await self.butterfly.allreduce(
                tensors,
                numel,
                weight,
                group,
                matchmaking_s,
                deadline,
                kind,
                round_codec,
                updates,
                keep_unsent=keep_unsent,
                order=None if group_key else planned.order,
            )
            self.planner.forget(self.liveness.gone)
            if not group_key:
                self.planner.settle(planned.order, result.orders)
            if not syncing or group.agreed or not syncs(group, sync_every):
                return result  # (agreed: every member holds the same bits already)
            # the same members average the synced tensors under a derived group id
            derived = dataclasses.replace(
                group, group_id=hashlib.sha256(b"sync" + group.group_id).digest()[:GROUP_ID_BYTES]
            )
            synced = await self.butterfly.allreduce(
                syncing,
                sum(t.numel() for t in syncing),
                weight,
                derived,
                0.0,
                deadline,
                dataclasses.replace(kind, synced=True),
                sync_with,
            )
            self.planner.forget(self.liveness.gone)
            return dataclasses.replace(
                result,
                synced=synced.averaged,
                bytes_sent=result.bytes_sent + synced.bytes_sent,
                bytes_received=result.bytes_received + synced.bytes_received,
                allreduce_s=result.allreduce_s + synced.allreduce_s,
            )

        async with self._lock:
            return await self._under_way.run(run())

    def _codec(self, spec: str | None) -> Codec:
        """The codec of ``spec`` (None: the averager's), built once."""
        if spec is None or spec == self.codec.spec:
            return self.codec
        codec = self._codecs.get(spec)
        if codec is None:
            codec = self._codecs[spec] = get_codec(spec)  # ConfigError for an unknown one
        return codec

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
        feedbacks = self.butterfly.feedbacks
        saved = {kind.fragment: fb.state_dict() for kind, fb in feedbacks.items() if kind.saved}
        whole = saved.pop("", None)
        return {"feedback": whole, "fragments": saved} if saved else {"feedback": whole}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (applied when the tensors' size is known)."""
        if not isinstance(state, dict):
            return
        fragments = state.get("fragments")
        saved = dict(fragments) if isinstance(fragments, dict) else {}
        saved[""] = state.get("feedback")
        kept = {k: v for k, v in saved.items() if isinstance(k, str) and isinstance(v, dict)}
        self.butterfly.saved_feedback = kept
        for kind, fb in self.butterfly.feedbacks.items():
            if kind.saved and kind.fragment in kept:
                fb.load_state_dict(kept[kind.fragment])

    def read_ahead(self) -> None:
        """A round falls due within seconds: read the peer list for its plan now, unless a
        round is under way (what it learns, peers gone or kept apart, must reach the next
        plan, which then reads afresh)."""
        if not self._lock.locked():
            self.planner.read_ahead()

    async def close(self) -> None:
        """Stop serving, cancel background work and release the worker threads."""
        self._closed = True
        await self._under_way.call_off()  # (its own cleanup, before the worker threads go)
        self.butterfly.close()
        self.planner.close()
        if self.prober is not None and self._own_prober:
            await self.prober.close()
        await self.matchmaker.close()
        await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown, True)

    async def __aenter__(self) -> Averager:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def equal_values(group: GroupInfo, matchmaking_s: float) -> RoundResult:
    """A round whose members all hold the same values: averaged as it stands, nothing sent."""
    parts = dict.fromkeys(range(len(group.members)), group.members)
    return RoundResult(True, "", group.group_id, group.members, parts, matchmaking_s=matchmaking_s)


def syncs(group: GroupInfo, every: int) -> bool:
    """Whether ``group`` also averages the synced tensors: one group in about ``every``,
    decided by its id, which every member knows."""
    return every > 0 and int.from_bytes(group.group_id[:4], "big") % every == 0
