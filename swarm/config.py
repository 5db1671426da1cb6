"""Typed, validated settings of a peer.

Every knob lives in a frozen dataclass validated in ``__post_init__``: a broken setting or a
broken combination raises :class:`~swarm.errors.ConfigError` when the config is built, not later
in the middle of a round. How a peer joins (:class:`~swarm.peer_config.PeerConfig`) lives beside
the peer, and the named choices (:class:`Mode`, :class:`Grouping`, :class:`Aggregator`) in
:mod:`swarm.choices`; both are importable from here too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from swarm.choices import AGGREGATORS, GROUPINGS, TRAINING_MODES, Aggregator, Grouping, Mode
from swarm.compression.spec import CodecSpec
from swarm.errors import ConfigError
from swarm.options import SECTION, build_tree
from swarm.peer_config import DEFAULT_BANDWIDTH, DEFAULT_LISTEN, PeerConfig
from swarm.round_schedule import parse_inner_steps

__all__ = [
    "AGGREGATORS",
    "DEFAULT_BANDWIDTH",
    "DEFAULT_LISTEN",
    "GROUPINGS",
    "TRAINING_MODES",
    "Aggregator",
    "AveragingConfig",
    "Grouping",
    "Mode",
    "PeerConfig",
    "SwarmConfig",
]


DENSE_ANCHOR_SYNC_EVERY = 4  # anchor_sync_every's default with a dense codec (+25% bytes)
# ... and with update scoring on (+50% bytes): peers sending their updates of 10 rounds ago,
# which scoring cannot name, part the honest peers' anchors unless groups sync this often (the
# README's "Slow poison" has the measured runs)
SCORED_ANCHOR_SYNC_EVERY = 2
SPARSE_ANCHOR_SYNC_EVERY = 8  # ... and with a sparse one (see the README's fidelity notes)
# ... and in gradients mode, where a sync moves parameters that differ: after a step taken alone
# an Adam state stays apart for thousands of steps, and its parameters differ again after each
# sync by the step sizes' differences (2 peers: 8e-5 after 4 steps), not by a whole step
GRADIENTS_SYNC_EVERY = 16
SPARSE_ANCHOR_SYNC_CODEC = "int8"  # anchor_sync_codec's default with a sparse codec
# The outer step's defaults: DiLoCo's Nesterov step, with every codec (the README's fidelity
# notes have the measured difference with SparseLoCo's plain step under the sparse codecs)
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
ROUND_CLEANUP_S = 1.0  # of a round's time, kept for closing streams after the all-reduce
LOCKSTEP_GATHER_S = 0.05  # gather window of gradients mode: every step is a round, peers in step


@dataclass(frozen=True)
class AveragingConfig:
    """How an :class:`~swarm.averaging.Averager` forms groups and averages.

    One timeout story: a round (matchmaking, then all-reduce) ends within ``round_timeout_s``;
    matchmaking gives up after ``matchmaking_timeout_s`` and the all-reduce gets what is left
    of the round (:attr:`allreduce_timeout_s`), so the two can never disagree.

    Args:
        codec: compression of what is averaged: ``none``, ``fp16``, ``bf16``, ``int8``,
            ``topk:0.01``, ``1bit`` (see :mod:`swarm.compression`); error feedback is always on
            for lossy codecs. Peers with different codecs never group.
        min_group_size: average only with at least this many peers (this one included).
        target_group_size: a group closes as soon as it has this many members.
        matchmaking_timeout_s: how long to look for a group. A peer alone pays it every round;
            increase it if groups form too small on a slow DHT.
        round_timeout_s: upper bound of a whole round; an owner that never answers costs what
            is left of it after matchmaking. Set it above matchmaking plus payload / slowest
            link rate with a good margin.
        gather_window_s: wait after declaring before choosing a leader, so that peers arriving
            at about the same time end up in one group. Increase it for large swarms. None (the
            default) means 0.5 s, or a quarter of ``matchmaking_timeout_s`` when that is
            shorter, or 0.05 s in ``gradients`` mode (every step is a round in lockstep); the
            value in use is :attr:`gather_window`.
        stall_timeout_min_s: a silent peer is never dropped sooner than this after its last
            chunk; beyond it, the limit is ``stall_factor`` chunk-times at the measured rate.
            6 s: behind 10 Mbit/s links healthy streams go quiet for 3-4 s (README, measured).
        stall_factor: see ``stall_timeout_min_s``; increase both on very jittery links.
        group_key: matchmaking key prefix: averagers with different keys never group.
        grouping: ``latency`` (near peers by Vivaldi coordinates, regions mixed every
            ``cross_every``-th round), ``random`` (same sizes, random members; a baseline) or
            ``fixed`` (every peer declares under ``group_key`` alone). Text or a
            :class:`Grouping`; it reads back as a :class:`Grouping`.
        cross_every: period of cross-region rounds; None never mixes regions (experiments only).
        region_rtt_s: sizes the grid cells that make regions: two peers of a region are at
            most this predicted RTT apart, before their heights (their access links).
        probe_period_s: seconds between rounds of RTT probes (``latency``/``random`` only).
        probes_per_period: peers pinged per probe round.
        name: route prefix (``{name}.join``, ``{name}.part``), to run several averagers on one
            peer.
        threads: worker threads for compression and reduction.
        aggregator: how a part owner reduces its part. ``centered_clip`` (default): weights
            capped at ``weight_cap`` times the group's median, then CenteredClip around the
            coordinate-wise median with the radius at the median of the senders' distances, so
            no peer can drag the result further than its weight share times that radius.
            ``mean``: the plain weighted mean, for swarms whose peers are all trusted (cheaper:
            chunks are added as they arrive; see the README for the measured cost). Text or an
            :class:`Aggregator`; it reads back as an :class:`Aggregator`.
        weight_cap: see ``aggregator``.
        max_share: no member owns more than ``max_share / N`` of the vector, whatever
            bandwidth it announces.
        check_owners: a member refuses a part whose returned average lies implausibly far from
            its own values compared with the other parts (:mod:`swarm.averaging.butterfly.checks`),
            accuses its owner in the round report and, at a second accusation within 8 rounds,
            excludes it from its next rounds (:mod:`swarm.averaging.butterfly.exclusions`).
        score_updates: in rounds that average updates (DiLoCo pseudo-gradients, gradients), the
            owner of a part weighs each sender by how far its running alignment with the part's
            robust mean, its progress along it and the balance of its values around it lie from
            the owner's own (:mod:`swarm.averaging.butterfly.scoring`): updates that keep
            pointing away (IPM, a free rider's zero), shrink inside the clip radius or sit below
            the mean everywhere (ALIE) lose their weight within a few dozen rounds.
            ``centered_clip`` only. It turns the part layout with every group, so peers with
            and without it never group. Off by default: peers that train fewer steps than the
            others lose weight for honest reasons (README, "Slow poison"). With a dense codec
            it also makes groups sync their anchors twice as often (see
            ``SwarmConfig.anchor_sync_every``).
    """

    codec: str = "int8"
    min_group_size: int = 2
    target_group_size: int = 8
    matchmaking_timeout_s: float = 15.0
    round_timeout_s: float = 120.0
    gather_window_s: float | None = None
    stall_timeout_min_s: float = 6.0
    stall_factor: float = 8.0
    group_key: str = "default"
    grouping: Grouping | str = Grouping.LATENCY
    cross_every: int | None = 4
    region_rtt_s: float = 0.05
    probe_period_s: float = 5.0
    probes_per_period: int = 4
    name: str = "avg"
    threads: int = 2
    aggregator: Aggregator | str = Aggregator.CENTERED_CLIP
    weight_cap: float = 2.0
    max_share: float = 2.0
    check_owners: bool = True
    score_updates: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "codec", CodecSpec.parse(self.codec).text)
        if not 2 <= self.min_group_size <= self.target_group_size:
            raise ConfigError("need 2 <= min_group_size <= target_group_size")
        if not self.matchmaking_timeout_s > 0:
            raise ConfigError("matchmaking_timeout_s must be positive")
        if not self.round_timeout_s >= self.matchmaking_timeout_s + 2 * ROUND_CLEANUP_S:
            raise ConfigError(
                "round_timeout_s must exceed matchmaking_timeout_s by at least "
                f"{2 * ROUND_CLEANUP_S:g} s, or the all-reduce would have no time"
            )
        if not 0 <= self.gather_window < self.matchmaking_timeout_s:
            raise ConfigError("gather_window_s must be within [0, matchmaking_timeout_s)")
        if not self.stall_timeout_min_s > 0 or not self.stall_factor >= 1:
            raise ConfigError("stall_timeout_min_s must be positive and stall_factor >= 1")
        if not isinstance(self.group_key, str) or not self.group_key or "/" in self.group_key:
            raise ConfigError("group_key must be a non-empty string without '/'")
        if self.grouping not in GROUPINGS:
            raise ConfigError(f"grouping must be one of {GROUPINGS}, not {self.grouping!r}")
        object.__setattr__(self, "grouping", Grouping(self.grouping))
        if self.cross_every is not None and self.cross_every < 1:
            raise ConfigError("cross_every must be >= 1 or None")
        if not self.region_rtt_s > 0 or not self.probe_period_s > 0:
            raise ConfigError("region_rtt_s and probe_period_s must be positive")
        if self.probes_per_period < 1 or self.threads < 1:
            raise ConfigError("probes_per_period and threads must be >= 1")
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError("name must be a non-empty string")
        if self.aggregator not in AGGREGATORS:
            raise ConfigError(f"aggregator must be one of {AGGREGATORS}, not {self.aggregator!r}")
        object.__setattr__(self, "aggregator", Aggregator(self.aggregator))
        if not self.weight_cap >= 1 or not self.max_share >= 1:
            raise ConfigError("weight_cap and max_share must be >= 1")

    @property
    def codec_spec(self) -> CodecSpec:
        """The codec, parsed: its name, whether it is sparse."""
        return CodecSpec.parse(self.codec)

    @property
    def gather_window(self) -> float:
        """The gather window in use (``gather_window_s``, or its default)."""
        if self.gather_window_s is not None:
            return self.gather_window_s
        return min(0.5, self.matchmaking_timeout_s / 4)

    @property
    def allreduce_timeout_s(self) -> float:
        """The all-reduce's share of a round when matchmaking takes all of its time."""
        return self.round_timeout_s - self.matchmaking_timeout_s - ROUND_CLEANUP_S


@dataclass(frozen=True)
class SwarmConfig:
    """How a peer trains with the swarm: one tree of settings, each field defined once.

    ``SwarmConfig(peer=PeerConfig(...), averaging=AveragingConfig(...), inner_steps=...)``, or
    from flat keywords, routed to the config that owns each one
    (:meth:`SwarmConfig.build`, which ``Swarm(...)`` uses)::

        SwarmConfig.build(inner_steps=50, codec="int8", relay_slots=0, aggregator="mean")

    Args:
        peer: how the peer joins the swarm (addresses, identity, membership, reachability).
        averaging: how groups form and average (codec, group sizes, timeouts, aggregator).
        mode: ``diloco`` (average the pseudo-gradient every ``inner_steps`` and apply an outer
            Nesterov step), ``local_sgd`` (average parameters every ``inner_steps``) or
            ``gradients`` (average gradients every step, like DDP; for small swarms on fast links).
            Text or a :class:`Mode`; it reads back as a :class:`Mode`.
        inner_steps: local optimizer steps between averaging rounds (forced to 1 for
            ``gradients``). More steps send fewer bytes; increase it on slow links, decrease it if
            the loss jumps after each round. ``"auto"``: the peer measures its step time and
            its rounds' time and picks the steps so that a round hides behind them (overlapped)
            or costs at most 5% of the time (blocking), within ``min_inner_steps`` and
            ``max_inner_steps`` (see :mod:`swarm.training.cadence`); every step report and the
            status table show the value in use. A duration such as ``"30s"``: rounds fall due
            on the wall clock, at the same instants for every peer, so peers of unequal speed
            arrive together, each with the steps it managed (the choice for mixed hardware).
        min_inner_steps, max_inner_steps: the range ``"auto"`` picks from (ignored otherwise).
        outer_lr: outer learning rate. None (the default) means DiLoCo's 0.7.
        outer_momentum: outer Nesterov momentum. None (the default) means DiLoCo's 0.9. A
            round with ``k`` peers uses at most ``1 - 1/k`` (2 peers: 0.5, 4: 0.75), and a peer
            alone takes no outer step at all (plain local training), so the default is stable
            at every group size; see :func:`swarm.training.outer_rule.outer_rule`. In ``diloco``
            with a sparse codec (``sparse``, ``topk``, ``1bit``: their error feedback lives in
            the model, see :meth:`swarm.training.outer.OuterState.keep_unsent`) the momentum
            is folded into the step size instead: a plain step of ``outer_lr / (1 - β)``, β
            capped as above and at 0.875, and in a pair at 2/3 (2 peers: 2.1, 4: 2.8, 8 or
            more: 5.6 with the defaults).
        nesterov: use Nesterov momentum in the outer step; False gives heavy-ball momentum.
        anchor_sync_every: ``diloco``: about one group in this many also averages the
            members' anchors (the shared weights the outer step moves), after the
            pseudo-gradients and within the same group, in ``anchor_sync_codec``. Groups smaller
            than the swarm apply different outer steps, so without it the peers' anchors drift
            apart for good; the extra all-reduce costs one more vector on those rounds. An
            overlapped round syncs the anchors it started from, and its landing starts from
            their mean. A group whose members joined with the same anchors (a group of the
            whole swarm, all healthy) skips it: nothing would move. With a sparse codec the
            outer step keeps no momentum, so the members of a group that synced leave with one
            outer state, bit for bit. 0 turns it off; None (the
            default) means :data:`DENSE_ANCHOR_SYNC_EVERY` with a dense codec
            (:data:`SCORED_ANCHOR_SYNC_EVERY` with ``score_updates``: late updates from hostile
            peers part the anchors of the groups they join) and
            :data:`SPARSE_ANCHOR_SYNC_EVERY` with a sparse one, whose rounds are so small that
            one dense sync costs as much as about 40 of them; the value in use is
            :attr:`anchor_sync_period`. Lower it if the peers' losses part, raise it if the
            bytes matter more (the README has the measured trade-off). ``gradients``: about
            one group in this many whose members' parameters differ (one missed a round, or
            averaged in another group, and stepped with other gradients) also averages the
            parameters, so that they do not stay apart for good; the parameters of peers in
            step are the same bits, so their groups send nothing more (each round costs a
            digest of the parameters, a pass over them while the group forms). Its default
            there is :data:`GRADIENTS_SYNC_EVERY`: after a step taken alone, optimizer states
            such as Adam's stay apart for thousands of steps, and so do the parameters again
            after each sync, by a little. ``local_sgd`` averages the values and needs none.
        anchor_sync_codec: the codec of that sync: a dense one (``none``, ``fp16``, ``bf16``,
            ``int8``), since top-K or 1-bit would ruin raw weights. None (the default) means
            ``codec`` when it is dense and ``int8`` when it is sparse; the value in use is
            :attr:`anchor_sync_spec`.
        sync_on_join: a peer started with ``initial_peers`` downloads the current model and outer
            state from live peers before its first step (a late joiner); a first peer finds none
            and starts from its own weights.
        state_timeout_s: upper bound on that download.
        max_state_bytes: largest state a joiner accepts from others (protects its memory).
        state_parts: largest number of providers a joiner downloads parts from at once.
        overlap: a due round runs in the background while the next inner steps go on, and its
            outer update lands one or more steps late (see :mod:`swarm.training.overlap`); a
            slow link then costs bandwidth, not compute. None (the default) means True for
            ``diloco`` and False for the other modes, whose rounds always block; False blocks
            ``step()`` for the whole round, as DiLoCo's Algorithm 1.
        outer_device: where the fp32 outer state (anchor, momentum, averaging slots and the
            error-feedback residuals) lives; None = the model's device. ``"cpu"`` with a CUDA
            model keeps it in pinned host memory: 12 bytes of GPU memory per parameter saved
            (anchor, momentum, averaging slots), 16 with overlap (its in-flight copy), for two
            copies between host and GPU per round. Error-feedback residuals follow the slots.
        fragments: ``diloco``: cut the model into this many fragments of equal size (in the
            model's order; see :mod:`swarm.training.fragments`) whose rounds take turns
            (Streaming DiLoCo, Douillard et al. 2025): a round every ``inner_steps / fragments``
            steps averages the next fragment's pseudo-gradient, so each fragment still averages
            every ``inner_steps`` steps while one round moves ``1 / fragments`` of the bytes. 1
            (the default) averages the whole model at once. ``inner_steps`` must be a multiple.
    """

    peer: PeerConfig = field(default_factory=PeerConfig, metadata=SECTION)
    averaging: AveragingConfig = field(default_factory=AveragingConfig, metadata=SECTION)
    mode: Mode | str = Mode.DILOCO
    inner_steps: int | str = 100
    min_inner_steps: int = 10
    max_inner_steps: int = 500
    outer_lr: float | None = None
    outer_momentum: float | None = None
    nesterov: bool = True
    anchor_sync_every: int | None = None
    anchor_sync_codec: str | None = None
    sync_on_join: bool = True
    state_timeout_s: float = 120.0
    max_state_bytes: int = 16 << 30
    state_parts: int = 4
    overlap: bool | None = None
    outer_device: str | None = None
    fragments: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.peer, PeerConfig):
            raise ConfigError("peer must be a PeerConfig")
        if not isinstance(self.averaging, AveragingConfig):
            raise ConfigError("averaging must be an AveragingConfig")
        if self.mode not in TRAINING_MODES:
            raise ConfigError(f"mode {self.mode!r}: use one of {', '.join(TRAINING_MODES)}")
        mode = Mode(self.mode)
        object.__setattr__(self, "mode", mode)
        if mode.averages_gradients:
            object.__setattr__(self, "inner_steps", 1)
            if self.averaging.gather_window_s is None:
                lockstep = dataclasses.replace(self.averaging, gather_window_s=LOCKSTEP_GATHER_S)
                object.__setattr__(self, "averaging", lockstep)
        if self.outer_lr is None:
            object.__setattr__(self, "outer_lr", OUTER_LR)
        if self.outer_momentum is None:
            object.__setattr__(self, "outer_momentum", OUTER_MOMENTUM)
        if not self.outer_lr > 0:
            raise ConfigError("outer_lr must be positive")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError("outer_momentum must be in [0, 1)")
        every = self.anchor_sync_every
        if every is not None and (type(every) is not int or every < 0):
            raise ConfigError("anchor_sync_every must be an integer >= 0 (0: never) or None")
        if self.anchor_sync_codec is not None:
            anchors = CodecSpec.parse(self.anchor_sync_codec)
            if not anchors.dense_values_ok:
                raise ConfigError(
                    f"anchor_sync_codec {anchors} would ruin raw weights: use a dense codec "
                    "(none, fp16, bf16, int8)"
                )
            object.__setattr__(self, "anchor_sync_codec", anchors.text)
        codec = self.averaging.codec_spec
        if mode.averages_values and not codec.dense_values_ok:
            raise ConfigError(
                f"local_sgd averages parameter values, which {codec} would mostly zero or "
                "flatten; use mode='diloco' (it averages changes) or a dense codec (int8, fp16)"
            )
        if not self.state_timeout_s > 0:
            raise ConfigError("state_timeout_s must be positive")
        if self.max_state_bytes < 1 or self.state_parts < 1:
            raise ConfigError("max_state_bytes and state_parts must be >= 1")
        if self.overlap is None:
            object.__setattr__(self, "overlap", mode.has_outer_step)
        elif not isinstance(self.overlap, bool):
            raise ConfigError("overlap must be True, False or None")
        elif self.overlap and not mode.has_outer_step:
            raise ConfigError(
                f"overlap applies the outer step late, which only mode='diloco' has; "
                f"{mode.value} rounds block"
            )
        if self.outer_device not in (None, "cpu"):
            raise ConfigError("outer_device must be None (the model's device) or 'cpu'")
        if type(self.fragments) is not int or self.fragments < 1:
            raise ConfigError("fragments must be an integer >= 1")
        if self.fragments > 1 and not mode.has_outer_step:
            raise ConfigError(
                f"fragments stagger DiLoCo's outer rounds, which only mode='diloco' has; "
                f"{mode.value} averages the whole model"
            )
        try:
            steps = parse_inner_steps(
                self.inner_steps, self.fragments, self.min_inner_steps, self.max_inner_steps
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None
        object.__setattr__(self, "inner_steps", steps)

    @classmethod
    def build(cls, **options: Any) -> SwarmConfig:
        """A config from flat keywords, each routed to the config that owns it.

        Every field of :class:`SwarmConfig`, :class:`~swarm.peer_config.PeerConfig` and
        :class:`AveragingConfig` is a keyword (their names never repeat); ``peer=`` and
        ``averaging=`` may pass whole configs, which the flat keywords of their fields then
        override.

        Raises:
            ConfigError: an unknown keyword (the message names the closest valid one), or an
                invalid value or combination.
        """
        return build_tree(cls, options)

    @property
    def auto_inner_steps(self) -> bool:
        """The peer fits ``inner_steps`` to its link (``inner_steps="auto"``)."""
        return self.inner_steps == "auto"

    @property
    def anchor_sync_period(self) -> int:
        """``anchor_sync_every`` in use: about one group in this many syncs (0: never)."""
        if self.anchor_sync_every is not None:
            return self.anchor_sync_every
        if Mode(self.mode).averages_gradients:
            return GRADIENTS_SYNC_EVERY
        if self.averaging.codec_spec.sparse:
            return SPARSE_ANCHOR_SYNC_EVERY
        return SCORED_ANCHOR_SYNC_EVERY if self.averaging.score_updates else DENSE_ANCHOR_SYNC_EVERY

    @property
    def anchor_sync_spec(self) -> CodecSpec:
        """``anchor_sync_codec`` in use: the round's codec when dense, else ``int8``."""
        if self.anchor_sync_codec is not None:
            return CodecSpec.parse(self.anchor_sync_codec)
        codec = self.averaging.codec_spec
        return codec if codec.dense_values_ok else CodecSpec.parse(SPARSE_ANCHOR_SYNC_CODEC)

    @property
    def round_interval(self) -> int:
        """Local steps between two rounds: ``inner_steps / fragments`` (with ``"auto"``, before
        anything was measured: from ``min_inner_steps``)."""
        steps = self.inner_steps if isinstance(self.inner_steps, int) else self.min_inner_steps
        return max(1, steps // self.fragments)
