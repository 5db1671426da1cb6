"""Checkpoints: model, inner optimizer, outer state, error-feedback residuals and round.

File layout::

    b"SWARMCKPT\\x01"  magic + format version (10 bytes)
    sha256(payload)    32 bytes
    payload            torch.save() of a dict of tensors and plain values

Written to a temporary file in the same folder, fsynced, then ``os.replace``d over the target, so a
crash mid-write leaves the previous checkpoint intact. Loading checks the magic and the checksum,
then reads the payload with ``torch.load(weights_only=True)`` (no arbitrary pickles).
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from swarm.errors import CheckpointError

MAGIC = b"SWARMCKPT\x01"
_DIGEST = 32


def write_checkpoint(path: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Atomically write ``state`` to ``path`` with a checksum.

    Raises:
        CheckpointError: the state cannot be serialized or the file cannot be written.
    """
    target = Path(path)
    buffer = io.BytesIO()
    try:
        torch.save(state, buffer)
    except (TypeError, AttributeError, RuntimeError) as e:
        raise CheckpointError(f"cannot serialize the checkpoint: {e}") from e
    payload = buffer.getbuffer()
    folder = target.parent if str(target.parent) else Path(".")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC)
                f.write(hashlib.sha256(payload).digest())
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoint {target}: {e}") from e


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and verify a checkpoint written by :func:`write_checkpoint`.

    Raises:
        CheckpointError: missing, truncated, corrupt (checksum) or not a swarm checkpoint.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from e
    head = len(MAGIC) + _DIGEST
    if len(data) < head or not data.startswith(MAGIC):
        raise CheckpointError(f"{path} is not a swarm checkpoint (bad magic or truncated)")
    payload = memoryview(data)[head:]
    if hashlib.sha256(payload).digest() != data[len(MAGIC) : head]:
        raise CheckpointError(f"checkpoint {path} is corrupt (checksum mismatch)")
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a bad pickle; all mean "corrupt"
        raise CheckpointError(f"checkpoint {path} cannot be decoded: {e}") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} does not hold a state dict")
    return state
