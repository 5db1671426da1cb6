"""How long to wait for an answer, from the round-trip times of recent answers (sans-I/O).

A request waits for its answer as long as recent answers suggest (smoothed RTT plus four
deviations, as TCP does, between :data:`MIN_TIMEOUT_S` and the node's ``request_timeout``), so a
dead node stalls a lookup for about a second on a fast network instead of the full timeout; a
lookup steps past an unanswered request sooner still (:attr:`RttEstimator.stall_after`).
"""

from __future__ import annotations

import time

MIN_TIMEOUT_S = 1.0
MIN_STALL_S = 0.01  # srtt + 4 rttvar, at least this: on a LAN a dead node costs a lookup ~10 ms
RTT_MEMORY_S = 10.0  # an RTT estimate this old restarts from the next sample


class RttEstimator:
    """How long to wait for an answer: smoothed RTT plus four deviations (RFC 6298), clamped.

    An estimate that got no sample for ``RTT_MEMORY_S`` restarts from the next one instead of
    blending it in: a node that last asked while joining a busy swarm had learnt RTTs of hundreds
    of milliseconds, and with RFC 6298's gains took twenty answers to forget them, waiting that
    long for each dead node meanwhile.

    Args:
        floor: the shortest :attr:`timeout`.
        ceiling: the longest :attr:`timeout` and :attr:`stall_after` (the node's request timeout).
    """

    def __init__(self, floor: float, ceiling: float):
        self.floor, self.ceiling = floor, ceiling
        self.srtt: float | None = None
        self.rttvar = 0.0
        self._observed_at = 0.0

    @classmethod
    def for_timeout(cls, request_timeout: float) -> RttEstimator:
        """An estimator whose waits end within ``request_timeout``."""
        return cls(min(MIN_TIMEOUT_S, request_timeout), request_timeout)

    def observe(self, rtt: float, now: float | None = None) -> None:
        """Add one RTT sample (``now``: its time on the monotonic clock, default now)."""
        now = time.monotonic() if now is None else now
        stale = now - self._observed_at > RTT_MEMORY_S
        self._observed_at = now
        if self.srtt is None or stale:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt

    @property
    def timeout(self) -> float:
        """Seconds after which an unanswered request counts as failed."""
        if self.srtt is None:
            return self.ceiling
        return min(self.ceiling, max(self.floor, self.srtt + 4 * self.rttvar))

    @property
    def stall_after(self) -> float:
        """Seconds after which an unanswered request no longer holds up a lookup."""
        if self.srtt is None:
            return self.ceiling
        return min(self.ceiling, max(MIN_STALL_S, self.srtt + 4 * self.rttvar))
