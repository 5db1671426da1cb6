"""Which group key a round looks under: the grouping rule applied to the prober's view.

``latency`` grouping plans near groups from the peers' Vivaldi coordinates (mixed regions every
few rounds), ``random`` keeps those sizes with random members, ``fixed`` uses one key for all.
Groups are dealt in an order hashed from a round number; without a number shared by the caller,
peers agree on one through their groups: every member claims the order it planned with in its
part streams, and goes on from the second largest claim of its group (the larger in a pair), so
a restarted peer, or one that ran ahead, falls back in step within a round, while one member
claiming an order far ahead cannot drag its group away from the rest of the swarm.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from swarm.averaging.groups import regions
from swarm.averaging.groups.apart import KeptApart, apart_pairs, separate
from swarm.averaging.groups.converge import converging_plan
from swarm.averaging.groups.group import followed, next_order
from swarm.averaging.groups.liveness import Liveness
from swarm.averaging.groups.prober import Prober
from swarm.config import AveragingConfig
from swarm.identity import PeerID
from swarm.net.record import PeerRecord
from swarm.protocols import Peer

logger = logging.getLogger(__name__)

# A plan waits this long at most for the checks of peers others report gone: a refused
# connection answers within one RTT, while a peer that does not answer pings (behind a NAT,
# or named by a lying report) must not hold up every plan; a check still running lands in
# the next plan.
REPORT_WAIT_S = 0.5
# a read ahead of the round (swarm.training.cadence.RoundLookout) started this recently serves
# its plan; any other plan reads afresh
FRESH_READ_S = 5.0


@dataclass(frozen=True)
class RoundKey:
    """Where one round looks for its group."""

    key: str | None  # the group key (None: sit this round out, see ``idle``)
    expected: int = 0  # members planned under it (0: unknown)
    leader: PeerRecord | None = None  # the planned leader's record (None: unknown)
    members: tuple[PeerRecord, ...] = ()  # records of the other planned members (known ones)
    order: int = 0  # the round order the plan was dealt with
    idle: str = ""  # why this peer has no group this round


class GroupPlanner:
    """Plans the group key of each round; owns the round order and forgets gone peers.

    Args:
        peer: the started peer (its identity and record).
        config: the averager's settings (grouping, sizes, timeouts).
        prober: the RTT prober whose view the plans come from (None with ``fixed`` grouping).
        liveness: checks the peers that other records report gone, before a plan counts them.
        apart: the peers this one will not be grouped with (see :mod:`.apart`); the prober's
            records name the others' pairs.
    """

    def __init__(
        self,
        peer: Peer,
        config: AveragingConfig,
        prober: Prober | None,
        liveness: Liveness | None = None,
        apart: KeptApart | None = None,
    ):
        self.peer = peer
        self.apart = apart
        self.config = config
        self.prober = prober
        self.liveness = liveness
        self.grouping = config.grouping
        self.grouping_config = regions.GroupingConfig(
            config.min_group_size,
            config.target_group_size,
            cross_every=config.cross_every,
            region_rtt=config.region_rtt_s,
        )
        self.order = 0  # the round order the next round plans with when the caller gives none
        self.rounds_started = 0  # rounds planned
        self._ahead: asyncio.Task[object] | None = None  # the read ahead of the next round
        self._ahead_at: float | None = None  # loop time it started
        self.reads_ahead = 0  # reads started ahead of a round

    def read_ahead(self) -> None:
        """A round falls due in a few seconds: read the peer records now, so that its plan
        finds them fresh instead of waiting for the read."""
        if self.prober is None or self.grouping == "fixed":
            return
        if self._ahead is None or self._ahead.done():
            self._ahead = asyncio.ensure_future(self.prober.refresh())
            self._ahead_at = asyncio.get_running_loop().time()
            self.reads_ahead += 1

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.cancel()

    async def plan(
        self, round_: int | None, order: int | None = None, converge: bool = False
    ) -> RoundKey:
        """This round's key from the prober's view of the peers (see the module docstring).

        Args:
            round_: a round number shared by every peer (part of the keys), or None.
            order: the caller's idea of the round order (the training round), or None.
            converge: plan the groups that bring the swarm to one model fastest
                (:mod:`.converge`), across regions, instead of near groups.
        """
        number = round_ if round_ is not None else max(self.order, order or 0)
        self._go_on(max(self.order, number + 1))
        self.rounds_started += 1
        base = self.config.group_key
        if self.prober is None or self.grouping == "fixed":
            return RoundKey(base, order=number)
        budget = self.config.matchmaking_timeout_s / 4
        # a fresh read per round (peers that start a round together see the same peers): the
        # read ahead of it, under way or done since it started, or a new one
        ahead, self._ahead_at = self._ahead_at, None
        since = asyncio.get_running_loop().time() - ahead if ahead is not None else 0.0
        try:
            await asyncio.wait_for(
                self.prober.refresh(since if since < FRESH_READ_S else 0), budget
            )
        except asyncio.TimeoutError:
            logger.debug("reading the peer records timed out: grouping with the last view")
        await self._check_reports(min(budget, REPORT_WAIT_S))
        view, cells = self.prober.placed(number)
        me = self.peer.peer_id
        if len(view) == 1:  # nobody to wait for: do not sit through the matchmaking timeout
            return RoundKey(None, order=number, idle="no other peer announced in this run")
        if converge:
            plan = converging_plan(view, number, self.grouping_config)
        elif self.grouping == "random":
            plan = regions.random_plan(view, number, self.grouping_config, cells)
        else:
            plan = regions.plan_groups(view, number, self.grouping_config, cells)
        mine = self.apart.listed() if self.apart is not None else ()
        self.prober.tell_apart()
        plan = separate(plan, apart_pairs(self.prober.records, me, mine))
        key = plan.key_of(me)
        if key is None:
            idle = "the plan left it without a group this round"
            return RoundKey(None, order=number, idle=idle)
        members = plan.groups[key]
        logger.debug("round %d: %s group %s of %d", number, plan.kind, key, len(members))
        leader = min(members, key=lambda p: p.digest)
        records = self.prober.records
        record = self.peer.transport.record() if leader == me else records.get(leader)
        others = tuple(records[p] for p in members if p != me and p in records)
        if round_ is None:
            key = regions.without_round(key)
        return RoundKey(f"{base}.{key}", len(members), record, others, number)

    async def _check_reports(self, timeout: float) -> None:
        """Check the peers other records report gone (a refused connection is the proof), so
        that this plan leaves out the ones that are."""
        if self.liveness is None or self.prober is None:
            return
        checks = [self.liveness.check(r) for r in self.prober.reported_gone()]
        if checks:
            await asyncio.wait(checks, timeout=timeout)
            self.forget(self.liveness.gone)

    def adopt(self, order: int, base: int) -> None:
        """Go on from ``order``, the round order the peers a joiner downloaded its state from
        plan with, unless it is implausibly far ahead of ``base`` (the downloaded round)."""
        self._go_on(next_order(max(self.order, base), [order]))

    def settle(self, planned: int, claims: Sequence[int]) -> None:
        """Go on from the round orders a group's members claimed in their part streams:
        ``planned``, this peer's, and ``claims``, the others' (those more than ``ORDER_SLACK``
        ahead left out). In a group of three or more the next round follows the second largest
        claim, which no member alone can set: one claiming an order far ahead in every round
        would drag its group away from the other peers' plans each time, and one claiming an
        order behind cannot hold it back; a peer that ran ahead of its group comes back to it.
        In a pair the larger claim (a restarted peer catches up with its partner)."""
        orders = sorted((planned, *followed(planned, claims)))
        if len(orders) > 1:
            self._go_on((orders[-2] if len(orders) > 2 else orders[-1]) + 1)

    def _go_on(self, order: int) -> None:
        """The next round to plan is ``order``: the prober places this peer from it on (also
        when it came back down: a placement planned from the order before would count that
        many rounds late)."""
        self.order = order
        if self.prober is not None:
            self.prober.round_order = order

    def forget(self, gone: set[PeerID]) -> None:
        """Plan no group with peers whose address refused us (until they sign a new record);
        empties ``gone`` (:attr:`Liveness.gone`)."""
        if self.prober is not None:
            for peer_id in gone:
                self.prober.mark_gone(peer_id)
        gone.clear()
