"""Resource limits of the HTTP server: connections, idle time, and memory for partial frames.

Every resource an outsider can touch has a limit (libp2p's resource manager and nginx's
hardening are the models):

- :class:`ConnectionLimits`: connections per source address and in all, kept below the process's
  descriptor limit (whose soft value is raised toward the hard one where the OS allows it);
- the header/keep-alive timeout: aiohttp arms its keep-alive timer as a connection opens and
  closes it when no complete request arrived in time, so one value bounds both a half-open
  connection and an idle kept-alive one (see :class:`~swarm.net.transport.Transport`);
- :class:`StreamLimits`: how long a stream may keep us waiting for the next frame, derived from
  the frame's length and a minimum expected rate, and a shared budget of bytes that partially
  received frames may hold, so stalled senders cannot pin memory.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass, field
from typing import Any

from swarm.auth import RateLimitedWarning
from swarm.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_MAX_PER_ADDRESS = 32
DESCRIPTOR_RESERVE = 128  # descriptors left for outgoing connections, the DHT socket, files
_FALLBACK_DESCRIPTORS = 512  # where the limit cannot be read (Windows' select() is near this)
_SMALL_FRAME_BYTES = 64 * 1024  # frames below this need no share of the budget


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


class ConnectionLimits:
    """Counts the server's connections per source address; refuses past the caps.

    Args:
        max_connections: connections in all; lowered to the descriptor limit less a reserve.
        max_per_address: connections from one IP address.
    """

    def __init__(
        self,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_per_address: int = DEFAULT_MAX_PER_ADDRESS,
    ):
        if max_connections < 1 or max_per_address < 1:
            raise ConfigError("connection limits must be at least 1")
        descriptors = raise_descriptor_limit()
        self.max_connections = max(1, min(max_connections, descriptors - DESCRIPTOR_RESERVE))
        self.max_per_address = max_per_address
        self._per_address: dict[str, int] = {}
        self._total = 0
        self.refused = 0
        self._warnings = RateLimitedWarning(logger)

    @property
    def total(self) -> int:
        return self._total

    def admit(self, address: str) -> bool:
        """Count a new connection from ``address``; False (not counted) when over a cap."""
        count = self._per_address.get(address, 0)
        if self._total >= self.max_connections or count >= self.max_per_address:
            self.refused += 1
            return False
        self._per_address[address] = count + 1
        self._total += 1
        return True

    def release(self, address: str) -> None:
        count = self._per_address.get(address, 0)
        if count <= 0:
            return
        if count == 1:
            del self._per_address[address]
        else:
            self._per_address[address] = count - 1
        self._total -= 1

    def guard(self, server: Any) -> None:
        """Hook into an aiohttp ``web.Server``: connections over a cap are aborted on arrival."""
        made, lost = server.connection_made, server.connection_lost
        admitted: dict[Any, str] = {}

        def connection_made(handler: Any, transport: asyncio.Transport) -> None:
            made(handler, transport)
            peer = transport.get_extra_info("peername")
            address = str(peer[0]) if peer else "?"
            if self.admit(address):
                admitted[handler] = address
            else:
                self._warnings.warn(
                    address,
                    "refused a connection from %s: over the limits (%d per address, %d in all)",
                    address,
                    self.max_per_address,
                    self.max_connections,
                )
                transport.abort()

        def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
            address = admitted.pop(handler, None)
            if address is not None:
                self.release(address)
            lost(handler, exc)

        server.connection_made = connection_made
        server.connection_lost = connection_lost


class ByteBudget:
    """Bytes that partially received frames may hold at once, shared by all streams."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0
        self._waiters: list[asyncio.Future[None]] = []

    async def acquire(self, size: int) -> None:
        size = min(size, self.capacity)
        while self.used + size > self.capacity:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self.used += size

    def release(self, size: int) -> None:
        self.used -= min(size, self.capacity)
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


@dataclass
class StreamLimits:
    """How an inbound stream is bounded in time and memory.

    Args:
        idle_s: longest wait for the next frame to start arriving.
        min_rate: bytes per second a frame must at least arrive at; a frame of ``n`` bytes may
            take ``idle_s + n / min_rate`` seconds. Lower it for very slow links.
        partial_frame_bytes: memory all partially received frames may hold together.
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

    def needs_budget(self, length: int) -> bool:
        return length > _SMALL_FRAME_BYTES

    def shared_budget(self) -> ByteBudget:
        if self.budget is None:
            self.budget = ByteBudget(self.partial_frame_bytes)
        return self.budget
