"""Vivaldi coordinates: convergence on a synthetic two-region WAN, input bounds, wire validation."""

from __future__ import annotations

import math
import random
import statistics

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarm.averaging.groups.coordinates import (
    MAX_COMPONENT,
    MAX_DIMS,
    MAX_ERROR,
    MIN_HEIGHT,
    Coordinate,
    Vivaldi,
    VivaldiConfig,
    predict_rtt,
)
from swarm.errors import AveragingError, ConfigError

INTRA_ONE_WAY, INTER_ONE_WAY = 0.002, 0.060


def _two_region_rtt(n: int, rng: random.Random) -> list[list[float]]:
    """True RTT matrix: two regions, 2 ms one way inside, 60 ms between, +-10% per pair."""
    rtt = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            one_way = INTRA_ONE_WAY if i % 2 == j % 2 else INTER_ONE_WAY
            rtt[i][j] = rtt[j][i] = 2 * one_way * rng.uniform(0.9, 1.1)
    return rtt


def _simulate(n: int, rounds: int, seed: int) -> tuple[list[Vivaldi], list[list[float]]]:
    rng = random.Random(seed)
    rtt = _two_region_rtt(n, rng)
    nodes = [Vivaldi(VivaldiConfig(), rng=random.Random(seed * 1000 + i)) for i in range(n)]
    for _ in range(rounds):
        for i in range(n):
            j = rng.choice([k for k in range(n) if k != i])
            sample = rtt[i][j] * (1 + rng.expovariate(1 / 0.05))  # queueing noise, mean +5%
            nodes[i].observe(sample, nodes[j].coordinate, peer=j)
    return nodes, rtt


def _relative_errors(
    nodes: list[Vivaldi], rtt: list[list[float]], same: bool | None
) -> list[float]:
    n = len(nodes)
    return [
        abs(predict_rtt(nodes[i].coordinate, nodes[j].coordinate) - rtt[i][j]) / rtt[i][j]
        for i in range(n)
        for j in range(i + 1, n)
        if same is None or (i % 2 == j % 2) == same
    ]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_vivaldi_converges_on_two_regions(seed: int) -> None:
    nodes, rtt = _simulate(n=24, rounds=200, seed=seed)
    assert statistics.median(_relative_errors(nodes, rtt, None)) < 0.25
    assert statistics.median(_relative_errors(nodes, rtt, same=False)) < 0.15
    # the hard part: 4 ms pairs next to 120 ms pairs; still right within a factor of 2
    assert statistics.median(_relative_errors(nodes, rtt, same=True)) < 0.5
    # the error estimates followed: every node is far surer than at the start
    assert all(node.coordinate.error < 0.5 for node in nodes)


def test_two_nodes_settle_at_the_rtt() -> None:
    a, b = Vivaldi(rng=random.Random(1)), Vivaldi(rng=random.Random(2))
    for _ in range(100):
        a.observe(0.1, b.coordinate)
        b.observe(0.1, a.coordinate)
    assert predict_rtt(a.coordinate, b.coordinate) == pytest.approx(0.1, rel=0.02)


def test_predict_rtt_adds_heights() -> None:
    a = Coordinate((0.0, 0.0), 0.01, 1.0)
    b = Coordinate((0.03, 0.04), 0.02, 1.0)
    assert predict_rtt(a, b) == pytest.approx(0.05 + 0.03)
    assert predict_rtt(a, b) == predict_rtt(b, a)
    with pytest.raises(AveragingError):
        predict_rtt(a, Coordinate.origin(3))


@pytest.mark.parametrize("rtt", [math.nan, math.inf, -math.inf, -0.001, 11.0, 1e300, "0.1", True])
def test_bad_rtt_samples_are_rejected(rtt: object) -> None:
    node = Vivaldi()
    before = node.coordinate
    with pytest.raises(AveragingError):
        node.observe(rtt, Coordinate.origin())  # type: ignore[arg-type]
    assert node.coordinate == before


def test_tiny_rtt_is_clamped_and_coordinates_stay_bounded() -> None:
    node = Vivaldi(rng=random.Random(0))
    far = Coordinate((MAX_COMPONENT,) * 4, MAX_COMPONENT, 0.0)
    for rtt in (0.0, 1e-9, 10.0, 0.0, 10.0):
        coord = node.observe(rtt, far)
        assert all(abs(c) <= MAX_COMPONENT for c in coord.vector)
        assert MIN_HEIGHT <= coord.height <= MAX_COMPONENT and 0 <= coord.error <= MAX_ERROR
    with pytest.raises(AveragingError):
        node.observe(0.1, Coordinate.origin(2))  # another dimension count


def test_a_sure_node_still_moves() -> None:
    node = Vivaldi(coordinate=Coordinate((0.0,) * 4, MIN_HEIGHT, 0.0), rng=random.Random(0))
    remote = Coordinate((0.05, 0.0, 0.0, 0.0), MIN_HEIGHT, 0.5)
    node.observe(0.2, remote)
    assert node.coordinate.error > 0
    before = predict_rtt(node.coordinate, remote)
    node.observe(0.2, remote)
    assert predict_rtt(node.coordinate, remote) > before


def test_percentile_filter_damps_spikes() -> None:
    filtered, raw = Vivaldi(rng=random.Random(0)), Vivaldi(rng=random.Random(0))
    remote = Coordinate((0.05, 0.0, 0.0, 0.0), MIN_HEIGHT, 0.1)
    for rtt in (0.05, 0.05, 2.0, 1.5):  # a loaded host: two of four samples inflated
        filtered.observe(rtt, remote, peer="b")
        raw.observe(rtt, remote)
    assert predict_rtt(filtered.coordinate, remote) < predict_rtt(raw.coordinate, remote) / 2


def test_percentile_filter_follows_a_longer_path_within_its_window() -> None:
    node = Vivaldi(rng=random.Random(0))
    window = node.config.filter_size
    remote = Coordinate((0.0,) * 4, MIN_HEIGHT, 0.1)
    for _ in range(40):
        node.observe(0.01, remote, peer="b")
    for _ in range(window - 1):  # the peer moved away: the old low samples still rule
        node.observe(0.2, remote, peer="b")
    assert predict_rtt(node.coordinate, remote) < 0.05
    for _ in range(40):
        node.observe(0.2, remote, peer="b")
    assert abs(predict_rtt(node.coordinate, remote) - 0.2) < 0.02


def test_config_checks() -> None:
    for bad in (
        {"dims": 0},
        {"dims": MAX_DIMS + 1},
        {"cc": 0},
        {"ce": 2},
        {"min_rtt": 0},
        {"filter_percentile": 1.5},
    ):
        with pytest.raises(ConfigError):
            VivaldiConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        Vivaldi(VivaldiConfig(dims=2), Coordinate.origin(3))


# ---- wire form


@given(
    st.lists(st.floats(-MAX_COMPONENT, MAX_COMPONENT), min_size=1, max_size=MAX_DIMS),
    st.floats(0, MAX_COMPONENT),
    st.floats(0, MAX_ERROR),
)
def test_wire_round_trip(vector: list[float], height: float, error: float) -> None:
    coord = Coordinate(tuple(vector), height, error)
    packed = msgpack.packb(coord.to_wire(), use_bin_type=True)
    assert len(packed) == 3 + 9 * (len(vector) + 2)  # ~100 bytes at most in PeerRecord.extra
    assert Coordinate.from_wire(msgpack.unpackb(packed)) == coord


def test_wire_accepts_ints() -> None:
    assert Coordinate.from_wire([1, [0, 1], 0, 1]) == Coordinate((0.0, 1.0), 0.0, 1.0)


@pytest.mark.parametrize(
    "junk",
    [
        None,
        b"\x01",
        "coord",
        {"v": [0.0]},
        [],
        [1, [0.0], 0.0],  # too short
        [2, [0.0], 0.0, 1.0],  # unknown format
        [1, [], 0.0, 1.0],  # no dimensions
        [1, [0.0] * (MAX_DIMS + 1), 0.0, 1.0],
        [1, "0.0", 0.0, 1.0],
        [1, [math.nan], 0.0, 1.0],
        [1, [math.inf], 0.0, 1.0],
        [1, [1e300], 0.0, 1.0],
        [1, [10**30], 0.0, 1.0],
        [1, [0.0], -0.5, 1.0],  # negative height
        [1, [0.0], 0.0, -1.0],  # negative error
        [1, [0.0], 0.0, 1e9],
        [1, [0.0], math.nan, 1.0],
        [1, [True], 0.0, 1.0],
        [1, [b"\x00"], 0.0, 1.0],
        [1, [[0.0]], 0.0, 1.0],
        [1, [0.0], None, 1.0],
    ],
)
def test_hostile_wire_input_is_rejected(junk: object) -> None:
    with pytest.raises(AveragingError):
        Coordinate.from_wire(junk)


def test_local_construction_is_checked() -> None:
    with pytest.raises(ConfigError):
        Coordinate((math.nan,), 0.0, 1.0)
    with pytest.raises(ConfigError):
        Coordinate([0.0], 0.0, 1.0)  # type: ignore[arg-type]
