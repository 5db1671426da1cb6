"""Resource limits of the HTTP server: descriptors, idle time, and memory for partial frames.

Every resource an outsider can touch has a limit (libp2p's resource manager and nginx's
hardening are the models):

- connections per host, per subnet and in all, kept below the process's descriptor limit
  (:func:`raise_descriptor_limit`), with room reserved for proved peers: see
  :mod:`swarm.net.admission` and :class:`~swarm.net.connections.ConnectionLimits`;
- the header/keep-alive timeout: aiohttp arms its keep-alive timer as a connection opens and
  closes it when no complete request arrived in time, so one value bounds both a half-open
  connection and an idle kept-alive one (see :class:`~swarm.net.transport.Transport`);
- :class:`StreamLimits`: how long a stream may keep us waiting for the next frame, derived from
  the frame's length and a minimum expected rate, and a :class:`ByteBudget` of bytes that
  partially received frames may hold, per host, per subnet and in all, so stalled senders
  cannot pin memory (and what they held goes back to the OS: :mod:`swarm.net.buffers`).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass, field

from swarm.errors import ConfigError
from swarm.hosts import Scope, scope_of

logger = logging.getLogger(__name__)

DESCRIPTOR_RESERVE = 128  # descriptors left for outgoing connections, the DHT socket, files
_FALLBACK_DESCRIPTORS = 512  # where the limit cannot be read (Windows' select() is near this)


def raise_descriptor_limit(wanted: int = 65_536) -> int:
    """Raise the soft limit on open descriptors toward ``wanted`` (never above the hard limit);
    returns the soft limit in force. Where the OS has no such limit, a conservative guess."""
    if sys.platform == "win32":
        return _FALLBACK_DESCRIPTORS
    try:
        import resource
    except ImportError:
        return _FALLBACK_DESCRIPTORS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            logger.debug("could not raise the descriptor limit to %d: %s", target, e)
    return wanted if soft == resource.RLIM_INFINITY else int(soft)


class ByteBudget:
    """Bytes that partially received frames may hold at once: in all, per subnet, per host.

    A frame waits for room (it is never refused here) until its host (IPv4 /32, IPv6 /64), its
    subnet (/24, /48) and the whole server all have room for it, so 16 addresses of one /24 pin
    no more than one subnet's share. A frame larger than a share counts as the share.

    Args:
        capacity: bytes in all.
        per_subnet: bytes of one subnet (default half of ``capacity``).
        per_host: bytes of one host (default a quarter of ``capacity``).
    """

    def __init__(self, capacity: int, per_subnet: int | None = None, per_host: int | None = None):
        self.capacity = capacity
        self.per_subnet = min(capacity, per_subnet or capacity // 2)
        self.per_host = min(self.per_subnet, per_host or capacity // 4)
        if self.per_host < 1:
            raise ConfigError("a byte budget needs room for at least one byte per host")
        self.used = 0
        self._hosts: dict[str, int] = {}
        self._subnets: dict[str, int] = {}
        self._waiters: list[asyncio.Future[None]] = []

    def held_by(self, source: str) -> int:
        """Bytes the host of ``source`` holds now."""
        return self._hosts.get(scope_of(source).host, 0)

    def _fits(self, size: int, scope: Scope) -> bool:
        return (
            self.used + size <= self.capacity
            and self._subnets.get(scope.subnet, 0) + size <= self.per_subnet
            and self._hosts.get(scope.host, 0) + size <= self.per_host
        )

    async def acquire(self, size: int, source: str = "") -> None:
        """Wait until ``source``'s host, its subnet and the server have room for ``size``."""
        size, scope = min(size, self.per_host), scope_of(source)
        while not self._fits(size, scope):
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self.used += size
        _add(self._hosts, scope.host, size)
        _add(self._subnets, scope.subnet, size)

    def release(self, size: int, source: str = "") -> None:
        size, scope = min(size, self.per_host), scope_of(source)
        self.used -= size
        _add(self._hosts, scope.host, -size)
        _add(self._subnets, scope.subnet, -size)
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


def _add(counts: dict[str, int], key: str, delta: int) -> None:
    """Add ``delta`` to ``counts[key]``, forgetting keys that reach zero (the dict stays small)."""
    value = counts.get(key, 0) + delta
    if value > 0:
        counts[key] = value
    else:
        counts.pop(key, None)


@dataclass
class StreamLimits:
    """How an inbound stream is bounded in time and memory.

    Args:
        idle_s: longest wait for the next frame to start arriving.
        min_rate: bytes per second a frame must at least arrive at; a frame of ``n`` bytes may
            take ``idle_s + n / min_rate`` seconds. Lower it for very slow links.
        partial_frame_bytes: memory all partially received frames (above 64 KiB) may hold
            together; one subnet (/24, /48) may hold half of it, one host (/32, /64) a quarter.
            Frames wait for room rather than fail: an honest sender sharing a host with a
            stalled one waits at most ``idle_s`` before its stream times out.
    """

    idle_s: float = 60.0
    min_rate: float = 64 * 1024.0
    partial_frame_bytes: int = 64 * 1024 * 1024
    budget: ByteBudget | None = field(default=None, repr=False)
    stalled: int = 0  # streams ended for being too slow

    def __post_init__(self) -> None:
        if self.idle_s <= 0 or self.min_rate <= 0 or self.partial_frame_bytes < 1 << 20:
            raise ConfigError("idle_s and min_rate must be positive, partial frames >= 1 MiB")

    def frame_timeout(self, length: int) -> float:
        return self.idle_s + length / self.min_rate

    def shared_budget(self) -> ByteBudget:
        if self.budget is None:
            self.budget = ByteBudget(self.partial_frame_bytes)
        return self.budget
