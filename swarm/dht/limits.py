"""Work bounds for the DHT (sans-I/O): budgets per host and subnet, and return-routability
cookies.

- :class:`HostBuckets` (from :mod:`swarm.hosts`, re-exported) meters work per host (IPv4 /32,
  IPv6 /64) and per subnet (/24, /48) together, never per ``(address, port)``: 64 sockets of one
  host share one budget, 16 addresses of one /24 share :data:`SUBNET_SHARE` hosts' worth. The
  budgets below are sized so that a few honest peers behind one address (a NAT), or a test with
  dozens of peers on one loopback address, never meet them, while a flood from a host costs the
  node at most a few percent of a core (an Ed25519 check is ~0.1-0.2 ms):

  ===============  ==============================  ===========  ========
  budget           meters                          host rate/s  burst
  ===============  ==============================  ===========  ========
  datagrams        every datagram, before parsing  1000         4000
  public-key work  signature checks, agreements    200          800
  new slots        slots a store adds              50           400
  ===============  ==============================  ===========  ========

  A forged entry costs its sender :data:`FORGERY_PENALTY` of public-key work on top (see
  :mod:`swarm.dht.intake`).
- :class:`TokenBuckets` (from :mod:`swarm.hosts`, re-exported) meters anything per key.
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

from swarm.hosts import HostBuckets, TokenBuckets

__all__ = ["Cookies", "HostBuckets", "TokenBuckets"]

SUBNET_SHARE = 4.0  # a subnet's budgets, in hosts' budgets
DATAGRAM_RATE = 1000.0  # datagrams per second from one host, sustained
DATAGRAM_BURST = 4000.0
VERIFY_RATE = 200.0  # public-key operations per second for one host, sustained
VERIFY_BURST = 800.0
SLOT_RATE = 50.0  # new slots per second that one host may add to the storage, sustained
SLOT_BURST = 400.0
# what a forged entry costs its source, on top of the checks it made us do: twice a host's
# burst, so its host's budget is in debt after it (refused for VERIFY_BURST / VERIFY_RATE s or
# more), and its subnet's after SUBNET_SHARE / 2 forgeries
FORGERY_PENALTY = 2 * VERIFY_BURST

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
        return hmac.new(secret, message, hashlib.sha256).digest()[:COOKIE_BYTES]
