"""Misbehaviour that tests switch on in one averager: the real code paths, no mocks.

A :class:`FaultInjector` is consulted at the few points where a faulty peer differs from an
honest one; an honest averager holds ``Fault.NONE`` and every hook is then the identity.
"""

from __future__ import annotations

import asyncio
import enum

_FAULT_SLEEP_S = 3600.0


class Fault(enum.Enum):
    """Misbehaviour a test can switch on in one averager (real code paths, no mocks)."""

    NONE = "none"
    STALL_MID_STREAM = "stall"  # stop sending halfway through every part stream, stay connected
    SKIP_REPLY = "skip-reply"  # as an owner, never answer (hold every stream open)


class FaultInjector:
    """The hooks of one averager's fault; ``triggered`` is set when it fires."""

    def __init__(self, fault: Fault = Fault.NONE, triggered: asyncio.Event | None = None):
        self.fault = fault
        self.triggered = triggered or asyncio.Event()

    @property
    def active(self) -> bool:
        return self.fault is not Fault.NONE

    async def before_chunk(self, index: int, count: int) -> None:
        """Sender side, before chunk ``index`` of ``count`` goes out."""
        if self.fault is Fault.STALL_MID_STREAM and index >= count // 2:
            await self._hang()

    @property
    def owner_silent(self) -> bool:
        """Owner side: accept streams but never answer them."""
        return self.fault is Fault.SKIP_REPLY

    async def hold(self) -> None:
        """Owner side with :attr:`owner_silent`: keep a reply open, unanswered."""
        await self._hang()

    async def _hang(self) -> None:
        self.triggered.set()
        await asyncio.sleep(_FAULT_SLEEP_S)
