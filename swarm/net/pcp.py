"""PCP (RFC 6887), the MAP opcode only: NAT-PMP's successor, on the same gateway port.

A MAP request asks the gateway to forward ``protocol`` traffic arriving at an external port to
our internal port; lifetime 0 removes the mapping. Each mapping carries a 12-byte nonce that its
renewals and its removal must repeat (the gateway refuses a change without it). The parsing is
pure (no I/O) so hostile answers can be tested without a router: an answer is at least the
60-byte header and MAP payload, at most 1100 bytes, a multiple of 4, version 2 with the response
bit and the MAP opcode, and echoes our nonce, protocol and internal port; anything else raises
:class:`~swarm.errors.PortMapError`. A version-0 answer is a NAT-PMP gateway saying it does not
speak PCP (RFC 6887 9), which :func:`speaks_natpmp_only` tells apart.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

from swarm.errors import PortMapError
from swarm.net.natpmp import MAX_ANSWER_BYTES

VERSION = 2
OP_MAP = 1
NONCE_BYTES = 12
MESSAGE_BYTES = 60  # common header (24) + MAP payload (36), requests and answers alike
PROTOCOL_NUMBERS = {"tcp": 6, "udp": 17}
RESULTS = {
    0: "success",
    1: "unsupported version",
    2: "not authorized",
    3: "malformed request",
    4: "unsupported opcode",
    5: "unsupported option",
    6: "malformed option",
    7: "network failure",
    8: "out of resources",
    9: "unsupported protocol",
    10: "user exceeded quota",
    11: "cannot provide the external port",
    12: "address mismatch (the router sees another source address)",
    13: "excessive remote peers",
}
_ANY_IPV4 = ipaddress.IPv6Address("::ffff:0.0.0.0")  # "any external address" (RFC 6887 11.1)


@dataclass(frozen=True)
class MapAnswer:
    """A gateway's answer to a MAP request."""

    protocol: str  # "udp" or "tcp"
    internal_port: int
    external_port: int
    external_ip: str  # the router's public IPv4 address
    lifetime_s: int  # 0 after a removal


def _as_ipv6(host: str) -> bytes:
    address = ipaddress.ip_address(host)
    if address.version == 4:
        address = ipaddress.IPv6Address(f"::ffff:{address}")
    return address.packed


def map_request(
    protocol: str, internal_host: str, internal_port: int, lifetime_s: int, nonce: bytes
) -> bytes:
    """A MAP request for ``internal_host:internal_port`` (lifetime 0 removes the mapping).

    The suggested external port is the internal one and the suggested external address is
    "any", so a router that can keeps the port number the peer listens on.
    """
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"a PCP nonce is {NONCE_BYTES} bytes")
    header = struct.pack("!BBHI", VERSION, OP_MAP, 0, lifetime_s) + _as_ipv6(internal_host)
    payload = nonce + struct.pack(
        "!B3xHH", PROTOCOL_NUMBERS[protocol], internal_port, internal_port
    )
    return header + payload + _ANY_IPV4.packed


def speaks_natpmp_only(data: bytes) -> bool:
    """Whether ``data`` is a NAT-PMP gateway's answer to a PCP request (its version is 0)."""
    return len(data) >= 4 and data[0] == 0


def is_answer(data: bytes) -> bool:
    """Whether ``data`` may be an answer from this gateway at all (PCP or NAT-PMP's refusal)."""
    return speaks_natpmp_only(data) or (
        MESSAGE_BYTES <= len(data) <= MAX_ANSWER_BYTES and len(data) % 4 == 0
    )


def parse_map_answer(data: bytes, protocol: str, internal_port: int, nonce: bytes) -> MapAnswer:
    """The mapping granted by ``data``, the answer to our MAP request with ``nonce``.

    Raises:
        PortMapError: not a well-formed answer to that request, or the router refused it.
    """
    if speaks_natpmp_only(data):
        raise PortMapError("PCP: the router speaks NAT-PMP only")
    if not MESSAGE_BYTES <= len(data) <= MAX_ANSWER_BYTES or len(data) % 4:
        raise PortMapError(f"PCP: a {len(data)}-byte answer")
    version, op, result, lifetime = struct.unpack_from("!BBxBI", data)
    if version != VERSION or op != 0x80 | OP_MAP:
        raise PortMapError(f"PCP: answer version {version} opcode {op}, expected 2/{0x80 | OP_MAP}")
    if result != 0:
        raise PortMapError(f"PCP: router refused: {RESULTS.get(result, f'result {result}')}")
    got_nonce = data[24 : 24 + NONCE_BYTES]
    number, internal, external = struct.unpack_from("!B3xHH", data, 24 + NONCE_BYTES)
    if got_nonce != nonce or number != PROTOCOL_NUMBERS[protocol] or internal != internal_port:
        raise PortMapError("PCP: an answer to another request (nonce, protocol or port differ)")
    address = ipaddress.IPv6Address(data[44:60])
    ipv4 = address.ipv4_mapped
    if lifetime and (ipv4 is None or ipv4.is_unspecified or external == 0):
        raise PortMapError(f"PCP: a mapping to {address} port {external}")
    return MapAnswer(protocol, internal, external, str(ipv4 or "0.0.0.0"), lifetime)
