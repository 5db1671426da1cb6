"""Refusals logged at WARNING without flooding the log: once per source per interval.

Every layer refuses things from outsiders (datagrams, connections, requests); an attacker can make
thousands a second, and one log line each would be a flood of its own.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict


class RateLimitedWarning:
    """Logs refusals at WARNING, at most once per ``interval_s`` per source, counting the rest."""

    def __init__(self, log: logging.Logger, interval_s: float = 10.0, max_sources: int = 4096):
        self._log = log
        self._interval_s = interval_s
        self._max_sources = max_sources
        self._last: OrderedDict[str, tuple[float, int]] = OrderedDict()
        self.total = 0  # every refusal, logged or not (for metrics)

    def warn(self, source: str, message: str, *args: object) -> None:
        self.total += 1
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
