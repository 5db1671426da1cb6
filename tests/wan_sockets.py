"""The sockets of the WAN emulator (tests/wan.py): a UDP socket the loop reads, ports free on
two hosts at once, and the pumps of one connection run until the first error."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

Addr = tuple[str, int]


class UdpSocket:
    """A non-blocking UDP socket read by the loop; sends never raise (UDP may drop)."""

    def __init__(self, sock: socket.socket, on_datagram: Callable[[bytes, Addr], None]):
        self.sock, self.on_datagram = sock, on_datagram
        sock.setblocking(False)
        asyncio.get_running_loop().add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        for _ in range(64):  # bounded, so one busy socket cannot starve the loop
            try:
                data, addr = self.sock.recvfrom(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. ICMP port unreachable from an earlier send
                logger.debug("udp receive error: %s", e)
                return
            self.on_datagram(data, addr[:2])

    def sendto(self, data: bytes, addr: Addr) -> None:
        if self.sock.fileno() < 0:
            return
        try:
            self.sock.sendto(data, addr)
        except OSError as e:
            logger.debug("udp datagram to %s dropped: %s", addr, e)

    def close(self) -> None:
        if self.sock.fileno() >= 0:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()


def reuse_port_socket(kind: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, kind)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # (Linux, BSD: no Windows)
    return sock


def bind_pair(
    announce_host: str, listen_host: str, shared_udp: bool = False
) -> tuple[socket.socket, socket.socket, int]:
    """TCP + UDP sockets on ``announce_host:P`` for a port ``P`` also free on ``listen_host``;
    ``shared_udp``: other processes may bind ``announce_host:P`` for UDP too."""
    for _ in range(50):
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if shared_udp:
            udp = reuse_port_socket(socket.SOCK_DGRAM)
        else:
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tcp.bind((announce_host, 0))
            port = tcp.getsockname()[1]
            udp.bind((announce_host, port))
            for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):  # the peer binds it later
                with socket.socket(socket.AF_INET, kind) as probe:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    probe.bind((listen_host, port))
            return tcp, udp, port
        except OSError:
            tcp.close()
            udp.close()
    raise OSError(f"no port free on both {announce_host} and {listen_host}")


async def first_error(*coros: Any) -> None:
    """Run ``coros`` to the end; the first exception cancels the rest and propagates."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
