"""How a peer joins a swarm: addresses, identity, membership and heartbeat.

:class:`PeerConfig` sits beside :class:`~swarm.peer.Peer`, which it configures; the training
settings (:class:`~swarm.config.SwarmConfig`) hold one. Validated in ``__post_init__`` like every
config: a broken setting raises :class:`~swarm.errors.ConfigError` when the config is built.
"""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from swarm.address import PeerAddress
from swarm.auth import Membership
from swarm.errors import ConfigError

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
DEFAULT_LISTEN = "0.0.0.0:0"
DEFAULT_BANDWIDTH = 100e6 / 8  # bytes/s: a typical consumer uplink of 100 Mbit/s


class Reachability(str, enum.Enum):
    """How a peer becomes reachable (``PeerConfig.reachability``)."""

    AUTO = "auto"  # map the router's port, learn by dial-back, use a relay when undialable
    DIRECT = "direct"  # announce the address as it is: no mapping, dial-back or relay

    def __str__(self) -> str:
        return self.value


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
        metrics: serve Prometheus metrics at ``GET /metrics`` on the peer's HTTP port, without
            the swarm's authentication (Prometheus cannot sign requests): anyone who can reach
            the port can read them, so it is off by default.
        port_mapping: behind a home router, ask it (UPnP-IGD, PCP, NAT-PMP) to forward our port
            (with ``reachability="auto"``).
        relay_peers: which peers may relay for us when others cannot dial us: None (the
            default) any reachable peer of the run that offers relaying; a list of ``HOST:PORT``
            only the peers announced at those addresses, in that order; an empty list none (an
            undialable peer then takes part as a client: it dials out and owns no part).
        relay_slots: how many unreachable peers we relay for at once when reachable; 0: none.
        relay_rate: bytes/s we give to relayed traffic, all relayed peers together.
        reachability: ``"auto"`` (the default): map the router's port, learn by dial-back
            whether others can dial us, and use a relay when they cannot. ``"direct"``: announce
            the address as it is (a server with a public address, a LAN, a test), with no
            mapping, dial-back or relay. Text, a :class:`Reachability`, or True/False for
            auto/direct; it reads back as a :class:`Reachability`.
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
    metrics: bool = False
    port_mapping: bool = True
    relay_peers: tuple[str, ...] | None = None
    relay_slots: int = 4
    relay_rate: float = DEFAULT_BANDWIDTH
    reachability: Reachability | str | bool = Reachability.AUTO

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
        if not self.record_ttl > self.heartbeat_s:
            raise ConfigError(
                "record_ttl_s must exceed heartbeat_s, or live peers would blink out between "
                "heartbeats"
            )
        if self.relay_peers is not None:
            relays = self.relay_peers
            if isinstance(relays, str) or not isinstance(relays, list | tuple):
                raise ConfigError("relay_peers must be None or a list of HOST:PORT addresses")
            for text in relays:
                PeerAddress.parse(text)  # raises ConfigError on junk
            object.__setattr__(self, "relay_peers", tuple(relays))
        if isinstance(self.relay_slots, bool) or not isinstance(self.relay_slots, int):
            raise ConfigError("relay_slots must be an integer")
        if self.relay_slots < 0 or not self.relay_rate > 0:
            raise ConfigError("relay_slots must be >= 0 and relay_rate > 0 bytes/s")
        reach = self.reachability
        if isinstance(reach, bool):
            reach = Reachability.AUTO if reach else Reachability.DIRECT
        if reach not in tuple(Reachability):
            choices = ", ".join(r.value for r in Reachability)
            raise ConfigError(f"reachability must be one of {choices}, not {reach!r}")
        object.__setattr__(self, "reachability", Reachability(reach))
        if not self.dht_request_timeout_s > 0:
            raise ConfigError("dht_request_timeout_s must be positive")
        if self.announce is not None and self.announce.port == 0:
            raise ConfigError("announce needs a real port, not 0")

    @property
    def record_ttl(self) -> float:
        """How long the peer's record lives (``record_ttl_s``, or 3 heartbeats)."""
        return 3 * self.heartbeat_s if self.record_ttl_s is None else self.record_ttl_s
