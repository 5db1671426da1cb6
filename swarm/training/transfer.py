"""State transfer for late joiners: live peers serve snapshots, a joiner downloads one in parts.

Protocol (stream ``swarm.state`` on the authenticated transport, empty request body):

- manifest: request header ``{"schema": S, "round": None}``; reply header ``{"ok": True,
  "round": R, "size": N, "sha256": H, "steps_in_round": K, "sketch": [floats], "loss": L,
  "order": O}`` (``O``: the round order it plans groups with, which the joiner takes up), no
  body. The provider builds the snapshot of its current round once (in a worker thread) and
  caches the last two rounds, so a download in progress survives the provider moving on by one
  round. A peer with no state worth offering yet (a joiner that has not adopted, loaded or
  trained one) declines with ``{"ok": False, "reason": ...}``; a decline is not an answer.
- part: ``{"schema": S, "round": R, "offset": O, "length": L}``; reply header ``{"ok": True}``,
  then the bytes ``[O, O+L)`` of that snapshot in chunks.

This module holds both ends of the wire: :class:`StateProvider`, and the joiner's manifest
request (:func:`ask_manifest`, which refuses malformed answers and rounds past
:data:`~swarm.training.snapshot.MAX_ROUND`) and parallel part download (:func:`download_parts`,
re-assigning the part of a provider that fails to another one). Which state a joiner adopts is
decided in :mod:`swarm.training.joining`.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import itertools
import logging
import math
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from swarm.errors import SwarmError, TrainingError, TransportError
from swarm.hosts import scope_of
from swarm.net.record import PeerRecord
from swarm.net.streams import InboundStream, ReplyStream
from swarm.protocols import StreamTransport
from swarm.training.agreement import SKETCH_SLICES, Manifest, sketch_of
from swarm.training.engine import TrainingEngine
from swarm.training.snapshot import MAX_ROUND, pack_snapshot, snapshot_values, unpack_snapshot

logger = logging.getLogger(__name__)

STATE_STREAM = "swarm.state"
CHUNK_BYTES = 1 << 20
MIN_PART_BYTES = 4 << 20
LIE_ROUNDS = 10**9  # how far ahead a Fault.LIE_ROUND provider claims to be
PART_RETRIES = 2  # a provider whose connection broke mid-part is asked again this many times
MAX_ORDER = 1 << 53  # round orders are below this, as in averaging.group (the layers stay apart)
_KEEP_ROUNDS = 2


def _int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TrainingError(f"{name} must be a non-negative integer, got {value!r}")
    return value


async def _no_body() -> AsyncIterator[bytes]:
    return
    yield b""  # pragma: no cover  (makes this an async generator)


class Fault(enum.Enum):
    """Misbehaviour a provider can be told to show, for tests of the joiner's checks."""

    NONE = "none"
    CORRUPT = "corrupt"  # flip a byte in every part it serves
    TRUNCATE = "truncate"  # send only half of every part
    BREAK_ONCE = "break-once"  # break the connection halfway through the first part it serves
    LIE_ROUND = "lie-round"  # claim a round 10^9 ahead, with blown-up weights (consistently)
    LIE_WEIGHTS = "lie-weights"  # serve the current round with weights scaled 100x
    LIE_NAN = "lie-nan"  # serve the current round with NaN weights and a finite sketch


class StateProvider:
    """Serves this peer's current snapshot to joiners (register ``handle`` as a stream).

    It declines until the engine holds a state worth offering (``engine.offer_from_round``:
    set when the peer starts a swarm, adopts or loads a state, or decides to train its own)."""

    def __init__(self, engine: TrainingEngine, fault: Fault = Fault.NONE):
        self.engine = engine
        self.fault = fault
        self.order: Callable[[], int | None] | None = None  # this peer's round order, if any
        self._cache: OrderedDict[int, tuple[bytes, str, list[float]]] = OrderedDict()
        self._build = asyncio.Lock()

    def _build_snapshot(self) -> tuple[int, bytes, str, list[float]]:
        """(round, bytes, sha256, sketch) of the current state; runs in a worker thread.

        The round is the one the state is of, which is later than ``engine.round`` was when a
        round in flight landed meanwhile (the engine's snapshot waits for it)."""
        round_, blob = self.engine.snapshot()
        sketch = list(sketch_of(snapshot_values(blob)))
        if self.fault in (Fault.LIE_ROUND, Fault.LIE_WEIGHTS, Fault.LIE_NAN):
            _, blob, sketch = self._lie(round_, blob, sketch)
        return round_, blob, hashlib.sha256(blob).hexdigest(), sketch

    def _lie(self, round_: int, blob: bytes, sketch: list[float]) -> tuple[int, bytes, list[float]]:
        """A hostile provider's state, served through the normal code path."""
        e = self.engine
        snap = unpack_snapshot(blob, schema=e.schema, expected=e.snapshot_layout())
        scale = {Fault.LIE_ROUND: 1e3, Fault.LIE_WEIGHTS: 100.0, Fault.LIE_NAN: math.nan}
        claimed = round_ + LIE_ROUNDS if self.fault is Fault.LIE_ROUND else round_
        named = [(n, t * scale[self.fault]) for n, t in snap.tensors.items()]
        blob = pack_snapshot(claimed, e.schema, e.config.mode, named)
        if self.fault is not Fault.LIE_NAN:  # the NaN liar shows its honest sketch
            sketch = list(sketch_of(snapshot_values(blob)))
        return claimed, blob, sketch

    async def _current(self) -> tuple[int, bytes, str, list[float]]:
        async with self._build:
            round_ = self.engine.round
            # a round in flight is about to move the anchor: build the state after it lands
            if round_ not in self._cache or self.engine.in_flight:
                built = await asyncio.to_thread(self._build_snapshot)
                round_ = built[0]
                self._cache[round_] = built[1:]
                while len(self._cache) > _KEEP_ROUNDS:
                    self._cache.popitem(last=False)
            return (self._claimed(round_), *self._cache[round_])

    def _claimed(self, round_: int) -> int:
        return round_ + LIE_ROUNDS if self.fault is Fault.LIE_ROUND else round_

    @property
    def offering(self) -> bool:
        """The engine holds a state worth offering to joiners (see the class docstring)."""
        start = self.engine.offer_from_round
        return start is not None and self.engine.round >= start

    async def handle(self, request: InboundStream, reply: ReplyStream) -> None:
        """Stream handler: answers a manifest or a part request (see the module docstring)."""
        async for _ in request:  # a state request carries no body; reject one that does
            await reply.prepare({"ok": False, "reason": "unexpected body"})
            return
        header = request.header if isinstance(request.header, dict) else {}
        if header.get("schema") != self.engine.schema:
            await reply.prepare({"ok": False, "reason": "schema differs"})
            return
        if not self.offering:
            await reply.prepare({"ok": False, "reason": "no state to offer yet"})
            return
        try:
            if header.get("round") is None:
                round_, blob, digest, sketch = await self._current()
                means = self.engine.divergence.means
                await reply.prepare(
                    {
                        "ok": True,
                        "round": round_,
                        "size": len(blob),
                        "sha256": digest,
                        "steps_in_round": self.engine.steps_in_round,
                        "sketch": sketch,
                        "loss": means[-1] if means else None,
                        "order": self.order() if self.order is not None else None,
                    }
                )
                return
            round_ = _int(header.get("round"), "round")
            if self.fault is Fault.LIE_ROUND:
                round_ -= LIE_ROUNDS
            offset = _int(header.get("offset"), "offset")
            length = _int(header.get("length"), "length")
        except TrainingError as e:
            await reply.prepare({"ok": False, "reason": str(e)})
            return
        entry = self._cache.get(round_)
        if entry is None or offset + length > len(entry[0]):
            await reply.prepare({"ok": False, "reason": "round gone or range out of bounds"})
            return
        blob = memoryview(entry[0])
        if self.fault is Fault.CORRUPT and length:
            tampered = bytearray(blob)
            tampered[offset] ^= 0xFF
            blob = memoryview(bytes(tampered))
        elif self.fault is Fault.TRUNCATE:
            length //= 2
        await reply.prepare({"ok": True})
        if self.fault is Fault.BREAK_ONCE:
            self.fault = Fault.NONE
            await reply.write(bytes(blob[offset : offset + length // 2]))
            raise ConnectionResetError("fault injected: the connection broke mid-part")
        for start in range(offset, offset + length, CHUNK_BYTES):
            await reply.write(bytes(blob[start : min(start + CHUNK_BYTES, offset + length)]))
        logger.debug("served %d bytes of round %d's state", length, round_)


async def ask_manifest(
    transport: StreamTransport, record: PeerRecord, schema: str, timeout: float
) -> Manifest | None:
    """The manifest of ``record``'s peer, or None when it declines.

    Raises:
        TrainingError: a malformed manifest, or one claiming a round past ``MAX_ROUND``.
        TransportError, OSError, asyncio.TimeoutError: no answer.
    """
    header = {"schema": schema, "round": None}
    async with transport.stream(record, STATE_STREAM, header, _no_body(), timeout=timeout) as s:
        reply = s.header
        async for _ in s:
            raise TrainingError("a manifest reply carried a body")
    if not isinstance(reply, dict):
        raise TrainingError("a manifest reply that is not a map")
    if reply.get("ok") is not True:
        return None
    round_ = _int(reply.get("round"), "round")
    if round_ > MAX_ROUND:
        raise TrainingError(f"the manifest claims round {round_}, past the largest sane round 2^40")
    digest = reply.get("sha256")
    if not isinstance(digest, str) or len(digest) != 64:
        raise TrainingError("manifest without a valid sha256")
    sketch = reply.get("sketch")
    if not isinstance(sketch, list) or len(sketch) > SKETCH_SLICES:
        raise TrainingError("manifest without a valid sketch")
    if not all(isinstance(x, float | int) and not isinstance(x, bool) for x in sketch):
        raise TrainingError("manifest sketch holds non-numbers")
    loss = reply.get("loss")
    if loss is not None and (not isinstance(loss, float | int) or isinstance(loss, bool)):
        raise TrainingError("manifest loss is not a number")
    order = reply.get("order")
    if order is not None and not (type(order) is int and 0 <= order < MAX_ORDER):
        raise TrainingError("manifest order is not a round order")
    return Manifest(
        record,
        round_,
        _int(reply.get("size"), "size"),
        digest,
        _int(reply.get("steps_in_round"), "steps_in_round"),
        tuple(float(x) for x in sketch),
        None if loss is None else float(loss),
        order,
        getattr(record, "age_s", 0.0),
        subnet_of(record),
    )


def subnet_of(record: PeerRecord) -> str:
    """The subnet (IPv4 /24, IPv6 /48) of the address ``record``'s peer is reached at."""
    return scope_of(record.address.host).subnet


async def _fetch_part(
    transport: StreamTransport,
    m: Manifest,
    schema: str,
    buf: bytearray,
    offset: int,
    length: int,
    timeout: float,
) -> None:
    header = {"schema": schema, "round": m.round, "offset": offset, "length": length}
    async with transport.stream(m.provider, STATE_STREAM, header, _no_body(), timeout=timeout) as s:
        reply = s.header
        if not isinstance(reply, dict) or reply.get("ok") is not True:
            reason = reply.get("reason") if isinstance(reply, dict) else "malformed reply"
            raise TrainingError(f"provider declined the part: {reason}")
        pos, end = offset, offset + length
        async for chunk in s:
            if pos + len(chunk) > end:
                raise TrainingError("provider sent more bytes than asked")
            buf[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
    if pos != end:
        raise TrainingError(f"provider sent {pos - offset} of {length} bytes")


def split_parts(size: int, providers: int, min_part: int = MIN_PART_BYTES) -> list[tuple[int, int]]:
    """Cut ``[0, size)`` into (offset, length) parts: a few per provider, each >= ``min_part``."""
    count = max(1, min(2 * providers, size // max(1, min_part)))
    bounds = [size * i // count for i in range(count + 1)]
    return [(a, b - a) for a, b in itertools.pairwise(bounds) if b > a] or [(0, 0)]


async def download_parts(
    transport: StreamTransport, manifests: Sequence[Manifest], schema: str, timeout: float
) -> bytearray:
    """The bytes of the state ``manifests``' providers hold, in parts from all of them at once.

    Raises:
        TrainingError: every provider failed before the state was complete.
    """
    size = manifests[0].size
    buf = bytearray(size)
    pending: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
    for part in split_parts(size, len(manifests)):
        pending.put_nowait(part)
    left = [pending.qsize()]

    async def worker(m: Manifest) -> None:
        loop = asyncio.get_running_loop()
        retries = PART_RETRIES
        while left[0] > 0:
            try:
                offset, length = pending.get_nowait()
            except asyncio.QueueEmpty:
                await asyncio.sleep(0.05)  # another worker may hand a failed part back
                continue
            started = loop.time()
            try:
                await _fetch_part(transport, m, schema, buf, offset, length, timeout)
            except (SwarmError, OSError, asyncio.TimeoutError) as e:
                pending.put_nowait((offset, length))
                # a connection that broke quickly (a reset under load) earns a retry; a provider
                # that declined, sent too much or too little, or kept us waiting does not
                broken = isinstance(e, TransportError | ConnectionError)
                if broken and retries > 0 and loop.time() - started < timeout / 4:
                    retries -= 1
                    logger.info(
                        "state part from %s broke (%s); asking again", m.provider.peer_id.short, e
                    )
                    continue
                logger.info(
                    "state part from %s failed (%s); re-assigning it", m.provider.peer_id.short, e
                )
                return
            left[0] -= 1

    workers = [asyncio.create_task(worker(m)) for m in manifests]
    try:
        while left[0] > 0 and not all(w.done() for w in workers):
            await asyncio.wait(workers, timeout=0.2)
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    if left[0] > 0:
        raise TrainingError("every provider failed before the state was complete")
    return buf
