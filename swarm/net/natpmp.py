"""NAT-PMP (RFC 6886): the messages, and one request/answer exchange with the gateway over UDP.

The parsing is pure (no I/O) so hostile answers can be tested without a router: an answer is
exactly 12 (external address) or 16 (mapping) bytes, version 0, the opcode of the request plus
128; anything else raises :class:`~swarm.errors.PortMapError`. :func:`exchange` also carries
PCP (:mod:`swarm.net.pcp`), which shares the port.
"""

from __future__ import annotations

import asyncio
import ipaddress
import struct
from collections.abc import Callable
from dataclasses import dataclass

from swarm.errors import PortMapError

PORT = 5351
OP_ADDRESS, OP_MAP_UDP, OP_MAP_TCP = 0, 1, 2
RESULTS = {
    0: "success",
    1: "unsupported version",
    2: "not authorized / refused",
    3: "network failure",
    4: "out of resources",
    5: "unsupported opcode",
}
_RETRIES_S = (0.25, 0.5, 1.0)  # RFC 6886 3.1 starts at 250 ms and doubles
MAX_ANSWER_BYTES = 1100  # a PCP message's limit (RFC 6887 7); NAT-PMP answers are 16 at most


@dataclass(frozen=True)
class MappingAnswer:
    """A gateway's answer to a mapping request."""

    protocol: str  # "udp" or "tcp"
    internal_port: int
    external_port: int
    lifetime_s: int  # 0 after a removal


def address_request() -> bytes:
    return struct.pack("!BB", 0, OP_ADDRESS)


def mapping_request(
    protocol: str, internal_port: int, external_port: int, lifetime_s: int
) -> bytes:
    """A request to map (lifetime > 0) or remove (lifetime 0) ``internal_port``."""
    op = {"udp": OP_MAP_UDP, "tcp": OP_MAP_TCP}[protocol]
    return struct.pack("!BBHHHI", 0, op, 0, internal_port, external_port, lifetime_s)


def _header(data: bytes, op: int, size: int) -> None:
    if len(data) != size:
        raise PortMapError(f"NAT-PMP: a {len(data)}-byte answer, expected {size}")
    version, opcode, result = struct.unpack_from("!BBH", data)
    if version != 0 or opcode != 128 + op:
        raise PortMapError(
            f"NAT-PMP: answer version {version} opcode {opcode}, expected 0/{128 + op}"
        )
    if result != 0:
        raise PortMapError(f"NAT-PMP: router refused: {RESULTS.get(result, f'result {result}')}")


def parse_address_answer(data: bytes) -> str:
    """The gateway's external IPv4 address."""
    _header(data, OP_ADDRESS, 12)
    address = ipaddress.IPv4Address(data[8:12])
    if address.is_unspecified:
        raise PortMapError("NAT-PMP: the router has no external address yet")
    return str(address)


def parse_mapping_answer(data: bytes, protocol: str) -> MappingAnswer:
    op = {"udp": OP_MAP_UDP, "tcp": OP_MAP_TCP}[protocol]
    _header(data, op, 16)
    internal, external, lifetime = struct.unpack_from("!HHI", data, 8)
    if lifetime and (internal == 0 or external == 0):
        raise PortMapError("NAT-PMP: a mapping answer with port 0")
    return MappingAnswer(protocol, internal, external, lifetime)


class _Exchange(asyncio.DatagramProtocol):
    def __init__(self, gateway: str) -> None:
        self.gateway = gateway
        self.answers: asyncio.Queue[bytes] = asyncio.Queue(maxsize=16)

    def datagram_received(self, data: bytes, addr: tuple) -> None:  # type: ignore[override]
        if addr[0] == self.gateway and not self.answers.full():  # RFC 6886 3.1: only the gateway
            self.answers.put_nowait(bytes(data[:MAX_ANSWER_BYTES]))


async def exchange(
    gateway: str,
    request: bytes,
    *,
    local_host: str,
    answer_size: int | None = None,
    accept: Callable[[bytes], bool] | None = None,
    protocol_name: str = "NAT-PMP",
) -> bytes:
    """Send ``request`` to ``gateway:5351`` with RFC 6886 retries; the first answer of
    ``answer_size`` bytes (or that ``accept`` takes), others from the gateway are ignored.

    Raises:
        PortMapError: no answer (nothing listens on the gateway's port 5351).
    """
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_datagram_endpoint(
        lambda: _Exchange(gateway), local_addr=(local_host, 0)
    )
    try:
        for wait in _RETRIES_S:
            transport.sendto(request, (gateway, PORT))
            try:
                async with asyncio.timeout(wait):
                    while True:
                        data = await protocol.answers.get()
                        if len(data) == answer_size or (accept is not None and accept(data)):
                            return data
            except TimeoutError:
                continue
    finally:
        transport.close()
    raise PortMapError(f"{protocol_name}: no answer from {gateway}")
