"""Authenticated HTTP transport: addresses, signed peer records, sealed streams.

- :mod:`swarm.net.record`: ``PeerRecord``, a peer's signed self-description
- :mod:`swarm.net.frames`: the sealed frame format (sans-I/O) and the cipher choice
- :mod:`swarm.net.streams`: both ends of a stream (``InboundStream``, ``ReplyStream``,
  ``OutboundStream``)
- :mod:`swarm.net.transport`: ``Transport``, the server and client of one peer
- :mod:`swarm.net.server`: the server side: authentication, routes, authentication budgets
- :mod:`swarm.net.admission` (sans-I/O), :mod:`swarm.net.connections`: the connection table
  (quotas per host and subnet, room for proved peers, fair eviction)
- :mod:`swarm.net.limits`, :mod:`swarm.net.buffers`: stream time and memory limits, frame
  buffers that go back to the OS
"""

from swarm.address import PeerAddress
from swarm.net.record import PeerRecord
from swarm.net.streams import InboundStream, OutboundStream, RemotePeer, ReplyStream
from swarm.net.transport import Transport

__all__ = [
    "InboundStream",
    "OutboundStream",
    "PeerAddress",
    "PeerRecord",
    "RemotePeer",
    "ReplyStream",
    "Transport",
]
