"""Exceptions raised by swarm.

Every error the library raises on purpose derives from :class:`SwarmError`::

    SwarmError
    ├── ConfigError          a setting or combination of settings is invalid
    ├── IdentityError        a key file is missing, unreadable or corrupt
    ├── AuthError            a request, datagram or chunk failed authentication
    │   └── ReplayError      a nonce was seen before or a timestamp is outside the window
    ├── TransportError       an HTTP exchange with a peer failed (refused, cut, oversized)
    │   └── PortMapError     the router refused, or does not offer, a port mapping
    ├── DHTError             a DHT operation failed or a record is invalid
    ├── CompressionError     a payload is malformed or a tensor cannot be encoded
    ├── AveragingError       an averaging round failed
    └── TrainingError        state download, checkpoint or training-loop failure
        └── CheckpointError  a checkpoint is missing, corrupt or does not match the model
"""

from __future__ import annotations


class SwarmError(Exception):
    """Base class of every error raised on purpose by swarm."""


class ConfigError(SwarmError, ValueError):
    """A setting or a combination of settings is invalid."""


class IdentityError(SwarmError):
    """A key file is missing, unreadable or corrupt."""


class AuthError(SwarmError):
    """A request, datagram or body chunk failed authentication."""


class ReplayError(AuthError):
    """A nonce was seen before, or a timestamp is outside the accepted window."""


# A TransportError's status for "over on this side" (a round that ended, an averager that
# closed, a stalled sender dropped): the server logs it at DEBUG, since nothing the other peer
# sent was wrong (the round's report names a drop).
GONE = 410


class TransportError(SwarmError):
    """An HTTP exchange with a peer failed: refused, cut, timed out or oversized.

    ``refused`` is True when nothing listens at the peer's address (the connection was refused):
    the peer is gone, not merely slow. ``unanswered`` is True when the connection failed before
    any reply came (reset, closed, unreachable): the peer may never have seen the request.
    ``lost`` is True when an established connection broke mid-exchange (reset or closed by the
    other side): the peer died, hung up or gave up, which says nothing about what it sent.
    """

    def __init__(
        self,
        message: str,
        *,
        peer: str | None = None,
        status: int | None = None,
        refused: bool = False,
        unanswered: bool = False,
        lost: bool = False,
    ):
        super().__init__(message)
        self.peer = peer
        self.status = status
        self.refused = refused
        self.unanswered = unanswered
        self.lost = lost

    def __str__(self) -> str:
        parts = [super().__str__()]
        if self.peer:
            parts.append(f"peer={self.peer}")
        if self.status is not None:
            parts.append(f"status={self.status}")
        return " ".join(parts)


class PortMapError(TransportError):
    """The router refused a port mapping, or offers none of UPnP-IGD, PCP and NAT-PMP."""


class DHTError(SwarmError):
    """A DHT operation failed, or a record is invalid."""


class CompressionError(SwarmError, ValueError):
    """A payload is malformed or hostile, or a tensor cannot be encoded."""


class AveragingError(SwarmError):
    """An averaging round failed."""


class TrainingError(SwarmError):
    """State download, checkpoint or training-loop failure."""


class CheckpointError(TrainingError):
    """A checkpoint is missing, corrupt or does not match the model."""
