"""Misbehaviour that tests switch on in one averager: the real code paths, no mocks.

A :class:`FaultInjector` is consulted at the few points where a faulty peer differs from an
honest one (what it contributes, the weight it claims, the bandwidth it announces, the bytes it
sends, the average it returns as an owner, whether it answers at all); an honest averager holds
``Fault.NONE`` and every hook is then the identity. The hostile faults are the attacks of the
robustness tests and of ``benchmarks/byzantine.py``.
"""

from __future__ import annotations

import asyncio
import enum

import torch

from swarm.averaging import poison
from swarm.averaging.groups.group import ORDER_SLACK
from swarm.compression.header import Header
from swarm.errors import CompressionError

_FAULT_SLEEP_S = 3600.0
HUGE = 1e30
OVERFLOW = 3e38  # near the float32 limit: a plain float32 accumulator overflows
FLIP_SCALE = -10.0
HUGE_WEIGHT = 1e30  # the largest weight check_weight accepts
HUGE_BANDWIDTH = 1e300
OVERCLAIM_DELAY_S = 0.2  # before each chunk an overclaiming sender sends: a slow link


class Fault(enum.Enum):
    """Misbehaviour a test can switch on in one averager (real code paths, no mocks)."""

    NONE = "none"
    STALL_MID_STREAM = "stall"  # stop sending halfway through every part stream, stay connected
    SKIP_REPLY = "skip-reply"  # as an owner, never answer (hold every stream open): a frozen owner
    HUGE_VALUES = "huge"  # contribute 1e30 everywhere
    SIGN_FLIP = "sign-flip"  # contribute -10 times its values
    HUGE_WEIGHT = "huge-weight"  # contribute 1000.0 with weight 1e30
    OVERFLOW = "overflow"  # contribute 3e38 with weight 1e30
    NAN = "nan"  # contribute a NaN in every chunk (crafted bytes: the codec refuses to encode it)
    LYING_OWNER = "lying-owner"  # return 1e30 as the average of the part it owns
    HUGE_BANDWIDTH = "huge-bandwidth"  # announce 1e300 bytes/s, then lie as owner
    NAN_OWNER = "nan-owner"  # return a NaN in every averaged chunk (crafted bytes, as NAN)
    OVERCLAIM = "overclaim"  # announce 1e300 bytes/s, upload on a slow link (honest values)
    CUT_ONE_REPLY = "cut-one-reply"  # as an owner, break the reply to one sender before its
    # verdict (a connection lost at the end): the only member whose part fails
    # slow poison: in update rounds only (honest elsewhere), inside the clip radius
    ALIE = "alie"  # mean - z std of the colluders' updates (alone: its own update - |update|)
    IPM = "ipm"  # -0.5 x its own update (inner-product manipulation)
    FREE_RIDE = "free-ride"  # a zero update, its full samples claimed
    STALE = "stale"  # its update of 10 rounds ago
    INSIDE_RADIUS = "scaled-inside-radius"  # its update turned around, just inside the radius
    ORDER_AHEAD = "order-ahead"  # claim a round order ORDER_SLACK ahead in every part stream


_CONTRIBUTIONS = {
    Fault.HUGE_VALUES: HUGE,
    Fault.HUGE_WEIGHT: 1000.0,
    Fault.OVERFLOW: OVERFLOW,
}
_LIARS = (Fault.LYING_OWNER, Fault.HUGE_BANDWIDTH)
LIARS = (*_LIARS, Fault.NAN_OWNER)  # faults of an owner: accused, then excluded


SLOW_POISON = (Fault.ALIE, Fault.IPM, Fault.FREE_RIDE, Fault.STALE, Fault.INSIDE_RADIUS)


class FaultInjector:
    """The hooks of one averager's fault; ``triggered`` is set when it fires.

    ``collusion`` is shared by colluding attackers (ALIE pools their updates).
    """

    def __init__(
        self,
        fault: Fault = Fault.NONE,
        triggered: asyncio.Event | None = None,
        collusion: poison.Collusion | None = None,
    ):
        self.fault = fault
        self.triggered = triggered or asyncio.Event()
        self.collusion = collusion if collusion is not None else poison.Collusion()
        self.history = poison.History()
        self.radius = poison.RadiusEstimate()

    @property
    def active(self) -> bool:
        return self.fault is not Fault.NONE

    def bandwidth(self, announced: float) -> float:
        """The bandwidth to announce."""
        if self.fault in (Fault.HUGE_BANDWIDTH, Fault.OVERCLAIM):
            return HUGE_BANDWIDTH
        return announced

    def contribution(self, flat: torch.Tensor, updates: bool = False) -> torch.Tensor:
        """The values to contribute instead of ``flat`` (never modified in place); ``updates``:
        the round averages updates (the slow-poison faults act there only)."""
        if self.fault in SLOW_POISON:
            return self._poison(flat) if updates else flat
        if self.fault in _CONTRIBUTIONS:
            self.triggered.set()
            return torch.full_like(flat, _CONTRIBUTIONS[self.fault])
        if self.fault is Fault.SIGN_FLIP:
            self.triggered.set()
            return flat * FLIP_SCALE
        return flat

    def _poison(self, flat: torch.Tensor) -> torch.Tensor:
        self.triggered.set()
        if self.fault is Fault.IPM:
            return poison.ipm(flat)
        if self.fault is Fault.FREE_RIDE:
            return torch.zeros_like(flat)
        if self.fault is Fault.STALE:
            return self.history.stale(flat)
        if self.fault is Fault.INSIDE_RADIUS:
            return poison.inside_radius(flat, self.radius.distance(flat.numel()))
        return self.collusion.alie(self, flat)

    def observe_radius(self, radius: float, numel: int) -> None:
        """Owner side: a chunk of ``numel`` values was clipped with ``radius`` (what an
        attacker learns of the honest spread from the part it owns)."""
        if self.fault is Fault.INSIDE_RADIUS:
            self.radius.add(radius, numel)

    def order(self, order: int) -> int:
        """The round order to claim in part streams."""
        if self.fault is Fault.ORDER_AHEAD:
            self.triggered.set()
            return order + ORDER_SLACK
        return order

    def weight(self, weight: float) -> float:
        """The weight to claim."""
        return HUGE_WEIGHT if self.fault in (Fault.HUGE_WEIGHT, Fault.OVERFLOW) else weight

    def payload(self, payload: bytes) -> bytes:
        """Sender side: the bytes to send for one chunk (a NaN where the last float32 was)."""
        return self._nan(payload) if self.fault is Fault.NAN else payload

    def averaged_payload(self, payload: bytes) -> bytes:
        """Owner side: the bytes to send back for one averaged chunk."""
        return self._nan(payload) if self.fault is Fault.NAN_OWNER else payload

    def _nan(self, payload: bytes) -> bytes:
        crafted = with_nan(payload)
        if crafted is not payload:
            self.triggered.set()
        return crafted

    def shares(self, shares: tuple[float, float]) -> tuple[float, float]:
        """Owner side, in a pair (:mod:`~swarm.averaging.butterfly.pairs`): the shares of the
        mean to announce, the owner's first; a liar claims all of it."""
        if self.fault in _LIARS:
            self.triggered.set()
            return 1.0, 0.0
        return shares

    def averaged(self, values: torch.Tensor) -> None:
        """Owner side: tamper with an averaged chunk (in place) before it is encoded."""
        if self.fault in _LIARS:
            self.triggered.set()
            values.fill_(HUGE)

    async def before_chunk(self, index: int, count: int) -> None:
        """Sender side, before chunk ``index`` of ``count`` goes out."""
        if self.fault is Fault.STALL_MID_STREAM and index >= count // 2:
            await self._hang()
        if self.fault is Fault.OVERCLAIM:
            self.triggered.set()
            await asyncio.sleep(OVERCLAIM_DELAY_S)

    def cuts_reply(self, sender: int, owner: int) -> bool:
        """Owner side: break the reply to ``sender`` after its chunks, before the verdict (the
        lowest-indexed other member's)."""
        if self.fault is not Fault.CUT_ONE_REPLY or sender != (1 if owner == 0 else 0):
            return False
        self.triggered.set()
        return True

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


# Where a NaN goes in a payload: a float field the codec reads as one (the last value of a
# codec of raw values, else the first of its scales), and the width of its floats.
_NAN_FIELD = {
    "none": ("last", None),
    "fp16": ("last", torch.float16),
    "bf16": ("last", torch.bfloat16),
    "int8": ("scale", torch.float32),
    "1bit": ("scale", torch.float32),
    "topk": ("scale", torch.float32),
    "sparse": ("scale", torch.bfloat16),
}


def with_nan(payload: bytes) -> bytes:
    """``payload`` with a NaN written into one of its float fields (a crafted payload: no codec
    encodes one); ``payload`` itself where it has no such field (empty, or not a payload)."""
    try:
        header, sections = Header.parse(payload)
    except CompressionError:
        return payload
    where, dtype = _NAN_FIELD[header.codec]
    offset = header.size
    if where == "last":
        dtype = dtype or header.dtype
        offset = len(payload) - dtype.itemsize
    elif header.codec == "topk" and not len(sections[0]):
        # no scales: the values, in 16 bits (bfloat16's NaN is a NaN in float16 too)
        dtype = torch.bfloat16
    if offset < header.size or offset + dtype.itemsize > len(payload):
        return payload
    nan = torch.tensor([float("nan")], dtype=dtype).view(torch.uint8).numpy().tobytes()
    return payload[:offset] + nan + payload[offset + len(nan) :]
