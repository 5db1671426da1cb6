"""Uplinks shared by the emulators of several processes (tests/wan.py, tests/many_procs.py)."""

from __future__ import annotations

import math
import multiprocessing
from typing import Any


class SharedUplinks:
    """Every host's uplink, shared by the emulators of several processes: the time each is busy
    until and its rate, in shared memory, reserved under one lock. Create it before starting
    the processes and hand it to them as an argument."""

    def __init__(self, context: Any = None):
        context = context or multiprocessing.get_context("spawn")
        self._busy = context.RawArray("d", 256)  # by the host's last octet
        self._rates = context.RawArray("d", 256)
        self._lock = context.Lock()

    def of(self, host: str) -> _SharedUplink:
        return _SharedUplink(self, int(host.rsplit(".", 1)[1]))


class _SharedUplink:
    """One host's uplink in :class:`SharedUplinks` (the :class:`Link` fields that uplinks use)."""

    def __init__(self, shared: SharedUplinks, slot: int):
        self.shared, self.slot = shared, slot

    @property
    def rate(self) -> float:
        return self.shared._rates[self.slot] or math.inf

    @rate.setter
    def rate(self, value: float) -> None:
        self.shared._rates[self.slot] = value

    def reserve(self, nbytes: int, now: float) -> float:
        busy = self.shared._busy
        with self.shared._lock:
            busy[self.slot] = max(now, busy[self.slot]) + nbytes / self.rate
            return busy[self.slot]
