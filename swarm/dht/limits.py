"""Work bounds for the DHT (sans-I/O): per-source token buckets and return-routability cookies.

- :class:`TokenBuckets` meters anything per source (datagrams, signature checks): ``rate`` per
  second with bursts of ``burst``, for at most ``max_sources`` sources at once (the least recently
  seen are forgotten first, and start again with a full bucket, which costs an attacker nothing it
  could not get from a fresh source address anyway).
- :class:`Cookies` issues and checks return-routability cookies, as DNS cookies (RFC 7873) and
  BitTorrent's BEP 42 do: an HMAC under a secret of ours over the source address and key. A node
  that echoes the cookie proves that it receives at the address it claims, so it may get answers
  larger than its request; a spoofed source never sees the cookie, so it gets an answer no larger
  than what it sent (no amplification toward a victim). The secret rotates, and the previous one
  is still accepted, so a cookie lives between one and two periods.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections import OrderedDict
from collections.abc import Hashable

COOKIE_BYTES = 16
COOKIE_PERIOD_S = 120.0
_COOKIE_CONTEXT = b"swarm/dht-cookie/v1"


class TokenBuckets:
    """A token bucket per source: ``take(source, cost)`` is True while the source is in budget."""

    def __init__(self, rate: float, burst: float, max_sources: int = 8192):
        self.rate = rate
        self.burst = burst
        self.max_sources = max_sources
        self._buckets: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()
        self.refused = 0

    def take(self, source: Hashable, cost: float = 1.0, *, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        tokens, last = self._buckets.get(source, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        allowed = tokens >= cost
        if allowed:
            tokens -= cost
        else:
            self.refused += 1
        self._buckets[source] = (tokens, now)
        self._buckets.move_to_end(source)
        if len(self._buckets) > self.max_sources:
            self._buckets.popitem(last=False)
        return allowed


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
        return hmac.new(secret, message, hashlib.sha256).digest()[:COOKIE_BYTES]
