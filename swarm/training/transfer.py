"""State transfer for late joiners: live peers serve snapshots, a joiner downloads one in parts.

Protocol (stream ``swarm.state`` on the authenticated transport, empty request body):

- manifest: request header ``{"schema": S, "round": None}``; reply header ``{"ok": True,
  "round": R, "size": N, "sha256": H, "steps_in_round": K, "sketch": [floats], "loss": L,
  "order": O}`` (``O``: the round order it plans groups with, which the joiner takes up), no
  body. The provider builds the snapshot of its current round once (in a worker thread) and
  caches the last two rounds, so a download in progress survives the provider moving on by one
  round.
- part: ``{"schema": S, "round": R, "offset": O, "length": L}``; reply header ``{"ok": True}``,
  then the bytes ``[O, O+L)`` of that snapshot in chunks.

The joiner asks up to ``MAX_MANIFESTS`` peers chosen at random for manifests, keeps the
providers that agree with the majority (:mod:`swarm.training.agreement`: round, values, loss),
downloads the state most of them hold in exact copies, split across up to ``parts`` of them
(re-assigning the part of a provider that fails to another one), verifies the SHA-256 of the
whole, parses it against its own model's layout, and checks that the values are finite and match
the announced sketch. Nothing is applied before every check passes.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import itertools
import logging
import math
import random
import statistics
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from swarm.errors import SwarmError, TrainingError, TransportError
from swarm.training.agreement import (
    SKETCH_SLICES,
    Manifest,
    agree,
    sketch_distance,
    sketch_of,
)
from swarm.training.engine import TrainingEngine
from swarm.training.snapshot import (
    Snapshot,
    pack_snapshot,
    snapshot_size,
    snapshot_values,
    unpack_snapshot,
)

logger = logging.getLogger(__name__)

STATE_STREAM = "swarm.state"
CHUNK_BYTES = 1 << 20
MIN_PART_BYTES = 4 << 20
MAX_MANIFESTS = 8  # providers asked, chosen at random among the live peers
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
    """Serves this peer's current snapshot to joiners (register ``handle`` as a stream)."""

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

    async def handle(self, request: Any, reply: Any) -> None:
        """Stream handler: answers a manifest or a part request (see the module docstring)."""
        async for _ in request:  # a state request carries no body; reject one that does
            await reply.prepare({"ok": False, "reason": "unexpected body"})
            return
        header = request.header if isinstance(request.header, dict) else {}
        if header.get("schema") != self.engine.schema:
            await reply.prepare({"ok": False, "reason": "schema differs"})
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


async def _manifest(transport: Any, record: Any, schema: str, timeout: float) -> Manifest:
    header = {"schema": schema, "round": None}
    async with transport.stream(record, STATE_STREAM, header, _no_body(), timeout=timeout) as s:
        reply = s.header
        async for _ in s:
            raise TrainingError("a manifest reply carried a body")
    if not isinstance(reply, dict) or reply.get("ok") is not True:
        reason = reply.get("reason") if isinstance(reply, dict) else "malformed reply"
        raise TrainingError(f"provider declined: {reason}")
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
        _int(reply.get("round"), "round"),
        _int(reply.get("size"), "size"),
        digest,
        _int(reply.get("steps_in_round"), "steps_in_round"),
        tuple(float(x) for x in sketch),
        None if loss is None else float(loss),
        order,
    )


async def _fetch_part(
    transport: Any,
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


async def _download(
    transport: Any, manifests: Sequence[Manifest], schema: str, timeout: float
) -> bytearray:
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


@dataclass(frozen=True)
class Joined:
    """What a late joiner adopted, and whom it refused."""

    snapshot: Snapshot
    steps_in_round: int  # the providers' phase in the round (the joiner aligns with it)
    providers: tuple[Any, ...]  # PeerIDs the state was downloaded from
    refused: tuple[tuple[Any, str], ...]  # (PeerID, why) of every provider not copied
    order: int | None = None  # the median round order of the agreeing providers (None: unknown)


async def download_state(
    transport: Any,
    records: Sequence[Any],
    engine: TrainingEngine,
    *,
    parts: int,
    max_bytes: int,
    timeout: float,
) -> Joined | None:
    """Download, verify and parse the state that most of ``records``' peers agree on.

    Returns:
        What was adopted, or None when no peer offers a state (this is the first training peer).

    Raises:
        TrainingError: providers exist but no majority of them agree on a state, or no
            complete, verified state could be assembled from those that do.
    """
    layout = engine.snapshot_layout()
    bound = min(max_bytes, snapshot_size(layout, schema=engine.schema, mode=engine.config.mode))
    records = list(records)
    asked = random.SystemRandom().sample(records, min(len(records), MAX_MANIFESTS))
    answers = await asyncio.gather(
        *(_manifest(transport, r, engine.schema, timeout) for r in asked), return_exceptions=True
    )
    manifests: list[Manifest] = []
    refused: list[tuple[Any, str]] = []
    for record, answer in zip(asked, answers, strict=True):
        if isinstance(answer, Manifest) and answer.size <= bound:
            manifests.append(answer)
        elif isinstance(answer, Manifest):
            refused.append(
                (record.peer_id, f"offers {answer.size} bytes, over the {bound} expected")
            )
        elif isinstance(answer, BaseException) and not isinstance(answer, Exception):
            raise answer
        else:
            logger.debug("no state from %s: %s", record.peer_id.short, answer)
    if not manifests and not refused:
        return None
    oversized = len(refused)
    sketch_len = min(SKETCH_SLICES, sum(n for _, n in layout))
    verdict = agree(manifests, sketch_len=sketch_len)
    refused += [(m.provider.peer_id, why) for m, why in verdict.refused]
    for pid, why in refused:
        logger.warning("state provider %s refused: %s", pid.short, why)
    answered = len(manifests) + oversized
    if not verdict.majority or 2 * len(verdict.accepted) <= answered:
        raise TrainingError(
            f"no majority of state providers agree ({len(verdict.accepted)} of {answered} in "
            "line): " + "; ".join(f"{pid.short}: {why}" for pid, why in refused)
        )
    failures: list[str] = []
    for group in verdict.candidates():
        group = group[:parts]
        m = group[0]
        try:
            blob = await _download(transport, group, engine.schema, timeout)
            digest = await asyncio.to_thread(lambda b=blob: hashlib.sha256(b).hexdigest())
            if digest != m.sha256:
                raise TrainingError("the assembled state fails its checksum")
            snap = unpack_snapshot(blob, schema=engine.schema, expected=layout)
            if snap.round != m.round:
                raise TrainingError(f"the snapshot claims round {snap.round}, not {m.round}")
            if not await asyncio.to_thread(snap.all_finite):
                raise TrainingError("the state holds NaN or Inf values")
            sketch = await asyncio.to_thread(sketch_of, snap.values)
            if sketch_distance(sketch, m.sketch) > 1e-5:
                raise TrainingError("the state does not match the sketch its providers announced")
        except TrainingError as e:
            failures.append(f"round {m.round}: {e}")
            refused += [(x.provider.peer_id, str(e)) for x in group]
            logger.warning("state download of round %d failed: %s", m.round, e)
            continue
        logger.info(
            "downloaded round %d's state (%d bytes) from %d peers; %d of %d providers agreed",
            snap.round,
            len(blob),
            len(group),
            len(verdict.accepted),
            answered,
        )
        orders = [m.order for m in verdict.accepted if m.order is not None]
        return Joined(
            snap,
            max(x.steps_in_round for x in group),
            tuple(x.provider.peer_id for x in group),
            tuple(refused),
            int(statistics.median_low(orders)) if orders else None,
        )
    raise TrainingError("could not download the swarm's state: " + "; ".join(failures))
