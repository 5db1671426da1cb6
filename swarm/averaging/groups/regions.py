"""Latency-aware group keys (sans-I/O): regions from Vivaldi coordinates, near and cross rounds.

Every peer that looks for a group computes the same :class:`GroupPlan` from the same view (the
coordinates of the peers looking, e.g. read from ``{run}/peers``) and passes its own key to the
matchmaking (:meth:`swarm.averaging.averager.Averager.average` ``group_key=``). How keys are
decided:

1. **Regions.** Complete-linkage agglomerative clustering on the predicted RTTs: start with one
   cluster per peer, repeatedly merge the two clusters whose farthest members are closest, stop
   when that distance exceeds ``region_rtt``. So every region has a predicted diameter of at most
   ``region_rtt``; no region list is configured, regions emerge from the coordinates. Merging
   uses only ``max`` and comparisons on the pairwise predictions, with ties broken by PeerID
   order, so peers with the same view get the same regions bit for bit.
2. **Near rounds.** A region smaller than ``min_group_size`` (it could never average alone)
   joins the region of its nearest peer: complete linkage leaves peers alone whose coordinates
   put them past the diameter of every cluster (coordinates that are young or off; in the scale
   simulation of 256 peers with coordinates two minutes old, 10-16% of the due peers, 2-6
   points fewer with this rule), and a peer truly far from every other (one volunteer on
   another continent) would otherwise sit out every round but the cross ones. Its longer link
   lengthens its group's rounds, which overlapped rounds hide behind the next steps; sitting
   out would waste its work in three rounds of four. Each region is ordered by a hash of (round,
   PeerID), which changes every round so that different peers of a region meet, and cut into
   ``ceil(size / target_group_size)`` consecutive runs: sizes differ by at most one, never exceed
   the target and are at least ``target_group_size // 2`` (so keep ``min_group_size`` at or
   below that, or some rounds plan groups too small to average). Consecutive runs keep plans
   close when views differ by one peer (one that just joined or died): the peers before it in
   the order keep their groups and those after it shift by one place, so one peer per later
   group boundary changes group (dealing round-robin would move every peer after it).
   Key: ``r{round}.n.{first}``, ``first`` being the group's smallest PeerID (its leader), so a
   group keeps its key in views that differ elsewhere (a key named after the region or a group
   index would change for every group of the region when its first peer joins or dies).
3. **Cross rounds** (every ``cross_every``-th round, when there are several regions; with one
   region the round is a near round, so peers that disagree on the round number still meet):
   Moshpit-style mixing. The regions (before
   small ones are merged, so a lone peer still takes part) are concatenated, each in its hashed
   order, and dealt round-robin into ``ceil(n / target_group_size)`` groups: consecutive members
   of a region go to different groups, so every group holds a peer of each region that has at
   least as many peers as there are groups, and at most one per region smaller than that.
   Key: ``r{round}.x.{first}``.
4. :func:`random_plan` keeps the group sizes of the latency-aware plan but fills them from a
   hashed permutation of all peers: the baseline for benchmarks.

Views differ between peers (DHT records arrive at different times, coordinates move). Only
stable inputs are used: the set of PeerIDs, the round number and the predicted RTTs, which matter
only through comparisons with ``region_rtt`` (well separated regions do not change when a
coordinate moves a little). Two peers with different views may compute different keys; the
matchmaking only ever groups peers that declared the *same* key, so the cost is a smaller group
or no group for some peers in that round, never a wrong or split group. To keep views close,
build the view from one DHT read per round and leave out peers whose record is very fresh.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from swarm.averaging.groups.coordinates import Coordinate, predict_rtt
from swarm.errors import AveragingError, ConfigError
from swarm.identity import PeerID

logger = logging.getLogger(__name__)

NEAR, CROSS, RANDOM = "near", "cross", "random"
_KIND_TAG = {NEAR: "n", CROSS: "x", RANDOM: "z"}
_KEY_CHARS = 16  # of the first member's digest, in hex: unique among a round's groups
_EXACT_NEAR = 1e-9  # predictions this close to region_rtt (relative) are computed exactly


@dataclass(frozen=True)
class GroupingConfig:
    """How groups are formed; every peer of a run must use the same values."""

    min_group_size: int = 2  # smaller groups cannot average (same as the averager's)
    target_group_size: int = 8  # no group is planned larger than this
    cross_every: int | None = 4  # round r mixes regions when r % cross_every == cross_every - 1
    region_rtt: float = 0.05  # seconds: largest predicted RTT between two peers of one region

    def __post_init__(self) -> None:
        if not 2 <= self.min_group_size <= self.target_group_size:
            raise ConfigError("grouping needs 2 <= min_group_size <= target_group_size")
        if self.cross_every is not None and self.cross_every < 1:
            raise ConfigError("cross_every must be >= 1 (1: every round mixes regions) or None")
        if not (math.isfinite(self.region_rtt) and self.region_rtt > 0):
            raise ConfigError("region_rtt must be a positive number of seconds")

    def is_cross_round(self, round_: int) -> bool:
        """True when round ``round_`` mixes regions instead of grouping near peers.

        ``cross_every=None`` never mixes: regions stay apart (for experiments, not for training).
        """
        if self.cross_every is None:
            return False
        return round_ % self.cross_every == self.cross_every - 1


@dataclass(frozen=True)
class GroupPlan:
    """The groups every peer with the same view agrees on for one round."""

    round: int  # the averaging round the plan is for
    kind: str  # NEAR, CROSS or RANDOM
    regions: tuple[tuple[PeerID, ...], ...]  # clusters by predicted RTT, before merging
    groups: Mapping[str, tuple[PeerID, ...]] = field(hash=False)  # group key -> members
    idle: tuple[PeerID, ...] = ()  # peers without a group this round (alone in their region)

    def key_of(self, peer: PeerID) -> str | None:
        """The group key of ``peer``; None when it sits this round out.

        Raises:
            AveragingError: ``peer`` was not in the view.
        """
        for key, members in self.groups.items():
            if peer in members:
                return key
        if peer in self.idle:
            return None
        raise AveragingError(f"{peer.short} is not in the view of round {self.round}")


def find_regions(
    view: Mapping[PeerID, Coordinate], region_rtt: float
) -> tuple[tuple[PeerID, ...], ...]:
    """Complete-linkage clusters of predicted RTT at most ``region_rtt`` (see module doc).

    Returns:
        Regions ordered by their smallest PeerID, each sorted by PeerID.

    Raises:
        AveragingError: coordinates of different dimension counts.
    """
    peers, clusters = _clusters(view, region_rtt)
    return _as_regions(peers, clusters)


def _clusters(
    view: Mapping[PeerID, Coordinate], region_rtt: float
) -> tuple[list[PeerID], list[list[int]]]:
    """The peers by PeerID and their complete-linkage clusters (as indices)."""
    peers = sorted(view, key=lambda p: p.digest)
    if not peers:
        return [], []
    dist = _predicted_rtts([view[p] for p in peers], region_rtt)
    return peers, _complete_linkage(dist, region_rtt)


def _as_regions(peers: list[PeerID], clusters: list[list[int]]) -> tuple[tuple[PeerID, ...], ...]:
    regions = [tuple(peers[k] for k in sorted(c)) for c in clusters]
    return tuple(sorted(regions, key=lambda r: r[0].digest))


def _attach_small(
    coords: Sequence[Coordinate], clusters: list[list[int]], config: GroupingConfig
) -> tuple[list[list[int]], list[int]]:
    """The clusters that can average, each with the small ones whose nearest peer is in it, and
    the peers of the small clusters left alone (none: kept for plans that leave peers out)."""
    able = sorted((c for c in clusters if len(c) >= config.min_group_size), key=min)
    joined = [list(c) for c in able]
    owner = np.full(len(coords), -1)
    for k, c in enumerate(able):
        owner[c] = k
    idle: list[int] = []
    small = [c for c in clusters if len(c) < config.min_group_size]
    if not small:
        return joined, idle
    dist = _predicted_rtts(coords, config.region_rtt, [k for c in small for k in c])
    dist[:, owner < 0] = np.inf  # only peers of clusters that can average are candidates
    start = 0
    for c in small:
        nearest = dist[start : start + len(c)].min(axis=0)
        start += len(c)
        j = int(nearest.argmin())  # the first (smallest PeerID) among equals
        if math.isfinite(nearest[j]):
            joined[owner[j]].extend(c)
        else:
            idle.extend(c)
    return joined, idle


def _predicted_rtts(
    coords: Sequence[Coordinate], region_rtt: float, rows: Sequence[int] | None = None
) -> np.ndarray:
    """:func:`predict_rtt` of every pair, vectorized (a Python loop over the pairs took 0.4 s at
    1024 peers): ``[r, j]`` is the prediction between ``rows[r]`` (default: every peer) and
    ``j``, as ``predict_rtt`` computes it with the smaller index first; inf for a peer itself.

    Elementwise float64 operations give the same bits on every platform, but may differ from
    ``math.dist`` in the last bit; the pairs within a hair of ``region_rtt``, the one value a
    prediction is compared with, are computed with :func:`predict_rtt` itself.

    Raises:
        AveragingError: coordinates of different dimension counts.
    """
    if len({c.dims for c in coords}) > 1:
        raise AveragingError("coordinates of different dimension counts cannot be compared")
    vectors = np.array([c.vector for c in coords], dtype=np.float64)
    heights = np.array([c.height for c in coords], dtype=np.float64)
    n = len(coords)
    picked = np.arange(n) if rows is None else np.asarray(rows, dtype=np.intp)
    dist, scratch = np.zeros((len(picked), n)), np.empty((len(picked), n))
    for k in range(vectors.shape[1]):
        np.subtract(vectors[picked, k, None], vectors[None, :, k], out=scratch)
        dist += np.square(scratch, out=scratch)
    np.sqrt(dist, out=dist)
    if rows is None:  # (distance + h_i) + h_j for i < j: the upper half, mirrored
        dist += heights[:, None]
        dist += heights[None, :]
        dist = np.triu(dist, 1)
        dist += dist.T
    else:
        first = picked[:, None] < np.arange(n)[None, :]
        dist = np.where(
            first,
            (dist + heights[picked, None]) + heights[None, :],
            (dist + heights[None, :]) + heights[picked, None],
        )
    near = np.abs(np.subtract(dist, region_rtt, out=scratch), out=scratch)
    for r, j in zip(*np.nonzero(near <= _EXACT_NEAR * region_rtt), strict=True):
        i = int(picked[r])
        dist[r, j] = predict_rtt(coords[min(i, j)], coords[max(i, j)])
    dist[np.arange(len(picked)), picked] = np.inf
    return dist


def _complete_linkage(dist: np.ndarray, limit: float) -> list[list[int]]:
    """Merge the two closest clusters while they are at most ``limit`` apart; ``dist`` (square,
    symmetric, inf on the diagonal) is used up. Returns the clusters as lists of row indices.

    The pair merged is the first minimum of the whole matrix in row-major order (ties go to the
    smallest rows). Each row's first minimum is kept: a merge of ``i`` and ``j`` only raises
    column ``i`` and removes column ``j``, so only rows whose minimum sat there (and row ``i``)
    are searched again, not the whole matrix (O(n^2) per merge made 1024 peers take 0.2 s).
    """
    n = len(dist)
    members: dict[int, list[int]] = {i: [i] for i in range(n)}  # cluster at row i -> peers
    nearest = dist.argmin(axis=1)  # each row's first minimum
    closest = dist[np.arange(n), nearest]
    while len(members) > 1:
        i = int(closest.argmin())  # the first row holding the smallest entry
        j = int(nearest[i])
        if not dist[i, j] <= limit:
            break
        i, j = min(i, j), max(i, j)
        # complete linkage (Lance-Williams): the merged cluster is as far as its farther half
        row = dist[i]
        np.maximum(row, dist[j], out=row)  # (row[i] stays inf)
        dist[:, i] = row
        dist[j, :], dist[:, j] = np.inf, np.inf
        closest[j] = np.inf
        members[i].extend(members.pop(j))
        nearest[i] = k = int(row.argmin())
        closest[i] = row[k]
        rows = np.flatnonzero((nearest == i) | (nearest == j))
        if rows.size:
            found = dist[rows].argmin(axis=1)
            nearest[rows] = found
            closest[rows] = dist[rows, found]
    return list(members.values())


def plan_groups(
    view: Mapping[PeerID, Coordinate], round_: int, config: GroupingConfig
) -> GroupPlan:
    """Near groups in regular rounds, cross-region groups in every ``cross_every``-th round.

    Args:
        view: coordinate of every peer looking for a group this round, this peer included.
        round_: the averaging round (the same on every peer, e.g. the training epoch).
        config: group sizes, cross-round period and region diameter.

    Raises:
        AveragingError: coordinates of different dimension counts.
    """
    peers, clusters = _clusters(view, config.region_rtt)
    regions = _as_regions(peers, clusters)
    if config.is_cross_round(round_) and len(regions) > 1:  # one region: nothing to mix
        order = [p for region in regions for p in _hashed(region, round_, CROSS)]
        groups = {group_key_of(round_, CROSS, g): g for g in _deal(order, config)}
        return GroupPlan(round_, CROSS, regions, groups)
    able = [r for r in regions if len(r) >= config.min_group_size]
    if not able:  # no region can average alone (a scattered swarm): mix everyone
        order = [p for region in regions for p in _hashed(region, round_, CROSS)]
        groups = {group_key_of(round_, CROSS, g): g for g in _deal(order, config)}
        return GroupPlan(round_, CROSS, regions, groups)
    groups = {}
    near, alone = _attach_small([view[p] for p in peers], clusters, config)
    for region in near:
        members = [peers[k] for k in region]
        groups.update(
            {group_key_of(round_, NEAR, g): g for g in _cut(_hashed(members, round_, NEAR), config)}
        )
    return GroupPlan(round_, NEAR, regions, groups, tuple(peers[k] for k in sorted(alone)))


def random_plan(
    view: Mapping[PeerID, Coordinate], round_: int, config: GroupingConfig
) -> GroupPlan:
    """The sizes of :func:`plan_groups`' groups, filled with peers in a hashed random order."""
    plan = plan_groups(view, round_, config)
    sizes = [len(g) for g in plan.groups.values()]
    order = _hashed(sorted(view, key=lambda p: p.digest), round_, RANDOM)
    groups, start = {}, 0
    for size in sorted(sizes, reverse=True):
        group = tuple(order[start : start + size])
        groups[group_key_of(round_, RANDOM, group)] = group
        start += size
    return GroupPlan(round_, RANDOM, plan.regions, groups, tuple(order[start:]))


def group_key(
    view: Mapping[PeerID, Coordinate],
    me: PeerID,
    round_: int,
    config: GroupingConfig,
    *,
    randomized: bool = False,
) -> str | None:
    """This peer's matchmaking key for ``round_`` (see :func:`plan_groups`, :func:`random_plan`);
    None when it sits the round out (alone in its region in a regular round).

    Raises:
        AveragingError: ``me`` is not in ``view``, or coordinates cannot be compared.
    """
    if me not in view:
        raise AveragingError(f"the view of round {round_} must include this peer ({me.short})")
    plan = (random_plan if randomized else plan_groups)(view, round_, config)
    key = plan.key_of(me)
    size = len(plan.groups[key]) if key is not None else 1
    logger.debug("round %d: %s group %s of %d", round_, plan.kind, key, size)
    return key


def without_round(key: str) -> str:
    """``key`` without its round number, for callers whose round numbers may differ between
    peers (e.g. counted locally): near groups of a region then still meet."""
    return key.split(".", 1)[1]


def _hashed(peers: Sequence[PeerID], round_: int, kind: str) -> list[PeerID]:
    """``peers`` in an order that every peer computes alike and that changes every round."""
    salt = f"swarm/groups/{kind}/{round_}/".encode()
    return sorted(peers, key=lambda p: hashlib.sha256(salt + p.digest).digest())


def _deal(order: Sequence[PeerID], config: GroupingConfig) -> list[tuple[PeerID, ...]]:
    """Round-robin into ``ceil(n / target)`` groups: balanced sizes, none above the target."""
    count = max(1, math.ceil(len(order) / config.target_group_size))
    return [tuple(order[i::count]) for i in range(count) if order[i::count]]


def _cut(order: Sequence[PeerID], config: GroupingConfig) -> list[tuple[PeerID, ...]]:
    """Consecutive runs of ``order`` as ``ceil(n / target)`` groups of balanced sizes (the
    first ``n % count`` one larger), none above the target."""
    count = max(1, math.ceil(len(order) / config.target_group_size))
    size, extra = divmod(len(order), count)
    groups, start = [], 0
    for i in range(count):
        end = start + size + (i < extra)
        if end > start:
            groups.append(tuple(order[start:end]))
        start = end
    return groups


def group_key_of(round_: int, kind: str, group: Sequence[PeerID]) -> str:
    """The key of ``group`` in a plan of ``kind`` for ``round_``: short, no '/' (see
    :func:`~.group.matchmaking_key`)."""
    first = min(group, key=lambda p: p.digest)
    return f"r{round_}.{_KIND_TAG[kind]}.{first.digest.hex()[:_KEY_CHARS]}"
