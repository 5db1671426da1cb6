"""The byte format of a model snapshot that live peers hand to late joiners.

Layout::

    b"SWSNAP" + u16 version + u32 header length   (12 bytes, little endian)
    msgpack header {"round": int, "schema": str, "mode": str, "tensors": [[name, numel], ...]}
    fp32 values of every tensor, concatenated in header order

The receiver never trusts sizes from the wire: it knows its own model, so it checks that the
schema hash, names and element counts equal what it expects before it reads a single value, and
copies into tensors it allocated itself; NaN or infinite values refuse the whole snapshot, and so
does a round past :data:`MAX_ROUND`. Every malformed input raises :class:`TrainingError`.
"""

from __future__ import annotations

import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import torch

from swarm.errors import TrainingError

MAGIC = b"SWSNAP"
VERSION = 1
_PREFIX = struct.Struct("<6sHI")
MAX_HEADER_BYTES = 4 << 20
# the largest round a snapshot, a manifest or a checkpoint may claim: a round a second for
# 30,000 years; a claim past it is absurd, whoever makes it
MAX_ROUND = 1 << 40


@dataclass(frozen=True)
class Snapshot:
    """A parsed snapshot: CPU fp32 views into the received bytes, keyed by name."""

    round: int  # completed averaging rounds of this state
    mode: str  # training mode of the sender
    tensors: dict[str, torch.Tensor]  # 1-D fp32 views (copy before the bytes go away)
    values: torch.Tensor  # every value, flat fp32 (the same memory as ``tensors``)

    def all_finite(self) -> bool:
        """No NaN or Inf anywhere (checked before anything touches the model)."""
        return bool(torch.isfinite(self.values).all())


def snapshot_size(expected: Sequence[tuple[str, int]], *, schema: str, mode: str) -> int:
    """Upper bound on the bytes of a snapshot of these tensors (header slack included)."""
    header = len(_header(2**62, schema, mode, expected))
    return _PREFIX.size + header + 4 * sum(n for _, n in expected)


def _header(round_: int, schema: str, mode: str, layout: Sequence[tuple[str, int]]) -> bytes:
    tensors = [[name, numel] for name, numel in layout]
    return msgpack.packb({"round": round_, "schema": schema, "mode": mode, "tensors": tensors})


def pack_snapshot(
    round_: int, schema: str, mode: str, named: Sequence[tuple[str, torch.Tensor]]
) -> bytes:
    """Serialize tensors (any device, any float dtype; written as fp32) into a snapshot."""
    header = _header(round_, schema, mode, [(n, t.numel()) for n, t in named])
    start = _PREFIX.size + len(header)
    out = bytearray(start + 4 * sum(t.numel() for _, t in named))
    _PREFIX.pack_into(out, 0, MAGIC, VERSION, len(header))
    out[_PREFIX.size : start] = header
    offset = start
    for _, t in named:
        n = t.numel()
        if n:
            view = torch.frombuffer(out, dtype=torch.float32, count=n, offset=offset)
            view.copy_(t.detach().reshape(-1))
        offset += 4 * n
    return bytes(out)


def unpack_snapshot(
    data: bytes | bytearray | memoryview,
    *,
    schema: str,
    expected: Sequence[tuple[str, int]],
) -> Snapshot:
    """Parse and check a snapshot against the receiver's own layout.

    Args:
        data: the complete snapshot bytes (checksum already verified by the caller).
        schema: the receiver's schema hash; a snapshot of another model is refused.
        expected: ``(name, numel)`` of every tensor the receiver needs, in order.

    Raises:
        TrainingError: malformed, truncated, extended, or of another model.
    """
    view = memoryview(data)
    if view.readonly:  # torch.frombuffer wants writable memory; copy once
        view = memoryview(bytearray(view))
    if len(view) < _PREFIX.size:
        raise TrainingError("snapshot truncated before its header")
    magic, version, header_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC or version != VERSION:
        raise TrainingError(f"not a snapshot of format {VERSION} (magic {magic!r} v{version})")
    start = _PREFIX.size + header_len
    if header_len > MAX_HEADER_BYTES or start > len(view):
        raise TrainingError(f"snapshot header length {header_len} exceeds the data")
    try:
        header = msgpack.unpackb(view[_PREFIX.size : start], strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as e:
        raise TrainingError(f"snapshot header is not valid msgpack: {e}") from e
    if not isinstance(header, dict):
        raise TrainingError("snapshot header is not a map")
    round_, mode = header.get("round"), header.get("mode")
    if not isinstance(round_, int) or isinstance(round_, bool) or round_ < 0:
        raise TrainingError(f"snapshot round {round_!r} is not a non-negative integer")
    if round_ > MAX_ROUND:
        raise TrainingError(f"snapshot claims round {round_}, past the largest sane round 2^40")
    if not isinstance(mode, str):
        raise TrainingError("snapshot mode is not a string")
    if header.get("schema") != schema:
        raise TrainingError("snapshot is of another model (schema hash differs)")
    layout = header.get("tensors")
    if layout != [[name, numel] for name, numel in expected]:
        raise TrainingError("snapshot tensor names or sizes differ from this model's")
    total = 4 * sum(n for _, n in expected)
    if len(view) - start != total:
        raise TrainingError(f"snapshot holds {len(view) - start} value bytes, expected {total}")
    tensors: dict[str, torch.Tensor] = {}
    values = (
        torch.frombuffer(view, dtype=torch.float32, count=total // 4, offset=start)
        if total
        else torch.zeros(0)
    )
    offset = start
    for name, numel in expected:
        if numel:
            t = torch.frombuffer(view, dtype=torch.float32, count=numel, offset=offset)
            if not bool(torch.isfinite(t).all()):  # checked before the receiver copies anything
                raise TrainingError(f"snapshot tensor {name} holds values that are not finite")
            tensors[name] = t
        else:
            tensors[name] = torch.zeros(0)
        offset += 4 * numel
    return Snapshot(round_, mode, tensors, values)


def snapshot_values(data: bytes | bytearray) -> torch.Tensor:
    """The flat fp32 values of a snapshot this peer packed itself (no checks: trusted bytes)."""
    _, _, header_len = _PREFIX.unpack_from(data, 0)
    start = _PREFIX.size + header_len
    if len(data) <= start:
        return torch.zeros(0)
    with warnings.catch_warnings():  # read-only bytes: the view is only ever read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.float32, offset=start)
