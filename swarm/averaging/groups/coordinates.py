"""Vivaldi network coordinates with a height term (sans-I/O).

Dabek, Cox, Kaashoek, Morris: "Vivaldi: A Decentralized Network Coordinate System", SIGCOMM 2004.
Each peer keeps a :class:`Coordinate`, a point ``x_i`` in a low-dimensional Euclidean space plus a
height ``h_i`` (the access link: a packet goes up from the peer, across, and down to the other
peer, section 5.4), so the predicted round-trip time is ``||x_i - x_j|| + h_i + h_j``. After each
RTT sample to a peer ``j`` whose coordinate it knows, peer ``i`` moves along the spring force
between them (section 3) with the adaptive timestep of section 3.4 (Figure 3)::

    w   = e_i / (e_i + e_j)                       # sample weight: trust the surer peer more
    e_s = | ||x_i - x_j|| - rtt | / rtt            # relative error of this sample
    e_i = e_s * ce * w + e_i * (1 - ce * w)        # moving average of our own error
    delta = cc * w                                 # adaptive timestep
    x_i = x_i + delta * (rtt - ||x_i - x_j||) * u(x_i - x_j)

Units are seconds throughout (the same as :meth:`swarm.net.transport.Transport.ping`).

A coordinate rides in :attr:`swarm.net.record.PeerRecord.extra` as :meth:`Coordinate.to_wire`
(a short msgpack-able list); :meth:`Coordinate.from_wire` validates what another peer sent and
raises :class:`~swarm.errors.AveragingError` for anything malformed or out of bounds.
"""

from __future__ import annotations

import logging
import math
import random
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from swarm.errors import AveragingError, ConfigError

logger = logging.getLogger(__name__)

WIRE_FORMAT = 1
MAX_DIMS = 8  # a few dimensions suffice (the paper finds 2-D + height as good as 5-D)
MAX_COMPONENT = 100.0  # seconds: no coordinate component (or height) is ever further out
MAX_ERROR = 1.5  # relative error estimates are clamped to this (and start at it)
MIN_HEIGHT = 1e-5  # seconds: a height never reaches 0, so coincident peers can still separate
MIN_OWN_ERROR = 1e-3  # our own error never reaches 0: w = 0 would freeze the coordinate for good
_EPS = 1e-12


@dataclass(frozen=True)
class Coordinate:
    """A point in Vivaldi space: Euclidean ``vector``, ``height`` and an error estimate."""

    vector: tuple[float, ...]  # x_i, seconds per component, 1..MAX_DIMS components
    height: float  # h_i >= 0, seconds: the access-link part of every RTT to this peer
    error: float  # e_i in [0, MAX_ERROR]: relative error of our predictions (1 = clueless)

    def __post_init__(self) -> None:
        vector = self.vector
        if not isinstance(vector, tuple) or not 1 <= len(vector) <= MAX_DIMS:
            raise ConfigError(f"a coordinate vector is a tuple of 1..{MAX_DIMS} floats")
        for name, value, low, high in (
            *(("vector component", v, -MAX_COMPONENT, MAX_COMPONENT) for v in vector),
            ("height", self.height, 0.0, MAX_COMPONENT),
            ("error", self.error, 0.0, MAX_ERROR),
        ):
            if isinstance(value, bool) or not isinstance(value, float):
                raise ConfigError(f"coordinate {name} must be a float, not {type(value).__name__}")
            if not (math.isfinite(value) and low <= value <= high):
                raise ConfigError(f"coordinate {name} {value!r} is outside [{low}, {high}]")

    @classmethod
    def origin(cls, dims: int = 4) -> Coordinate:
        """Where every peer starts: the origin, minimal height, maximal error."""
        return cls((0.0,) * dims, MIN_HEIGHT, MAX_ERROR)

    @property
    def dims(self) -> int:
        return len(self.vector)

    def to_wire(self) -> list[Any]:
        """The msgpack-able form for ``PeerRecord.extra`` (about 10 bytes per component)."""
        return [WIRE_FORMAT, list(self.vector), self.height, self.error]

    @classmethod
    def from_wire(cls, obj: Any) -> Coordinate:
        """Validate a coordinate received from another peer (as produced by :meth:`to_wire`).

        Integers are accepted for floats (a foreign msgpack encoder may write ``0`` for ``0.0``).

        Raises:
            AveragingError: not a ``[format, [floats], height, error]`` list, wrong dimension
                count, or a value that is not finite or out of bounds.
        """
        if not isinstance(obj, (list, tuple)) or len(obj) != 4 or obj[0] != WIRE_FORMAT:
            raise AveragingError(f"coordinate: expected [{WIRE_FORMAT}, vector, height, error]")
        _, raw_vector, height, error = obj
        if not isinstance(raw_vector, (list, tuple)) or not 1 <= len(raw_vector) <= MAX_DIMS:
            raise AveragingError(f"coordinate: the vector must have 1..{MAX_DIMS} components")
        try:
            return cls(tuple(_as_float(v) for v in raw_vector), _as_float(height), _as_float(error))
        except ConfigError as e:
            raise AveragingError(f"invalid coordinate: {e}") from e


def _as_float(value: Any) -> Any:
    """Ints (not bools) as floats; anything else unchanged, for ``__post_init__`` to judge."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) <= 2**53:
        return float(value)
    return value


def predict_rtt(a: Coordinate, b: Coordinate) -> float:
    """Predicted round-trip time in seconds: ``||x_a - x_b|| + h_a + h_b``.

    Raises:
        AveragingError: the coordinates have different dimension counts.
    """
    if a.dims != b.dims:
        raise AveragingError(f"coordinates of {a.dims} and {b.dims} dimensions cannot be compared")
    return math.dist(a.vector, b.vector) + a.height + b.height


@dataclass(frozen=True)
class VivaldiConfig:
    """Tuning of :class:`Vivaldi`; the defaults are the paper's (cc = ce = 0.25).

    Raise ``cc`` to converge faster at the cost of oscillation; lower ``ce`` when RTT samples
    are noisy so that one bad sample does not make a peer overconfident.
    """

    dims: int = 4  # Euclidean dimensions besides the height
    cc: float = 0.25  # c_c: fraction of the way to move per sample (at equal errors)
    ce: float = 0.25  # c_e: weight of a new sample in the moving average of the error
    min_rtt: float = 1e-5  # seconds: smaller samples are clamped up (loopback, clock quantum)
    max_rtt: float = 10.0  # seconds: larger samples are rejected (a stalled peer, not a path)
    filter_size: int = 4  # recent RTT samples kept per peer (1 = no filter)
    filter_percentile: float = 0.25  # which of them is used: 0 = the lowest, 0.5 = the median
    max_filtered_peers: int = 1024  # peers whose recent samples are kept (oldest forgotten)

    def __post_init__(self) -> None:
        if not 1 <= self.dims <= MAX_DIMS:
            raise ConfigError(f"vivaldi dims must be in 1..{MAX_DIMS}")
        if not (0 < self.cc <= 1 and 0 < self.ce <= 1):
            raise ConfigError("vivaldi cc and ce must be in (0, 1]")
        if not 0 < self.min_rtt < self.max_rtt <= MAX_COMPONENT:
            raise ConfigError(f"vivaldi needs 0 < min_rtt < max_rtt <= {MAX_COMPONENT}")
        if self.filter_size < 1 or self.max_filtered_peers < 1:
            raise ConfigError("vivaldi filter_size and max_filtered_peers must be >= 1")
        if not 0 <= self.filter_percentile <= 1:
            raise ConfigError("vivaldi filter_percentile must be in [0, 1]")


class Vivaldi:
    """This peer's Vivaldi state: its coordinate, updated by one RTT sample at a time.

    Args:
        config: tuning (see :class:`VivaldiConfig`).
        coordinate: where to start (default: :meth:`Coordinate.origin`), e.g. from a checkpoint.
        rng: source of the random direction used when two peers sit at the same point; pass a
            seeded ``random.Random`` for reproducible simulations.

    Attributes:
        coordinate: the current coordinate; publish it with :meth:`Coordinate.to_wire`.

    Raises:
        ConfigError: ``coordinate`` has another dimension count than ``config.dims``.
    """

    def __init__(
        self,
        config: VivaldiConfig | None = None,
        coordinate: Coordinate | None = None,
        rng: random.Random | None = None,
    ):
        self.config = config or VivaldiConfig()
        self.coordinate = coordinate or Coordinate.origin(self.config.dims)
        if self.coordinate.dims != self.config.dims:
            raise ConfigError(
                f"start coordinate has {self.coordinate.dims} dims, not {self.config.dims}"
            )
        self.rng = rng or random.Random()
        self._samples: dict[Hashable, deque[float]] = {}

    def observe(self, rtt: float, remote: Coordinate, peer: Hashable | None = None) -> Coordinate:
        """Update our coordinate with one RTT sample to a peer at ``remote``.

        Args:
            rtt: measured round-trip time in seconds; values below ``config.min_rtt`` are
                clamped up to it.
            remote: the peer's coordinate (validated, e.g. by :meth:`Coordinate.from_wire`).
            peer: the peer's identity: when given, a low percentile (``filter_percentile``) of
                its last ``filter_size`` samples is used instead of ``rtt`` alone. Queues and a
                busy event loop (a training step holding the CPU) only ever add delay, so the
                low end of recent samples tracks the path (Ledlie et al., "Network Coordinates
                in the Wild", NSDI 2007: a moving percentile filter).

        Returns:
            The new coordinate.

        Raises:
            AveragingError: ``rtt`` is not a finite number in ``[0, config.max_rtt]``, or
                ``remote`` has another dimension count.
        """
        cfg = self.config
        if isinstance(rtt, bool) or not isinstance(rtt, (int, float)) or not math.isfinite(rtt):
            raise AveragingError(f"RTT sample {rtt!r} is not a finite number")
        if not 0 <= rtt <= cfg.max_rtt:
            raise AveragingError(f"RTT sample {rtt!r} s is outside [0, {cfg.max_rtt}] s")
        if remote.dims != cfg.dims:
            raise AveragingError(f"remote coordinate has {remote.dims} dims, not {cfg.dims}")
        rtt = max(float(rtt), cfg.min_rtt)
        if peer is not None:
            rtt = self._filtered(peer, rtt)
        local = self.coordinate
        dist = predict_rtt(local, remote)
        w = local.error / max(local.error + remote.error, _EPS)
        e_s = abs(dist - rtt) / rtt
        error = min(e_s * cfg.ce * w + local.error * (1 - cfg.ce * w), MAX_ERROR)
        delta = cfg.cc * w
        force = delta * (rtt - dist)  # > 0 pushes us away from the remote peer
        v = [a - b for a, b in zip(local.vector, remote.vector, strict=True)]
        norm = math.hypot(*v)
        if norm > _EPS:
            # u(x_i - x_j) in the height-augmented space: [v, h_i + h_j] / dist
            vector = [a + force * d / dist for a, d in zip(local.vector, v, strict=True)]
            height = local.height + force * (local.height + remote.height) / dist
        else:  # same point: the paper picks a random direction
            unit = self._random_unit()
            vector = [a + force * d for a, d in zip(local.vector, unit, strict=True)]
            height = local.height
        self.coordinate = Coordinate(
            tuple(min(max(c, -MAX_COMPONENT), MAX_COMPONENT) for c in vector),
            min(max(height, MIN_HEIGHT), MAX_COMPONENT),
            max(error, MIN_OWN_ERROR),
        )
        return self.coordinate

    def _filtered(self, peer: Hashable, rtt: float) -> float:
        window = self._samples.pop(peer, None)  # re-inserted last: dict order = recency
        if window is None:
            window = deque(maxlen=self.config.filter_size)
            while len(self._samples) >= self.config.max_filtered_peers:
                del self._samples[next(iter(self._samples))]
        window.append(rtt)
        self._samples[peer] = window
        ordered = sorted(window)
        return ordered[int(self.config.filter_percentile * (len(ordered) - 1))]

    def _random_unit(self) -> list[float]:
        while True:
            v = [self.rng.gauss(0.0, 1.0) for _ in range(self.config.dims)]
            norm = math.hypot(*v)
            if norm > 1e-6:
                return [c / norm for c in v]
