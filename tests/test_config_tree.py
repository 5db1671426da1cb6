"""One configuration tree: every field of every config reaches, from ``Swarm(...)`` and its
siblings, the component that uses it; an unknown keyword names the closest valid one."""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from swarm.address import PeerAddress
from swarm.api import AsyncSwarm, Swarm
from swarm.auth import Membership
from swarm.compression import get_codec
from swarm.config import Aggregator, AveragingConfig, Grouping, PeerConfig, SwarmConfig
from swarm.errors import ConfigError
from swarm.options import environment_options, leaf_fields
from swarm.peer_config import Reachability

KEY = Membership.with_key(b"config-walk-swarm-key-of-32-bytes")

# Every field of the tree with a valid value other than its default, and which of the two
# swarms of the walk sets it: "a" trains in diloco (the defaults), "b" in local_sgd and joins
# "a". A field added to any config and missing here fails test_the_walk_covers_every_field.
WALK: dict[str, tuple[str, Any]] = {
    # SwarmConfig
    "mode": ("b", "local_sgd"),
    "inner_steps": ("a", 6),
    "min_inner_steps": ("a", 4),
    "max_inner_steps": ("a", 300),
    "outer_lr": ("a", 0.5),
    "outer_momentum": ("a", 0.8),
    "nesterov": ("a", False),
    "anchor_sync_every": ("a", 2),
    "anchor_sync_codec": ("a", "bf16"),
    "sync_on_join": ("b", False),
    "state_timeout_s": ("a", 30.0),
    "max_state_bytes": ("a", 1 << 30),
    "state_parts": ("a", 2),
    "overlap": ("a", False),
    "outer_device": ("a", "cpu"),
    "fragments": ("a", 3),
    # PeerConfig
    "run_id": ("a", "config-walk"),
    "listen": ("a", "127.0.0.61:0"),
    "announce": ("b", "127.0.0.62:7000"),
    "initial_peers": ("b", None),  # a's address, known once a is up
    "identity_path": ("a", None),  # a file in the test's tmp_path
    "membership": ("a", KEY),
    "bandwidth": ("a", 5e6),
    "heartbeat_s": ("a", 2.0),
    "record_ttl_s": ("a", 9.0),
    "device": ("a", "walk-device"),
    "dht_request_timeout_s": ("a", 2.0),
    "metrics": ("a", True),
    "port_mapping": ("a", False),
    "relay_peers": ("a", ["127.0.0.63:4000"]),
    "relay_slots": ("a", 2),
    "relay_rate": ("a", 1e6),
    "reachability": ("b", "direct"),
    # AveragingConfig
    "codec": ("a", "fp16"),
    "min_group_size": ("a", 3),
    "target_group_size": ("a", 5),
    "matchmaking_timeout_s": ("a", 4.0),
    "round_timeout_s": ("a", 30.0),
    "gather_window_s": ("a", 0.3),
    "stall_timeout_min_s": ("a", 2.0),
    "stall_factor": ("a", 4.0),
    "group_key": ("a", "walk"),
    "grouping": ("a", "random"),
    "cross_every": ("a", 3),
    "region_rtt_s": ("a", 0.1),
    "probe_period_s": ("a", 3.0),
    "probes_per_period": ("a", 2),
    "name": ("a", "walkavg"),
    "threads": ("a", 1),
    "aggregator": ("a", "mean"),
    "weight_cap": ("a", 3.0),
    "max_share": ("a", 1.5),
    "check_owners": ("a", False),
    "score_updates": ("a", True),
}

# what a config makes of a value it normalizes
_AS_STORED = {
    "listen": PeerAddress.parse,
    "announce": PeerAddress.parse,
    "relay_peers": tuple,
    "identity_path": Path,
    "mode": str,
    "grouping": Grouping,
    "aggregator": Aggregator,
    "reachability": Reachability,
}


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _component_config(swarm: Swarm, path: tuple[str, ...]) -> Any:
    """The config the component that uses a field holds: the engine's for the training fields,
    the peer's for ``peer``, the averager's for ``averaging``."""
    if path == ():
        return swarm.engine.config
    if path == ("peer",):
        return swarm.peer.config
    if path == ("averaging",):
        return swarm._async.averager.config
    raise AssertionError(f"no component for {path}")


def test_the_walk_covers_every_field() -> None:
    assert set(WALK) == set(leaf_fields(SwarmConfig))


def test_every_field_reaches_the_component_that_uses_it(tmp_path: Path) -> None:
    values = {name: value for name, (_, value) in WALK.items()}
    values["identity_path"] = tmp_path / "walk.key"
    options = {"a": {}, "b": {}}
    for name, (swarm, _) in WALK.items():
        options[swarm][name] = values[name]
    options["b"].update(run_id="config-walk", listen="127.0.0.62:0", membership=KEY)
    # b averages parameter values: a dense codec; it does not train, it only has to start
    model_a, opt_a = _model()
    with Swarm(model_a, opt_a, **options["a"]) as a:
        values["initial_peers"] = (a.address,)
        options["b"]["initial_peers"] = values["initial_peers"]
        model_b, opt_b = _model()
        with Swarm(model_b, opt_b, **options["b"]) as b:
            swarms = {"a": a, "b": b}
            defaults = SwarmConfig()
            for name, leaf in leaf_fields(SwarmConfig).items():
                which, _ = WALK[name]
                got = getattr(_component_config(swarms[which], leaf.path), name)
                want = _AS_STORED.get(name, lambda v: v)(values[name])
                assert got == want, (name, got, want)
                default = defaults
                for section in leaf.path:
                    default = getattr(default, section)
                assert got != getattr(default, name), f"{name}: the walk's value is the default"
            # deeper than the configs: the components built from them
            assert a.peer.nat is not None and a.peer.nat.relays == [PeerAddress("127.0.0.63", 4000)]
            assert a.peer.nat.port_mapping is False and a.peer.nat.budget.peers == 2
            assert b.peer.nat is None  # reachability "direct": no dial-back, no relay
            assert a._async.averager.codec.name == "fp16"
            assert a.engine._sync_codec == "bf16"  # the anchors sync in their own codec
            assert a.engine.config.round_interval == 2  # inner_steps 6 in 3 fragments


def test_the_issue_s_keywords_build_and_arrive() -> None:
    model, opt = _model()
    with Swarm(
        model,
        opt,
        listen="127.0.0.64:0",
        port_mapping=False,
        relay_peers=[],
        reachability="direct",
        aggregator="mean",
    ) as swarm:
        assert swarm.peer.config.port_mapping is False
        assert swarm.peer.config.relay_peers == ()
        assert swarm.peer.config.reachability is Reachability.DIRECT
        assert swarm.peer.nat is None  # direct: announced as it is, nobody asked to dial back
        assert swarm._async.averager.config.aggregator is Aggregator.MEAN


@pytest.mark.parametrize(
    ("keyword", "suggestion"),
    [("agregator", "aggregator"), ("inner_step", "inner_steps"), ("relay_peer", "relay_peers")],
)
def test_an_unknown_keyword_names_the_closest_valid_option(keyword: str, suggestion: str) -> None:
    with pytest.raises(ConfigError, match=f"unknown option '{keyword}'.*'{suggestion}'"):
        SwarmConfig.build(**{keyword: 1})
    model, opt = _model()
    with pytest.raises(ConfigError, match=f"did you mean '{suggestion}'"):
        AsyncSwarm(model, opt, **{keyword: 1})


def test_sections_and_flat_keywords_combine_and_conflicts_are_refused() -> None:
    peer = PeerConfig(run_id="r1", heartbeat_s=3.0)
    built = SwarmConfig.build(peer=peer, heartbeat_s=4.0, codec="none", inner_steps=5)
    assert (built.peer.run_id, built.peer.heartbeat_s) == ("r1", 4.0)
    assert (built.averaging.codec, built.inner_steps) == ("none", 5)
    with pytest.raises(ConfigError, match="averaging must be an AveragingConfig"):
        SwarmConfig.build(averaging={"codec": "none"})
    with pytest.raises(ConfigError, match="pass either config= or individual options"):
        model, opt = _model()
        AsyncSwarm(model, opt, config=SwarmConfig(), inner_steps=3)
    # each default is defined once: the tree's defaults are the configs' own
    assert SwarmConfig().averaging == AveragingConfig()
    assert SwarmConfig().peer == PeerConfig()


def test_environment_variables_set_the_same_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    from swarm.config_sources import environment

    env = {
        "SWARM_INITIAL_PEERS": "127.0.0.1:1, 127.0.0.2:2",  # a peer's field: swarm-peer's variable
        "SWARM_HEARTBEAT": "4",  # ... in swarm-peer's unit
        "SWARM_BANDWIDTH": "8",  # Mbit/s
        "SWARM_NO_PORT_MAPPING": "1",
        "SWARM_INNER_STEPS": "12",  # the others: SWARM_<FIELD>
        "SWARM_CROSS_EVERY": "none",
        "SWARM_AGGREGATOR": "mean",
        "SWARM_OUTER_LR": "0.25",
        "SWARM_HEARTBEAT_S": "99",  # not a variable: heartbeat_s has SWARM_HEARTBEAT
    }
    for name in list(os.environ):
        if name.startswith("SWARM_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    found = environment()
    assert found == {
        "initial_peers": ("127.0.0.1:1", "127.0.0.2:2"),
        "heartbeat_s": 4.0,
        "bandwidth": 1e6,
        "port_mapping": False,
        "inner_steps": 12,
        "cross_every": None,
        "aggregator": "mean",
        "outer_lr": 0.25,
    }
    config = SwarmConfig.build(**found)
    assert config.peer.initial_peers == ("127.0.0.1:1", "127.0.0.2:2")
    assert config.averaging.cross_every is None and config.inner_steps == 12
    # inner_steps takes words beyond "auto" ("30s"): the config names a bad one
    with pytest.raises(ConfigError, match=r"inner_steps must be an integer .* not 'many'"):
        SwarmConfig.build(**environment_options(SwarmConfig, {"SWARM_INNER_STEPS": "many"}))
    monkeypatch.setenv("SWARM_HEARTBEAT", "soon")
    with pytest.raises(ConfigError, match="SWARM_HEARTBEAT"):
        environment()


def test_every_peer_field_has_one_flag_and_one_variable() -> None:
    from swarm.cli import apply_environment, build_parser, peer_config
    from swarm.peer_flags import SOURCES, check_sources

    check_sources()
    assert len({s.env for s in SOURCES}) == len(SOURCES)
    assert len({s.flag for s in SOURCES}) == len(SOURCES)
    # every PeerConfig field of the walk, through swarm-peer's flags
    argv = [
        "--run-id",
        "config-walk",
        "--listen",
        "127.0.0.61:0",
        "--announce",
        "127.0.0.62:7000",
        "--initial-peers",
        "127.0.0.1:1",
        "--heartbeat",
        "2",
        "--record-ttl-s",
        "9",
        "--device",
        "walk-device",
        "--dht-request-timeout-s",
        "2",
        "--metrics",
        "--no-port-mapping",
        "--relay-peers",
        "127.0.0.63:4000",
        "--relay-budget",
        "2,8",
        "--reachability",
        "direct",
        "--bandwidth",
        "40",
    ]
    parser = build_parser()
    args = parser.parse_args(argv)
    apply_environment(parser, args)
    config = peer_config(args)
    assert (config.run_id, config.listen, config.announce) == (
        "config-walk",
        PeerAddress("127.0.0.61", 0),
        PeerAddress("127.0.0.62", 7000),
    )
    assert config.initial_peers == ("127.0.0.1:1",) and config.relay_peers == ("127.0.0.63:4000",)
    assert (config.heartbeat_s, config.record_ttl_s, config.dht_request_timeout_s) == (2, 9, 2)
    assert (config.device, config.metrics, config.port_mapping) == ("walk-device", True, False)
    assert (config.relay_slots, config.relay_rate, config.bandwidth) == (2, 1e6, 5e6)
    assert config.reachability is Reachability.DIRECT


def test_explicit_keywords_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWARM_INNER_STEPS", "12")
    monkeypatch.setenv("SWARM_CODEC", "fp16")
    model, opt = _model()
    swarm = AsyncSwarm(model, opt, inner_steps=4)
    assert swarm.config.inner_steps == 4 and swarm.config.averaging.codec == "fp16"


def test_the_tree_has_one_name_per_setting() -> None:
    names = [
        f.name for c in (SwarmConfig, PeerConfig, AveragingConfig) for f in dataclasses.fields(c)
    ]
    sections = {"peer", "averaging"}
    assert len([n for n in names if n not in sections]) == len(leaf_fields(SwarmConfig))


_STORE_HOST = "127.0.0.251"  # no other test binds it: 127.0.0.1's ports churn under the suite


def _init_single_process_group() -> None:
    """A gloo group of one rank, its store on a free port (once more if the port was taken
    between the probe and the store's bind)."""
    import torch.distributed as dist

    for attempt in range(3):
        with socket.socket() as s:
            s.bind((_STORE_HOST, 0))
            port = s.getsockname()[1]
        try:
            dist.init_process_group(
                "gloo", init_method=f"tcp://{_STORE_HOST}:{port}", rank=0, world_size=1
            )
            return
        except dist.DistNetworkError:
            if attempt == 2:
                raise


def test_the_optimizer_and_torchrun_facades_route_the_same_way(tmp_path: Path) -> None:
    import torch.distributed as dist

    from swarm.distributed import NodeSwarm
    from swarm.optim import SwarmOptimizer

    model, opt = _model()
    wrapped = SwarmOptimizer(
        opt, model=model, listen="127.0.0.65:0", aggregator="mean", relay_slots=1
    )
    try:
        assert wrapped.swarm._async.averager.config.aggregator is Aggregator.MEAN
        assert wrapped.swarm.peer.config.relay_slots == 1
    finally:
        wrapped.close()
    with pytest.raises(ConfigError, match="did you mean 'relay_slots'"):
        SwarmOptimizer(opt, model=model, relay_slot=1)
    if not dist.is_available():
        pytest.skip("torch.distributed missing")
    _init_single_process_group()
    try:
        model, opt = _model()
        with NodeSwarm(
            model, opt, listen="127.0.0.66:0", aggregator="mean", grouping="fixed"
        ) as node:
            assert node.swarm is not None
            assert node.swarm._async.averager.config.grouping is Grouping.FIXED
            assert node.swarm._async.averager.config.aggregator is Aggregator.MEAN
    finally:
        dist.destroy_process_group()


def test_the_outer_step_defaults_are_diloco_s_for_every_codec() -> None:
    """DiLoCo's Nesterov step, the sparse codecs included (their error feedback lives in the
    model, see OuterState.keep_unsent); a value given is kept."""
    for config in (SwarmConfig(), *(SwarmConfig.build(codec=c) for c in ("sparse", "topk:0.01"))):
        assert (config.outer_lr, config.outer_momentum) == (0.7, 0.9)
    assert get_codec(SwarmConfig.build(codec="sparse").averaging.codec).feedback_decay == 0.95
    given = SwarmConfig.build(codec="sparse", outer_lr=1.0, outer_momentum=0.0)
    assert (given.outer_lr, given.outer_momentum) == (1.0, 0.0)
    assert SwarmConfig.build(codec="sparse", outer_momentum=0.5).outer_lr == 0.7
    with pytest.raises(ConfigError, match="outer_momentum"):
        SwarmConfig.build(codec="sparse", outer_momentum=1.0)
