"""Which inbound connections a peer keeps when outsiders try to fill its table (sans-I/O).

Ports and addresses are free to an attacker (64 sockets per host, a /24 of addresses, a whole
IPv6 /64), so connections are counted per host and per subnet (:mod:`swarm.hosts`), and the
rules below make the table impossible to fill from outside; libp2p's resource manager (scopes
per peer, IP and subnet) and its connection gater are the model.

1. **Quotas.** A host (IPv4 /32, IPv6 /64) holds at most ``per_host`` connections and a subnet
   (/24, /48) at most ``per_subnet``; past them a new connection is refused, whatever its port
   or address inside them. Cost to honest peers: peers behind one NAT address share
   ``per_host`` (32 by default; a peer needs one or two at a time per stream it sends us);
   peers of one subnet share ``per_subnet`` (256, eight hosts' worth).
2. **Reserved room.** Connections from sources that have not *proved* themselves hold at most
   ``max_connections - reserved``; the last ``reserved`` slots (a quarter) are kept for proved
   sources. A host proves itself by completing an authenticated request, or by answering one
   of ours (:class:`HostProofs`; :class:`~swarm.net.connections.ConnectionLimits` reports
   both). Cost: none while the table has room; a first contact waits for room like anyone.
3. **Fair eviction.** When the room a newcomer may use is full, it takes the place of a
   connection of the subnet that holds the most connections, if that subnet holds at least two
   more than the newcomer's own (max-min fairness: no subnet is ever pushed below a richer
   one, and two equal subnets cannot push each other out in turn); otherwise it is refused.
   In that subnet the victim is its oldest idle unproved connection, else its oldest idle
   one, else its oldest unproved one, else its oldest. An unproved newcomer under rule 2
   takes only the place of an unproved connection (subnets compared by their unproved
   connections); a proved newcomer that finds no fair victim may still displace the oldest
   idle unproved connection of the subnet holding the most of them. Cost: an honest peer's
   idle kept-alive connection may be closed when the table is full (its client dials again
   on its next request); a transfer in progress is cut only in a subnet that holds at least
   two more connections than the newcomer's.

The table knows connections by an opaque key; closing the evicted connection is the caller's.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from swarm.errors import ConfigError
from swarm.hosts import Scope, scope_of

DEFAULT_PER_HOST = 32
SUBNET_HOSTS = 8  # a subnet's quota, in hosts' quotas
RESERVED_SHARE = 4  # a quarter of the table is kept for proved sources
PROOF_TTL_S = 600.0
HOST_FULL, SUBNET_FULL, TABLE_FULL = "host quota", "subnet quota", "table full"


@dataclass(frozen=True)
class ConnectionQuotas:
    """The numbers behind the rules of this module.

    Args:
        max_connections: connections in all.
        per_host: connections of one host (IPv4 /32, IPv6 /64).
        per_subnet: connections of one subnet (/24, /48); default ``8 * per_host``.
        reserved: slots only proved sources may take; default a quarter of the table.
    """

    max_connections: int
    per_host: int = DEFAULT_PER_HOST
    per_subnet: int = 0
    reserved: int = -1

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.per_host < 1:
            raise ConfigError("connection limits must be at least 1")
        if self.per_subnet == 0:
            object.__setattr__(self, "per_subnet", SUBNET_HOSTS * self.per_host)
        if self.reserved == -1:
            object.__setattr__(self, "reserved", self.max_connections // RESERVED_SHARE)
        if self.per_subnet < self.per_host:
            raise ConfigError("a subnet's quota cannot be below a host's")
        if not 0 <= self.reserved < self.max_connections:
            raise ConfigError("reserved connections must be >= 0 and below the maximum")


@dataclass(frozen=True)
class Verdict:
    """What to do with a new connection."""

    admitted: bool
    evict: Hashable | None = None  # a connection to close to make room, when admitted
    reason: str = ""  # why it was refused: HOST_FULL, SUBNET_FULL or TABLE_FULL


@dataclass
class _Connection:
    scope: Scope
    proved: bool
    requests: int = 0  # requests in progress; 0 is idle


class _Counts:
    """Connections per host and per subnet, and in all."""

    def __init__(self) -> None:
        self.hosts: dict[str, int] = {}
        self.subnets: dict[str, int] = {}
        self.total = 0

    def add(self, scope: Scope, delta: int) -> None:
        for counts, key in ((self.hosts, scope.host), (self.subnets, scope.subnet)):
            value = counts.get(key, 0) + delta
            if value > 0:
                counts[key] = value
            else:
                counts.pop(key, None)
        self.total += delta

    def richest(self) -> tuple[str, int]:
        """The subnet holding the most connections, and how many ("", 0 when empty)."""
        if not self.subnets:
            return "", 0
        subnet = max(self.subnets, key=self.subnets.__getitem__)
        return subnet, self.subnets[subnet]


class ConnectionTable:
    """The open connections, and the rules of the module docstring."""

    def __init__(self, quotas: ConnectionQuotas):
        self.quotas = quotas
        self._connections: dict[Hashable, _Connection] = {}  # oldest first
        self._by_subnet: dict[str, dict[Hashable, None]] = {}  # oldest first
        self._all = _Counts()
        self._unproved = _Counts()
        self.evicted = 0

    @property
    def total(self) -> int:
        return self._all.total

    @property
    def unproved(self) -> int:
        return self._unproved.total

    def held_by(self, address: str) -> tuple[int, int]:
        """Connections open from ``address``'s host, and from its subnet."""
        scope = scope_of(address)
        return self._all.hosts.get(scope.host, 0), self._all.subnets.get(scope.subnet, 0)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._connections

    def admit(self, key: Hashable, address: str, *, proved: bool) -> Verdict:
        """Count a new connection from ``address``, maybe in place of another (``evict``)."""
        scope, q = scope_of(address), self.quotas
        if self._all.hosts.get(scope.host, 0) >= q.per_host:
            return Verdict(False, reason=HOST_FULL)
        if self._all.subnets.get(scope.subnet, 0) >= q.per_subnet:
            return Verdict(False, reason=SUBNET_FULL)
        victim: Hashable | None = None
        if not proved and self.unproved >= q.max_connections - q.reserved:
            victim = self._fair_victim(self._unproved, scope, unproved_only=True)
        elif self.total >= q.max_connections:
            victim = self._fair_victim(self._all, scope, unproved_only=False)
            if victim is None and proved:
                victim = self._richest_unproved_idle()
        else:
            self._add(key, scope, proved)
            return Verdict(True)
        if victim is None:
            return Verdict(False, reason=TABLE_FULL)
        self.release(victim)
        self.evicted += 1
        self._add(key, scope, proved)
        return Verdict(True, evict=victim)

    def release(self, key: Hashable) -> None:
        """Forget a closed connection (unknown keys are ignored)."""
        connection = self._connections.pop(key, None)
        if connection is None:
            return
        subnet = self._by_subnet[connection.scope.subnet]
        del subnet[key]
        if not subnet:
            del self._by_subnet[connection.scope.subnet]
        self._all.add(connection.scope, -1)
        if not connection.proved:
            self._unproved.add(connection.scope, -1)

    def prove(self, host: str) -> None:
        """Count every open connection of ``host`` (a :class:`Scope` host) as proved."""
        if not self._unproved.hosts.get(host):
            return  # the common case: nothing to promote, no scan
        for connection in self._connections.values():
            if connection.scope.host == host and not connection.proved:
                connection.proved = True
                self._unproved.add(connection.scope, -1)

    def request_started(self, key: Hashable) -> None:
        if (connection := self._connections.get(key)) is not None:
            connection.requests += 1

    def request_ended(self, key: Hashable) -> None:
        if (connection := self._connections.get(key)) is not None:
            connection.requests = max(0, connection.requests - 1)

    def _add(self, key: Hashable, scope: Scope, proved: bool) -> None:
        self._connections[key] = _Connection(scope, proved)
        self._by_subnet.setdefault(scope.subnet, {})[key] = None
        self._all.add(scope, 1)
        if not proved:
            self._unproved.add(scope, 1)

    def _fair_victim(
        self, counts: _Counts, scope: Scope, *, unproved_only: bool
    ) -> Hashable | None:
        subnet, held = counts.richest()
        if held < counts.subnets.get(scope.subnet, 0) + 2:
            return None
        return self._oldest(subnet, unproved_only=unproved_only)

    def _oldest(self, subnet: str, *, unproved_only: bool) -> Hashable | None:
        """The victim in ``subnet``: idle before busy, unproved before proved, oldest first."""
        keys = self._by_subnet.get(subnet, {})
        passes = [(True, True), (True, False), (False, True), (False, False)]
        for idle, unproved in passes:
            if unproved_only and not unproved:
                continue
            for key in keys:
                connection = self._connections[key]
                if (connection.requests == 0 or not idle) and (
                    not connection.proved or not unproved
                ):
                    return key
        return None

    def _richest_unproved_idle(self) -> Hashable | None:
        subnet, held = self._unproved.richest()
        if held == 0:
            return None
        for key in self._by_subnet.get(subnet, {}):
            connection = self._connections[key]
            if not connection.proved and connection.requests == 0:
                return key
        return None


class HostProofs:
    """Hosts that proved themselves recently (an authenticated exchange), for ``ttl_s``.

    At most ``max_hosts`` are remembered; the least recently proved are forgotten first.
    """

    def __init__(self, ttl_s: float = PROOF_TTL_S, max_hosts: int = 4096):
        self.ttl_s = ttl_s
        self.max_hosts = max_hosts
        self._proved: OrderedDict[str, float] = OrderedDict()

    def prove(self, address: str, *, now: float | None = None) -> str:
        """Remember ``address``'s host as proved; returns the host."""
        now = time.monotonic() if now is None else now
        host = scope_of(address).host
        self._proved[host] = now
        self._proved.move_to_end(host)
        while len(self._proved) > self.max_hosts:
            self._proved.popitem(last=False)
        return host

    def proved(self, address: str, *, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        seen = self._proved.get(scope_of(address).host)
        return seen is not None and now - seen <= self.ttl_s
