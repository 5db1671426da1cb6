"""State transfer for late joiners: live peers serve snapshots, a joiner downloads one in parts.

Protocol (stream ``swarm.state`` on the authenticated transport, empty request body):

- manifest: request header ``{"schema": S, "round": None}``; reply header ``{"ok": True,
  "round": R, "size": N, "sha256": H, "steps_in_round": K}``, no body. The provider builds the
  snapshot of its current round once (in a worker thread) and caches the last two rounds, so a
  download in progress survives the provider moving on by one round.
- part: ``{"schema": S, "round": R, "offset": O, "length": L}``; reply header ``{"ok": True}``,
  then the bytes ``[O, O+L)`` of that snapshot in chunks.

The joiner asks several peers for manifests, picks the newest round that most providers agree on
(same checksum), splits the bytes across up to ``parts`` providers, re-assigns the part of a
provider that fails to another one, verifies the SHA-256 of the whole, then parses it against its
own model's layout. Nothing is applied before every check passes.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import itertools
import logging
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from swarm.errors import SwarmError, TrainingError
from swarm.training.engine import TrainingEngine
from swarm.training.snapshot import Snapshot, snapshot_size, unpack_snapshot

logger = logging.getLogger(__name__)

STATE_STREAM = "swarm.state"
CHUNK_BYTES = 1 << 20
MIN_PART_BYTES = 4 << 20
MAX_MANIFESTS = 16
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


class StateProvider:
    """Serves this peer's current snapshot to joiners (register ``handle`` as a stream)."""

    def __init__(self, engine: TrainingEngine, fault: Fault = Fault.NONE):
        self.engine = engine
        self.fault = fault
        self._cache: OrderedDict[int, tuple[bytes, str]] = OrderedDict()
        self._build = asyncio.Lock()

    async def _current(self) -> tuple[int, bytes, str]:
        async with self._build:
            round_ = self.engine.round
            # a round in flight is about to move the anchor: build the state after it lands
            if round_ not in self._cache or self.engine.in_flight:
                round_, blob = await asyncio.to_thread(self.engine.snapshot)
                digest = await asyncio.to_thread(lambda: hashlib.sha256(blob).hexdigest())
                self._cache[round_] = (blob, digest)
                while len(self._cache) > _KEEP_ROUNDS:
                    self._cache.popitem(last=False)
            blob, digest = self._cache[round_]
            return round_, blob, digest

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
                round_, blob, digest = await self._current()
                await reply.prepare(
                    {
                        "ok": True,
                        "round": round_,
                        "size": len(blob),
                        "sha256": digest,
                        "steps_in_round": self.engine.steps_in_round,
                    }
                )
                return
            round_ = _int(header.get("round"), "round")
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
        for start in range(offset, offset + length, CHUNK_BYTES):
            await reply.write(bytes(blob[start : min(start + CHUNK_BYTES, offset + length)]))
        logger.debug("served %d bytes of round %d's state", length, round_)


@dataclass(frozen=True)
class Manifest:
    """One provider's answer: which state it would send."""

    provider: Any  # PeerRecord
    round: int
    size: int
    sha256: str
    steps_in_round: int


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
    return Manifest(
        record,
        _int(reply.get("round"), "round"),
        _int(reply.get("size"), "size"),
        digest,
        _int(reply.get("steps_in_round"), "steps_in_round"),
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
        while left[0] > 0:
            try:
                offset, length = pending.get_nowait()
            except asyncio.QueueEmpty:
                await asyncio.sleep(0.05)  # another worker may hand a failed part back
                continue
            try:
                await _fetch_part(transport, m, schema, buf, offset, length, timeout)
            except (SwarmError, OSError, asyncio.TimeoutError) as e:
                pending.put_nowait((offset, length))
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


async def download_state(
    transport: Any,
    records: Sequence[Any],
    engine: TrainingEngine,
    *,
    parts: int,
    max_bytes: int,
    timeout: float,
) -> tuple[Snapshot, int] | None:
    """Download, verify and parse the swarm's current state from ``records``' peers.

    Returns:
        ``(snapshot, provider's steps_in_round)``, or None when no peer offers a state (this is
        the first training peer).

    Raises:
        TrainingError: providers exist but no complete, verified state could be assembled.
    """
    layout = engine.snapshot_layout()
    bound = min(max_bytes, snapshot_size(layout, schema=engine.schema, mode=engine.config.mode))
    asked = list(records)[:MAX_MANIFESTS]
    answers = await asyncio.gather(
        *(_manifest(transport, r, engine.schema, timeout) for r in asked), return_exceptions=True
    )
    manifests: list[Manifest] = []
    for record, answer in zip(asked, answers, strict=True):
        if isinstance(answer, Manifest) and answer.size <= bound:
            manifests.append(answer)
        elif isinstance(answer, Manifest):
            logger.warning(
                "peer %s offers a state of %d bytes, more than the %d expected",
                record.peer_id.short,
                answer.size,
                bound,
            )
        elif isinstance(answer, BaseException) and not isinstance(answer, Exception):
            raise answer
        else:
            logger.debug("no state from %s: %s", record.peer_id.short, answer)
    if not manifests:
        return None
    votes = Counter((m.round, m.sha256, m.size) for m in manifests)
    failures: list[str] = []
    for key, _ in sorted(votes.items(), key=lambda kv: (kv[0][0], kv[1]), reverse=True)[:3]:
        group = [m for m in manifests if (m.round, m.sha256, m.size) == key][:parts]
        try:
            blob = await _download(transport, group, engine.schema, timeout)
            digest = await asyncio.to_thread(lambda b=blob: hashlib.sha256(b).hexdigest())
            if digest != key[1]:
                raise TrainingError("the assembled state fails its checksum")
            snap = unpack_snapshot(blob, schema=engine.schema, expected=layout)
        except TrainingError as e:
            failures.append(f"round {key[0]}: {e}")
            logger.warning("state download of round %d failed: %s", key[0], e)
            continue
        if snap.round != key[0]:
            failures.append(f"round {key[0]}: snapshot claims round {snap.round}")
            continue
        logger.info(
            "downloaded round %d's state (%d bytes) from %d peers",
            snap.round,
            len(blob),
            len(group),
        )
        return snap, max(m.steps_in_round for m in group)
    raise TrainingError("could not download the swarm's state: " + "; ".join(failures))
