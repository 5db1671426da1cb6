"""The HTTP server's connection table, hooked into aiohttp: quotas, proofs and eviction.

The rules (quotas per host and subnet, room reserved for proved sources, fair eviction) and
their cost to honest peers are in :mod:`swarm.net.admission`; this module applies them to the
connections of an aiohttp ``web.Server`` as they open and close, closes the connections they
evict, and hears from the transport which hosts proved themselves and which connections are
busy with a request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from swarm.hosts import scope_of
from swarm.net.admission import (
    DEFAULT_PER_HOST,
    PROOF_TTL_S,
    ConnectionQuotas,
    ConnectionTable,
    HostProofs,
)
from swarm.net.limits import DESCRIPTOR_RESERVE, raise_descriptor_limit
from swarm.refusal_log import RateLimitedWarning

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 1024


class ConnectionLimits:
    """Admits, counts and evicts the server's connections (see :mod:`swarm.net.admission`).

    Args:
        max_connections: connections in all; lowered to the descriptor limit less a reserve.
        max_per_host: connections of one host (IPv4 /32, IPv6 /64), whatever the ports.
        max_per_subnet: connections of one subnet (/24, /48); default eight hosts' worth.
        reserved: slots only proved sources may take; default a quarter of the table.
        proof_ttl_s: how long an authenticated exchange with a host counts as its proof.
    """

    def __init__(
        self,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_per_host: int = DEFAULT_PER_HOST,
        *,
        max_per_subnet: int | None = None,
        reserved: int | None = None,
        proof_ttl_s: float = PROOF_TTL_S,
    ):
        cap = max(1, min(max_connections, raise_descriptor_limit() - DESCRIPTOR_RESERVE))
        self.quotas = ConnectionQuotas(
            max_connections=cap,
            per_host=max_per_host,
            per_subnet=max_per_subnet or 0,
            reserved=-1 if reserved is None else min(reserved, cap - 1),
        )
        self.table = ConnectionTable(self.quotas)
        self.proofs = HostProofs(proof_ttl_s)
        self.refused = 0
        self._transports: dict[Any, asyncio.BaseTransport] = {}
        self._warnings = RateLimitedWarning(logger)

    @property
    def max_connections(self) -> int:
        return self.quotas.max_connections

    @property
    def total(self) -> int:
        return self.table.total

    @property
    def evicted(self) -> int:
        return self.table.evicted

    def prove(self, address: str) -> None:
        """``address``'s host proved itself (an authenticated exchange completed): its
        connections, open and to come, may use the reserved room."""
        self.table.prove(self.proofs.prove(address))

    def admit(self, key: Any, address: str) -> bool:
        """Count a new connection (closing one it evicts); False when refused."""
        verdict = self.table.admit(key, address, proved=self.proofs.proved(address))
        if verdict.evict is not None:
            evicted = self._transports.pop(verdict.evict, None)
            if evicted is not None:
                evicted.abort()
            logger.debug("closed a connection to make room for one from %s", address)
        if not verdict.admitted:
            self.refused += 1
            self._warnings.warn(
                scope_of(address).subnet,
                "refused a connection from %s (%s; limits: %d per host, %d per subnet, %d in all)",
                address,
                verdict.reason,
                self.quotas.per_host,
                self.quotas.per_subnet,
                self.quotas.max_connections,
            )
        return verdict.admitted

    @contextmanager
    def request(self, key: Any) -> Iterator[None]:
        """Mark the connection ``key`` busy while a request runs on it (eviction spares it)."""
        self.table.request_started(key)
        try:
            yield
        finally:
            self.table.request_ended(key)

    def guard(self, server: Any) -> None:
        """Hook into an aiohttp ``web.Server``: each connection is admitted as it opens (or
        aborted), forgotten as it closes; connections are keyed by their request handler."""
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: Any, transport: asyncio.Transport) -> None:
            made(handler, transport)
            peer = transport.get_extra_info("peername")
            if self.admit(handler, str(peer[0]) if peer else "?"):
                self._transports[handler] = transport
            else:
                transport.abort()

        def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
            self.table.release(handler)
            self._transports.pop(handler, None)
            lost(handler, exc)

        server.connection_made = connection_made
        server.connection_lost = connection_lost
