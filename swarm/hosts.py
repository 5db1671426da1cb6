"""Who a source address belongs to, for limits an outsider cannot multiply (sans-I/O).

Ports, identities and single addresses are free to an attacker: one host opens 64 sockets, and
one IPv6 customer holds a /64 (often a /48). So limits are keyed on the host and on its subnet,
never on ``(address, port)`` or a public key:

================  ==========  ===========
family            host        subnet
================  ==========  ===========
IPv4              /32         /24
IPv6              /64         /48
================  ==========  ===========

An IPv4-mapped IPv6 address (``::ffff:192.0.2.1``) counts as its IPv4 address. A source that is
not an IP address (a name, ``"?"``) is its own host and its own subnet.

:class:`HostBuckets` meters work per host and per subnet together: a source is in budget only
while both its host and its subnet are, and a subnet's budget is a few hosts' worth, so 16
addresses of one /24 get no more than a handful of hosts would.
"""

from __future__ import annotations

import functools
import ipaddress
import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

IPV4_HOST_BITS = 32
IPV4_SUBNET_BITS = 24
IPV6_HOST_BITS = 64
IPV6_SUBNET_BITS = 48
SUBNET_SHARE = 8.0  # a subnet's budget, in hosts' budgets
_SCOPE_CACHE = 8192  # addresses whose scope is remembered (parsing one costs ~30 us)


@dataclass(frozen=True)
class Scope:
    """Where a source address sits: its host and its subnet, as printable prefixes."""

    host: str  # "192.0.2.1/32", "2001:db8:1:2::/64"; a non-IP source as given
    subnet: str  # "192.0.2.0/24", "2001:db8:1::/48"; a non-IP source as given


@functools.lru_cache(maxsize=_SCOPE_CACHE)
def scope_of(address: str) -> Scope:
    """The host and subnet of an IP address (text, without a port or brackets)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return Scope(address, address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if isinstance(ip, ipaddress.IPv4Address):
        host_bits, subnet_bits = IPV4_HOST_BITS, IPV4_SUBNET_BITS
    else:
        host_bits, subnet_bits = IPV6_HOST_BITS, IPV6_SUBNET_BITS
    host = ipaddress.ip_network(f"{ip}/{host_bits}", strict=False)
    subnet = ipaddress.ip_network(f"{ip}/{subnet_bits}", strict=False)
    return Scope(str(host), str(subnet))


class TokenBuckets:
    """A token bucket per key: ``take(key, cost)`` is True while the key is in budget.

    At most ``max_sources`` keys are kept (the least recently seen are forgotten first, and start
    again with a full bucket).
    """

    def __init__(self, rate: float, burst: float, max_sources: int = 8192):
        self.rate = rate
        self.burst = burst
        self.max_sources = max_sources
        self._buckets: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()
        self.refused = 0

    def tokens(self, key: Hashable, now: float | None = None) -> float:
        """What ``key`` may spend now."""
        now = time.monotonic() if now is None else now
        tokens, last = self._buckets.get(key, (self.burst, now))
        return min(self.burst, tokens + (now - last) * self.rate)

    def take(self, key: Hashable, cost: float = 1.0, *, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        tokens = self.tokens(key, now)
        allowed = tokens >= cost
        if allowed:
            tokens -= cost
        else:
            self.refused += 1
        self._put(key, tokens, now)
        return allowed

    def drain(self, key: Hashable, cost: float, *, now: float | None = None) -> None:
        """Spend ``cost`` whether or not it is there (a debt that refills at ``rate``)."""
        now = time.monotonic() if now is None else now
        self._put(key, max(-self.burst, self.tokens(key, now) - cost), now)

    def _put(self, key: Hashable, tokens: float, now: float) -> None:
        self._buckets[key] = (tokens, now)
        self._buckets.move_to_end(key)
        if len(self._buckets) > self.max_sources:
            self._buckets.popitem(last=False)


class HostBuckets:
    """Token buckets per host and per subnet (see the module docstring).

    Args:
        rate: what one host may spend per second, sustained.
        burst: what one host may spend at once.
        subnet_share: a subnet's rate and burst, in hosts'.
    """

    def __init__(
        self,
        rate: float,
        burst: float,
        subnet_share: float = SUBNET_SHARE,
        max_sources: int = 8192,
    ):
        self.hosts = TokenBuckets(rate, burst, max_sources)
        self.subnets = TokenBuckets(rate * subnet_share, burst * subnet_share, max_sources)
        self.refused = 0

    def take(self, address: str, cost: float = 1.0, *, now: float | None = None) -> bool:
        """Spend ``cost`` from the host's and the subnet's buckets, or nothing: True if spent."""
        now = time.monotonic() if now is None else now
        scope = scope_of(address)
        if (
            self.hosts.tokens(scope.host, now) < cost
            or self.subnets.tokens(scope.subnet, now) < cost
        ):
            self.refused += 1
            return False
        self.hosts.take(scope.host, cost, now=now)
        self.subnets.take(scope.subnet, cost, now=now)
        return True

    def allows(self, address: str, cost: float = 1.0, *, now: float | None = None) -> bool:
        """Whether ``take(address, cost)`` would succeed now (nothing is spent)."""
        now = time.monotonic() if now is None else now
        scope = scope_of(address)
        return (
            self.hosts.tokens(scope.host, now) >= cost
            and self.subnets.tokens(scope.subnet, now) >= cost
        )

    def penalize(self, address: str, cost: float, *, now: float | None = None) -> None:
        """Charge the host and its subnet ``cost`` on top of their work, into debt if need be:
        what a source pays for sending something forged."""
        scope = scope_of(address)
        self.hosts.drain(scope.host, cost, now=now)
        self.subnets.drain(scope.subnet, cost, now=now)
