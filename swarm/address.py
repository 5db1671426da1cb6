"""``HOST:PORT`` addresses: what a peer binds, and what others dial.

IPv6 hosts are written in brackets (``[::1]:7000``), as in URLs; :meth:`PeerAddress.parse` and
``str()`` are inverse of each other.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from swarm.errors import ConfigError

MAX_HOST_CHARS = 253  # longest DNS name
# a DNS name or an IPv4 address: letters, digits, '-', '.', '_' (no spaces, no '@', no '/')
_HOSTNAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$")


@dataclass(frozen=True)
class PeerAddress:
    """A host (name, IPv4 or IPv6 address, without brackets) and a TCP/UDP port number."""

    host: str  # "127.0.0.5", "example.org", "::1" (no brackets); "0.0.0.0" binds every interface
    port: int  # 0..65535; 0 asks the OS for a free port when binding

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not _valid_host(self.host):
            raise ConfigError(f"not a valid host: {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int):
            raise ConfigError(f"a port is an integer, got {self.port!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port {self.port} is outside 0..65535")

    @classmethod
    def parse(cls, text: str) -> PeerAddress:
        """Parse ``HOST:PORT``, ``IPV4:PORT`` or ``[IPV6]:PORT``.

        Raises:
            ConfigError: the text is not such an address (the message quotes it).
        """
        if not isinstance(text, str):
            raise ConfigError(f"an address is text like HOST:PORT, got {type(text).__name__}")
        stripped = text.strip()
        if stripped.startswith("["):
            host, sep, port = stripped[1:].partition("]:")
            if not sep or not _is_ipv6(host):
                raise ConfigError(f"not an address: {text!r} (IPv6 is written [::1]:7000)")
        else:
            host, sep, port = stripped.rpartition(":")
            if not sep or ":" in host:
                raise ConfigError(
                    f"not an address: {text!r} (expected HOST:PORT; IPv6 is written [::1]:7000)"
                )
        if not port.isascii() or not port.isdigit() or len(port) > 5:
            raise ConfigError(f"not an address: {text!r} (the port must be a number)")
        return cls(host, int(port))

    @property
    def is_ipv6(self) -> bool:
        return ":" in self.host

    @property
    def is_wildcard(self) -> bool:
        """Whether the host means 'every interface' (only meaningful for binding)."""
        return self.host in ("0.0.0.0", "::")

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` with IPv6 brackets."""
        return f"http://{self}"

    def __str__(self) -> str:
        if self.is_ipv6:
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"


def _is_ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return True


def _valid_host(host: str) -> bool:
    if not host or len(host) > MAX_HOST_CHARS:
        return False
    if ":" in host:
        return _is_ipv6(host)
    return host.isascii() and bool(_HOSTNAME.match(host))
