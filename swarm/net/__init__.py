"""Authenticated HTTP transport, and how a peer becomes reachable.

The transport:

- :mod:`swarm.net.record`: ``PeerRecord``, a peer's signed self-description
- :mod:`swarm.net.progress`: the training progress a record carries (bounded, checked)
- :mod:`swarm.net.wire`: msgpack for bytes from the network (bounded, no extensions)
- :mod:`swarm.net.frames`: the sealed frame format (sans-I/O) and the cipher choice
- :mod:`swarm.net.reader`: reading one direction of a sealed stream within time and memory
- :mod:`swarm.net.streams`: both ends of a stream (``InboundStream``, ``ReplyStream``,
  ``OutboundStream``)
- :mod:`swarm.net.client`: authenticated requests and streams out, over one session
- :mod:`swarm.net.server`: the server side: authentication, routes, authentication budgets
- :mod:`swarm.net.confidential`: ``/ping`` and ``/info`` replies sealed in a keyed swarm
- :mod:`swarm.net.transport`: ``Transport``, the server and client of one peer
- :mod:`swarm.net.admission` (sans-I/O), :mod:`swarm.net.connections`: the connection table
  (quotas per host and subnet, room for proved peers, fair eviction)
- :mod:`swarm.net.limits`, :mod:`swarm.net.buffers`: stream time and memory limits, frame
  buffers that go back to the OS

Reachability:

- :mod:`swarm.net.nat`: port mapping, then dial-back checks, then relays
- :mod:`swarm.net.portmap`: the router's port mapping (UPnP-IGD, then :mod:`swarm.net.pcp`,
  then :mod:`swarm.net.natpmp`)
- :mod:`swarm.net.reachability`: dial-back checks
- :mod:`swarm.net.relay`: relaying for peers nobody can dial
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
