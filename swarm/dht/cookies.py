"""Return-routability cookies (sans-I/O), as DNS cookies (RFC 7873) and BitTorrent's BEP 42 use.

A cookie is an HMAC under a secret of ours over the source address and key. A node that echoes
the cookie proves that it receives at the address it claims, so it may get answers larger than
its request; a spoofed source never sees the cookie, so it gets an answer no larger than what it
sent (no amplification toward a victim, see :mod:`swarm.dht.answers`). The secret rotates, and
the previous one is still accepted, so a cookie lives between one and two periods.
"""

from __future__ import annotations

import hmac
import os
import time

COOKIE_BYTES = 16
COOKIE_PERIOD_S = 120.0
_COOKIE_CONTEXT = b"swarm/dht-cookie/v1"


class Cookies:
    """Return-routability cookies bound to a source address and the sender's key."""

    def __init__(self, period_s: float = COOKIE_PERIOD_S):
        self.period_s = period_s
        self._secrets = [os.urandom(32), os.urandom(32)]  # current, previous
        self._rotated = time.monotonic()

    def issue(self, address: tuple[str, int], sender: bytes) -> bytes:
        self._rotate()
        return self._mac(self._secrets[0], address, sender)

    def check(self, cookie: object, address: tuple[str, int], sender: bytes) -> bool:
        if not isinstance(cookie, bytes) or len(cookie) != COOKIE_BYTES:
            return False
        self._rotate()
        return any(
            hmac.compare_digest(cookie, self._mac(secret, address, sender))
            for secret in self._secrets
        )

    def _rotate(self) -> None:
        now = time.monotonic()
        if now - self._rotated >= self.period_s:
            self._secrets = [os.urandom(32), self._secrets[0]]
            self._rotated = now

    @staticmethod
    def _mac(secret: bytes, address: tuple[str, int], sender: bytes) -> bytes:
        message = _COOKIE_CONTEXT + f"{address[0]}|{address[1]}|".encode() + sender
        return hmac.digest(secret, message, "sha256")[:COOKIE_BYTES]
