"""Typed, validated settings of a peer.

Every knob lives in a frozen dataclass validated in ``__post_init__``: a broken setting or a
broken combination raises :class:`~swarm.errors.ConfigError` when the config is built, not later
in the middle of a round.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from swarm.auth import Membership
from swarm.errors import ConfigError
from swarm.net.address import PeerAddress

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
DEFAULT_LISTEN = "0.0.0.0:0"
DEFAULT_BANDWIDTH = 100e6 / 8  # bytes/s: a typical consumer uplink of 100 Mbit/s


def _address(value: PeerAddress | str | None) -> PeerAddress | None:
    if value is None or isinstance(value, PeerAddress):
        return value
    return PeerAddress.parse(value)


@dataclass(frozen=True)
class PeerConfig:
    """How a peer joins a swarm: addresses, identity, membership and heartbeat.

    Args:
        run_id: names the training run; peers of different runs ignore each other's records.
        listen: ``HOST:PORT`` to bind; one port number serves the DHT (UDP) and HTTP (TCP).
            Port 0 picks a free port. Outgoing connections use this host too.
        announce: ``HOST:PORT`` others should dial (e.g. the router's public address when the
            port is forwarded). Defaults to the bound address, or this machine's LAN address when
            listening on all interfaces.
        initial_peers: ``HOST:PORT`` of any live peers; empty to start a new swarm.
        identity_path: key file; created (mode 0600) when missing. None uses a throwaway key.
        membership: open swarm, swarm key or allow-list (see :class:`swarm.auth.Membership`).
        bandwidth: upload rate others may plan for, in bytes/s; 0 means client-only (behind NAT:
            this peer sends and receives but owns no part of an all-reduce).
        heartbeat_s: how often the peer re-announces itself; its record expires after
            ``record_ttl_s`` (3 heartbeats by default), so a dead peer vanishes after that.
        device: what the peer trains on, as shown to others (``cpu``, ``cuda:NAME``).
    """

    run_id: str = "default"
    listen: PeerAddress | str = DEFAULT_LISTEN
    announce: PeerAddress | str | None = None
    initial_peers: tuple[str, ...] = ()
    identity_path: Path | str | None = None
    membership: Membership = field(default_factory=Membership.open)
    bandwidth: float = DEFAULT_BANDWIDTH
    heartbeat_s: float = 10.0
    record_ttl_s: float | None = None
    device: str = "cpu"
    dht_request_timeout_s: float = 3.0

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not _RUN_ID.match(self.run_id):
            raise ConfigError(f"run_id {self.run_id!r}: use 1-64 letters, digits, '.', '_' or '-'")
        object.__setattr__(self, "listen", _address(self.listen))
        object.__setattr__(self, "announce", _address(self.announce))
        peers = self.initial_peers
        if isinstance(peers, str):
            peers = (peers,)
        for text in peers:
            PeerAddress.parse(text)  # raises ConfigError on junk
        object.__setattr__(self, "initial_peers", tuple(peers))
        if self.identity_path is not None:
            object.__setattr__(self, "identity_path", Path(os.path.expanduser(self.identity_path)))
        if not isinstance(self.membership, Membership):
            raise ConfigError("membership must be a swarm.auth.Membership")
        if not self.bandwidth >= 0:
            raise ConfigError("bandwidth must be >= 0 bytes/s")
        if not self.heartbeat_s > 0:
            raise ConfigError("heartbeat_s must be positive")
        if self.record_ttl_s is None:
            object.__setattr__(self, "record_ttl_s", 3 * self.heartbeat_s)
        if not self.record_ttl_s > self.heartbeat_s:
            raise ConfigError(
                "record_ttl_s must exceed heartbeat_s, or live peers would blink out between "
                "heartbeats"
            )
        if not self.dht_request_timeout_s > 0:
            raise ConfigError("dht_request_timeout_s must be positive")
        if self.announce is not None and self.announce.port == 0:
            raise ConfigError("announce needs a real port, not 0")


TRAINING_MODES = ("diloco", "local_sgd", "gradients")
SPARSE_CODECS = ("topk", "1bit")  # lossy in a way that only suits changes, not raw values


@dataclass(frozen=True)
class SwarmConfig:
    """How a peer trains with the swarm: mode, averaging cadence, outer optimizer, timeouts.

    Args:
        peer: how the peer joins the swarm (addresses, identity, membership).
        mode: ``diloco`` (average the pseudo-gradient every ``inner_steps`` and apply an outer
            Nesterov step), ``local_sgd`` (average parameters every ``inner_steps``) or
            ``gradients`` (average gradients every step, like DDP; for small swarms on fast links).
        inner_steps: local optimizer steps between averaging rounds (forced to 1 for
            ``gradients``). More steps send fewer bytes; increase it on slow links, decrease it if
            the loss jumps after each round.
        outer_lr: outer learning rate (DiLoCo's 0.7 works for most models).
        outer_momentum: outer Nesterov momentum (DiLoCo: 0.9). A round with ``k`` peers uses at
            most ``1 - 1/k`` (2 peers: 0.5, 4: 0.75), and a peer alone takes no outer step at
            all (plain local training), so the default is stable at every group size; see
            :func:`swarm.training.outer.outer_rule`.
        nesterov: use Nesterov momentum in the outer step; False gives heavy-ball momentum.
        codec: compression of what is averaged: ``none``, ``fp16``, ``bf16``, ``int8``,
            ``topk:0.01``, ``1bit`` (see :mod:`swarm.compression`); error feedback is always on.
        min_group_size: a round averages only with at least this many peers (self included).
        target_group_size: groups close early when this many peers joined.
        matchmaking_timeout_s: how long to look for partners before a round gives up; a peer
            alone in the swarm pays this at every round, so keep it short for ``gradients``.
        round_timeout_s: upper bound on a whole round (matchmaking + all-reduce).
        sync_on_join: a peer started with ``initial_peers`` downloads the current model and outer
            state from live peers before its first step (a late joiner); a first peer finds none
            and starts from its own weights.
        state_timeout_s: upper bound on that download.
        max_state_bytes: largest state a joiner accepts from others (protects its memory).
        state_parts: largest number of providers a joiner downloads parts from at once.
    """

    peer: PeerConfig = field(default_factory=PeerConfig)
    mode: str = "diloco"
    inner_steps: int = 100
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    codec: str = "int8"
    min_group_size: int = 2
    target_group_size: int = 8
    matchmaking_timeout_s: float = 15.0
    round_timeout_s: float = 120.0
    sync_on_join: bool = True
    state_timeout_s: float = 120.0
    max_state_bytes: int = 16 << 30
    state_parts: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.peer, PeerConfig):
            raise ConfigError("peer must be a PeerConfig")
        if self.mode not in TRAINING_MODES:
            raise ConfigError(f"mode {self.mode!r}: use one of {', '.join(TRAINING_MODES)}")
        if self.mode == "gradients":
            object.__setattr__(self, "inner_steps", 1)
        if not isinstance(self.inner_steps, int) or self.inner_steps < 1:
            raise ConfigError("inner_steps must be an integer >= 1")
        if not self.outer_lr > 0:
            raise ConfigError("outer_lr must be positive")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError("outer_momentum must be in [0, 1)")
        if not isinstance(self.codec, str) or not self.codec:
            raise ConfigError("codec must be a codec name such as 'int8' or 'topk:0.01'")
        if self.mode == "local_sgd" and self.codec.split(":")[0] in SPARSE_CODECS:
            raise ConfigError(
                f"local_sgd averages parameter values, which {self.codec} would mostly zero or "
                "flatten; use mode='diloco' (it averages changes) or a dense codec (int8, fp16)"
            )
        if not 2 <= self.min_group_size <= self.target_group_size:
            raise ConfigError("need 2 <= min_group_size <= target_group_size")
        if not self.matchmaking_timeout_s > 0:
            raise ConfigError("matchmaking_timeout_s must be positive")
        if not self.round_timeout_s > self.matchmaking_timeout_s:
            raise ConfigError(
                "round_timeout_s must exceed matchmaking_timeout_s, or every round would time out "
                "before its all-reduce starts"
            )
        if not self.state_timeout_s > 0:
            raise ConfigError("state_timeout_s must be positive")
        if self.max_state_bytes < 1 or self.state_parts < 1:
            raise ConfigError("max_state_bytes and state_parts must be >= 1")
