"""Swarm membership, replay protection and the keyed checks shared by the DHT and HTTP layers.

Membership modes:

- ``open``: anyone may join; signatures still stop impersonation.
- ``key``: a shared secret (the swarm key). Every datagram and request carries a MAC under it, so
  peers without the key are refused before anything else is looked at.
- ``allowlist``: only the listed Ed25519 public keys are admitted.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

from swarm.errors import AuthError, ConfigError, ReplayError

logger = logging.getLogger(__name__)

MembershipMode = Literal["open", "key", "allowlist"]
MIN_SWARM_KEY_BYTES = 16
NONCE_BYTES = 16


@dataclass(frozen=True)
class Membership:
    """Who may join a swarm."""

    mode: MembershipMode = "open"
    swarm_key: bytes | None = field(default=None, repr=False)  # shared secret, mode "key" only
    allowed: frozenset[bytes] = frozenset()  # Ed25519 public keys, mode "allowlist" only

    def __post_init__(self) -> None:
        if self.mode not in ("open", "key", "allowlist"):
            raise ConfigError(f"unknown membership mode {self.mode!r}")
        if self.mode == "key":
            if not isinstance(self.swarm_key, bytes) or len(self.swarm_key) < MIN_SWARM_KEY_BYTES:
                raise ConfigError(f"a swarm key must be at least {MIN_SWARM_KEY_BYTES} bytes")
        elif self.swarm_key is not None:
            raise ConfigError("swarm_key is only used with mode='key'")
        if self.mode == "allowlist":
            if not self.allowed:
                raise ConfigError("an allow-list needs at least one public key")
            if any(not isinstance(k, bytes) or len(k) != 32 for k in self.allowed):
                raise ConfigError("allow-list entries are 32-byte Ed25519 public keys")
        elif self.allowed:
            raise ConfigError("allowed keys are only used with mode='allowlist'")

    @classmethod
    def open(cls) -> Membership:
        return cls("open")

    @classmethod
    def with_key(cls, swarm_key: bytes | str) -> Membership:
        """A swarm whose members share ``swarm_key`` (any text or bytes, >= 16 bytes)."""
        if isinstance(swarm_key, str):
            swarm_key = swarm_key.strip().encode()
        return cls("key", swarm_key=swarm_key)

    @classmethod
    def allow_list(cls, public_keys: frozenset[bytes] | set[bytes] | list[bytes]) -> Membership:
        return cls("allowlist", allowed=frozenset(public_keys))

    def admits(self, public_key: bytes) -> bool:
        """Whether the holder of ``public_key`` may take part (the swarm key is checked apart)."""
        return self.mode != "allowlist" or public_key in self.allowed

    def check_admitted(self, public_key: bytes) -> None:
        if not self.admits(public_key):
            raise AuthError("public key is not on this swarm's allow-list")

    def mac(self, *parts: bytes) -> bytes:
        """HMAC-SHA256 under the swarm key over ``parts`` (empty bytes when the swarm is not keyed)."""
        if self.swarm_key is None:
            return b""
        mac = hmac.new(self.swarm_key, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(len(part).to_bytes(4, "big"))
            mac.update(part)
        return mac.digest()

    def check_mac(self, tag: bytes, *parts: bytes) -> None:
        """Raise :class:`AuthError` unless ``tag`` is the swarm-key MAC of ``parts``."""
        if self.swarm_key is None:
            return
        if not isinstance(tag, bytes) or not hmac.compare_digest(tag, self.mac(*parts)):
            raise AuthError("missing or wrong swarm key")

    @property
    def key_fingerprint(self) -> bytes:
        """Public, non-secret tag of the swarm key (lets peers tell 'wrong key' apart in logs)."""
        if self.swarm_key is None:
            return b""
        return hashlib.sha256(b"swarm/key-fingerprint/v1" + self.swarm_key).digest()[:8]


class ReplayGuard:
    """Refuses a (timestamp, nonce) pair that is outside the window or was seen before.

    Nonces are remembered for as long as their timestamp stays inside the window, so memory is
    bounded by the message rate times ``2 * window_s``; ``max_entries`` caps it regardless (the
    oldest nonces are forgotten first, and their timestamps are then refused anyway once they
    leave the window).
    """

    def __init__(self, window_s: float = 30.0, max_entries: int = 1_000_000):
        if window_s <= 0:
            raise ConfigError("the replay window must be positive")
        self.window_s = window_s
        self.max_entries = max_entries
        self._seen: OrderedDict[bytes, float] = OrderedDict()
        self._oldest_allowed = 0.0  # timestamps before this were evicted: refuse them

    def check(self, timestamp: float, nonce: bytes, *, now: float | None = None) -> None:
        """Record the pair, or raise :class:`ReplayError` when it must be refused."""
        now = time.time() if now is None else now
        if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
            raise AuthError(f"a nonce is {NONCE_BYTES} bytes")
        if not isinstance(timestamp, (int, float)) or timestamp != timestamp:
            raise AuthError("timestamp is not a number")
        if abs(now - timestamp) > self.window_s:
            raise ReplayError(
                f"timestamp {timestamp:.3f} is {now - timestamp:+.1f} s from now, "
                f"outside the {self.window_s:.0f} s window (check the clocks)"
            )
        if timestamp < self._oldest_allowed:
            raise ReplayError("timestamp is older than the forgotten nonces")
        self._expire(now)
        if nonce in self._seen:
            raise ReplayError("nonce seen before (replayed message)")
        self._seen[nonce] = timestamp
        if len(self._seen) > self.max_entries:
            _, evicted_ts = self._seen.popitem(last=False)
            self._oldest_allowed = max(self._oldest_allowed, evicted_ts)

    def _expire(self, now: float) -> None:
        # insertion order is close to timestamp order; stop at the first fresh entry
        limit = now - self.window_s
        while self._seen:
            nonce, ts = next(iter(self._seen.items()))
            if ts >= limit:
                break
            del self._seen[nonce]


class RateLimitedWarning:
    """Logs refusals at WARNING, at most once per ``interval_s`` per source, counting the rest."""

    def __init__(self, log: logging.Logger, interval_s: float = 10.0, max_sources: int = 4096):
        self._log = log
        self._interval_s = interval_s
        self._max_sources = max_sources
        self._last: OrderedDict[str, tuple[float, int]] = OrderedDict()

    def warn(self, source: str, message: str, *args: object) -> None:
        now = time.monotonic()
        last, suppressed = self._last.get(source, (float("-inf"), 0))
        if now - last < self._interval_s:
            self._last[source] = (last, suppressed + 1)
            return
        if suppressed:
            message += " (%d more refused from it since last report)"
            args = (*args, suppressed)
        self._log.warning(message, *args)
        self._last[source] = (now, 0)
        self._last.move_to_end(source)
        while len(self._last) > self._max_sources:
            self._last.popitem(last=False)
