"""Latency-aware group keys (sans-I/O): regions from Vivaldi coordinates, near and cross rounds.

Every peer that looks for a group computes the same :class:`GroupPlan` from the same view (the
coordinates of the peers looking, e.g. read from ``{run}/peers``) and passes its own key to the
matchmaking (:meth:`swarm.averaging.averager.Averager.average` ``group_key=``). How keys are
decided:

1. **Regions.** A grid over the Vivaldi space (:mod:`.grid`): the peers of one cell form a
   region, the cell being the one each peer publishes in its record (kept while its coordinate
   wobbles near a face), else the one its coordinate lies in; neighbouring cells whose peers
   all lie within ``region_rtt / 2`` (a tight cluster that a face cut) are one region. Two
   peers of a region are at most ``region_rtt`` apart before their heights; no region list is
   configured, regions emerge from the coordinates. A peer's region depends on its own place
   and, near a face, on its neighbouring cell's peers only: views that differ in a few peers
   or in their latest coordinates agree on the regions of the others. (Complete-linkage
   clustering, used before, found natural clusters but cut a crowd of peers anywhere: in the
   scale simulation of 1024 peers under churn, 9% of the due peers' regions were the same in
   every view that held them.)
2. **Near rounds.** A region smaller than ``min_group_size`` (it could never average alone)
   joins the region of its nearest peer: a peer truly far from every other (one volunteer on
   another continent) would otherwise sit out every round but the cross ones. Its longer link
   lengthens its group's rounds, which overlapped rounds hide behind the next steps; sitting
   out would waste its work in three rounds of four. Each region is ordered by a hash of (round,
   PeerID), which changes every round so that different peers of a region meet, split into
   **cells** (halves of the hash space, halved again while both halves hold at least
   ``CELL_GROUPS * target_group_size`` peers), and each cell is cut into
   ``ceil(size / target_group_size)`` consecutive runs: sizes differ by at most one, never exceed
   the target and are at least ``target_group_size // 2`` (so keep ``min_group_size`` at or
   below that, or some rounds plan groups too small to average). Consecutive runs keep plans
   close when views differ by one peer (one that just joined or died): the peers before it in
   the order keep their groups and those after it shift by one place, so one peer per later
   group boundary changes group (dealing round-robin would move every peer after it), and
   only inside its cell: a region of 200 peers is about eight cells, and a peer missing from
   one view moves a few peers of its own cell, not every later group of the region.
   Key: ``r{round}.n.{first}``, ``first`` being the group's smallest PeerID (its leader), so a
   group keeps its key in views that differ elsewhere (a key named after the region or a group
   index would change for every group of the region when its first peer joins or dies).
3. **Cross rounds** (every ``cross_every``-th round, when there are several regions; with one
   region the round is a near round, so peers that disagree on the round number still meet):
   Moshpit-style mixing. All peers are split into cells by a hash of (round, PeerID) as above;
   each cell lists its members region by region (before small ones are merged, so a lone peer
   still takes part) and deals them round-robin into ``ceil(n / target_group_size)`` groups:
   consecutive members of a region go to different groups, so every group holds a peer of each
   region that has at least as many peers in the cell as there are groups, and at most one per
   region with fewer. Swarms under ``2 * CELL_GROUPS * target_group_size`` peers are one cell.
   Key: ``r{round}.x.{first}``.
4. :func:`random_plan` keeps the group sizes of the latency-aware plan but fills them from a
   hashed permutation of all peers: the baseline for benchmarks.

Views differ between peers (DHT records arrive at different times, coordinates move). Only
stable inputs are used: the set of PeerIDs, the round number and the placements the records
publish for the round (:mod:`.placement`: a cell and a rounded coordinate, published rounds
before they count, so readers of two versions of a record agree). Two peers with different
views may compute different keys; the matchmaking only ever groups peers that declared the
*same* key, so the cost is a smaller group or no group for some peers in that round, never a
wrong or split group.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from swarm.averaging.groups.coordinates import Coordinate
from swarm.averaging.groups.grid import Cell, cell_of, join_tight
from swarm.errors import AveragingError, ConfigError
from swarm.identity import PeerID

logger = logging.getLogger(__name__)

NEAR, CROSS, RANDOM, GRID = "near", "cross", "random", "grid"  # GRID: .converge
_KIND_TAG = {NEAR: "n", CROSS: "x", RANDOM: "z", GRID: "g"}
_KEY_CHARS = 16  # of the first member's digest, in hex: unique among a round's groups
CELL_GROUPS = 2  # a cell of a large region holds at least this many groups' worth of peers


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
    view: Mapping[PeerID, Coordinate],
    region_rtt: float,
    cells: Mapping[PeerID, Cell] | None = None,
) -> tuple[tuple[PeerID, ...], ...]:
    """The peers of each grid cell (see the module docstring): a peer's cell is its entry in
    ``cells`` (what it published), else the one its coordinate lies in.

    Returns:
        Regions ordered by their smallest PeerID, each sorted by PeerID.

    Raises:
        AveragingError: coordinates of different dimension counts.
    """
    peers, clusters = _clusters(view, region_rtt, cells)
    return _as_regions(peers, clusters)


def _clusters(
    view: Mapping[PeerID, Coordinate],
    region_rtt: float,
    cells: Mapping[PeerID, Cell] | None = None,
) -> tuple[list[PeerID], list[list[int]]]:
    """The peers by PeerID and the peers of each region: a cell, or tight neighbours joined."""
    peers = sorted(view, key=lambda p: p.digest)
    if not peers:
        return [], []
    if len({view[p].dims for p in peers}) > 1:
        raise AveragingError("coordinates of different dimension counts cannot be compared")
    published = cells or {}
    found: dict[Cell, list[int]] = {}
    for k, p in enumerate(peers):
        cell = published.get(p) or cell_of(view[p], region_rtt)
        found.setdefault(cell, []).append(k)
    vectors = np.array([view[p].vector for p in peers], dtype=np.float64)
    return peers, join_tight(found, vectors, region_rtt)


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
    dist = _predicted_rtts(coords, [k for c in small for k in c])
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


def _predicted_rtts(coords: Sequence[Coordinate], rows: Sequence[int]) -> np.ndarray:
    """:func:`predict_rtt` from each of ``rows`` to every peer, vectorized (a Python loop took
    0.4 s at 1024 peers): ``[r, j]`` is the prediction between ``rows[r]`` and ``j``, inf for a
    peer itself. Elementwise float64 operations give the same bits on every platform (they may
    differ from ``math.dist`` in the last bit)."""
    vectors = np.array([c.vector for c in coords], dtype=np.float64)
    heights = np.array([c.height for c in coords], dtype=np.float64)
    picked = np.asarray(rows, dtype=np.intp)
    dist, scratch = np.zeros((len(picked), len(coords))), np.empty((len(picked), len(coords)))
    for k in range(vectors.shape[1]):
        np.subtract(vectors[picked, k, None], vectors[None, :, k], out=scratch)
        dist += np.square(scratch, out=scratch)
    np.sqrt(dist, out=dist)
    dist += heights[picked, None]
    dist += heights[None, :]
    dist[np.arange(len(picked)), picked] = np.inf
    return dist


def plan_groups(
    view: Mapping[PeerID, Coordinate],
    round_: int,
    config: GroupingConfig,
    cells: Mapping[PeerID, Cell] | None = None,
) -> GroupPlan:
    """Near groups in regular rounds, cross-region groups in every ``cross_every``-th round.

    Args:
        view: coordinate of every peer looking for a group this round, this peer included.
        round_: the averaging round (the same on every peer, e.g. the training epoch).
        config: group sizes, cross-round period and region diameter.
        cells: the grid cell each peer published (:mod:`.grid`); a peer without one is placed
            by its coordinate.

    Raises:
        AveragingError: coordinates of different dimension counts.
    """
    peers, clusters = _clusters(view, config.region_rtt, cells)
    regions = _as_regions(peers, clusters)
    able = [r for r in regions if len(r) >= config.min_group_size]
    if (config.is_cross_round(round_) and len(regions) > 1) or not able:
        # mix the regions (one region: nothing to mix; none can average alone: mix everyone)
        groups = {group_key_of(round_, CROSS, g): g for g in _mixed(regions, round_, config)}
        return GroupPlan(round_, CROSS, regions, groups)
    groups = {}
    near, alone = _attach_small([view[p] for p in peers], clusters, config)
    for region in near:
        for cell in _cells(hashed([peers[k] for k in region], round_, NEAR), config):
            groups.update({group_key_of(round_, NEAR, g): g for g in cut(cell, config)})
    return GroupPlan(round_, NEAR, regions, groups, tuple(peers[k] for k in sorted(alone)))


def random_plan(
    view: Mapping[PeerID, Coordinate],
    round_: int,
    config: GroupingConfig,
    cells: Mapping[PeerID, Cell] | None = None,
) -> GroupPlan:
    """The sizes of :func:`plan_groups`' groups, filled with peers in a hashed random order."""
    plan = plan_groups(view, round_, config, cells)
    sizes = [len(g) for g in plan.groups.values()]
    order = [p for _, p in hashed(sorted(view, key=lambda p: p.digest), round_, RANDOM)]
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
    cells: Mapping[PeerID, Cell] | None = None,
) -> str | None:
    """This peer's matchmaking key for ``round_`` (see :func:`plan_groups`, :func:`random_plan`);
    None when it sits the round out (alone in its region in a regular round).

    Raises:
        AveragingError: ``me`` is not in ``view``, or coordinates cannot be compared.
    """
    if me not in view:
        raise AveragingError(f"the view of round {round_} must include this peer ({me.short})")
    plan = (random_plan if randomized else plan_groups)(view, round_, config, cells)
    key = plan.key_of(me)
    size = len(plan.groups[key]) if key is not None else 1
    logger.debug("round %d: %s group %s of %d", round_, plan.kind, key, size)
    return key


def without_round(key: str) -> str:
    """``key`` without its round number, for callers whose round numbers may differ between
    peers (e.g. counted locally): near groups of a region then still meet."""
    return key.split(".", 1)[1]


def hashed(peers: Sequence[PeerID], round_: int, kind: str) -> list[tuple[int, PeerID]]:
    """``peers`` in an order that every peer computes alike and that changes every round, each
    with its place in that order: a 64-bit hash of (kind, round, PeerID)."""
    salt = f"swarm/groups/{kind}/{round_}/".encode()
    keyed = [(hashlib.sha256(salt + p.digest).digest(), p) for p in peers]
    return [(int.from_bytes(h[:8], "big"), p) for h, p in sorted(keyed, key=lambda e: e[0])]


def _cells(hashed: Sequence[tuple[int, PeerID]], config: GroupingConfig) -> list[list[PeerID]]:
    """Runs of ``hashed`` that are dyadic intervals of the hash space: halved while both halves
    hold at least ``CELL_GROUPS * target_group_size`` peers (see the module docstring)."""
    least = CELL_GROUPS * config.target_group_size
    keys = [k for k, _ in hashed]
    cells: list[list[PeerID]] = []
    pending = [(0, len(keys), 0, 1 << 64)]  # [start, end) of keys in [low, low + width)
    while pending:
        start, end, low, width = pending.pop()
        middle = low + width // 2
        cut = bisect.bisect_left(keys, middle, start, end)
        if width > 1 and cut - start >= least and end - cut >= least:
            pending += [(cut, end, middle, width // 2), (start, cut, low, width // 2)]
        else:
            cells.append([p for _, p in hashed[start:end]])
    return cells


def _mixed(
    regions: Sequence[Sequence[PeerID]], round_: int, config: GroupingConfig
) -> list[tuple[PeerID, ...]]:
    """Cross-round groups: cells of every peer by a hash of the round, each dealt round-robin
    in the order of its members' regions (see the module docstring)."""
    region_of = {p: k for k, region in enumerate(regions) for p in region}
    order = hashed([p for region in regions for p in region], round_, CROSS)
    rank = {p: k for k, (_, p) in enumerate(order)}
    groups = []
    for cell in _cells(order, config):
        groups += _deal(sorted(cell, key=lambda p: (region_of[p], rank[p])), config)
    return groups


def _deal(order: Sequence[PeerID], config: GroupingConfig) -> list[tuple[PeerID, ...]]:
    """Round-robin into ``ceil(n / target)`` groups: balanced sizes, none above the target."""
    count = max(1, math.ceil(len(order) / config.target_group_size))
    return [tuple(order[i::count]) for i in range(count) if order[i::count]]


def cut(order: Sequence[PeerID], config: GroupingConfig) -> list[tuple[PeerID, ...]]:
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
