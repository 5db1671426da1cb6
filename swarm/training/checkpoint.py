"""Checkpoints: model, inner optimizer, outer state, error-feedback residuals and round.

A checkpoint is a plain `safetensors <https://huggingface.co/docs/safetensors>`_ file, readable
with ``safetensors.torch.load_file`` alone (no pickle, so loading one never runs code):

- every tensor of the state is a safetensors tensor named by its path in the state, e.g.
  ``model.fc.weight``, ``optimizer.state.0.exp_avg``, ``outer.anchor.fc.weight``;
- the rest (round, counters, optimizer hyper-parameters, ...) is JSON in the metadata entry
  ``swarm.state``, where a tensor appears as ``{"$t": "<its name>"}``;
- ``swarm.format`` names the format and ``swarm.sha256`` is the SHA-256 of the tensor table, the
  JSON and the raw tensor bytes, so a flipped bit anywhere is caught before anything is used.

Written to a temporary file in the same folder, fsynced, then ``os.replace``d over the target, so
a crash mid-write leaves the previous checkpoint intact. :func:`export_model` writes the model
part alone as a state dict any PyTorch code can load. :func:`check_checkpoint` validates a read
state against a live model and optimizer, so a restore can be all-or-nothing.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from swarm.errors import CheckpointError
from swarm.training.snapshot import MAX_ROUND

FORMAT = "swarm-checkpoint/2"
OLD_MAGIC = b"SWARMCKPT\x01"  # format 1: a custom header + torch pickle (no longer read)
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header
_MAX_DEPTH = 32  # nesting of the JSON state (an optimizer state is about 5 deep)
_TENSOR = "$t"
_TUPLE = "$tuple"
_ITEMS = "$items"  # a dict whose keys are not all strings (optimizer state: int keys)


# -- writing ----------------------------------------------------------------------------------
def write_checkpoint(path: str | os.PathLike[str], state: Mapping[str, Any]) -> None:
    """Atomically write ``state`` (nested dicts/lists of tensors and plain values) to ``path``.

    Raises:
        CheckpointError: the state holds an unsupported value or the file cannot be written.
    """
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, "", tensors, 0)
    meta = json.dumps(tree, allow_nan=False, separators=(",", ":"), sort_keys=True)
    data = st_save(tensors, metadata={"swarm.format": FORMAT, "swarm.state": meta})
    # The checksum covers the JSON and the tensor bytes; it is added to the header afterwards.
    header_len = struct.unpack_from("<Q", data, 0)[0]
    header = json.loads(data[8 : 8 + header_len])
    header["__metadata__"]["swarm.sha256"] = _digest(header, meta, data[8 + header_len :])
    _atomic_write(Path(path), _with_header(header, data[8 + header_len :]))


def export_model(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str]) -> int:
    """Write the model of ``checkpoint`` as a plain safetensors state dict; returns its tensors.

    The result loads with ``model.load_state_dict(safetensors.torch.load_file(out))``.

    Raises:
        CheckpointError: the checkpoint is unreadable or corrupt, or ``out`` cannot be written.
    """
    state = read_checkpoint(checkpoint)
    model = state.get("model")
    if not isinstance(model, dict) or not all(isinstance(t, torch.Tensor) for t in model.values()):
        raise CheckpointError(f"checkpoint {checkpoint} holds no model state dict")
    model = {k: t.contiguous() for k, t in model.items()}
    _atomic_write(Path(out), st_save(model, metadata={"format": "pt"}))
    return len(model)


def _digest(header: dict[str, Any], meta: str, body: bytes) -> str:
    """SHA-256 of the tensor table (names, dtypes, shapes, offsets), the JSON state and the data."""
    table = {k: v for k, v in header.items() if k != "__metadata__"}
    h = hashlib.sha256(json.dumps(table, sort_keys=True, separators=(",", ":")).encode())
    h.update(meta.encode())
    h.update(body)
    return h.hexdigest()


def _with_header(header: dict[str, Any], body: bytes) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
    return struct.pack("<Q", len(raw)) + raw + body


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor], depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise CheckpointError(f"checkpoint state nested deeper than {_MAX_DEPTH} at {path!r}")
    if isinstance(value, torch.Tensor):
        # A copy: safetensors refuses tensors that share memory (tied weights).
        tensors[path] = value.detach().to("cpu", copy=True).contiguous()
        return {_TENSOR: path}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CheckpointError(f"checkpoint value {path!r} is not finite ({value})")
        return value
    if isinstance(value, (list, tuple)):
        items = [_encode(v, f"{path}.{i}", tensors, depth + 1) for i, v in enumerate(value)]
        return {_TUPLE: items} if isinstance(value, tuple) else items
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: _encode(v, _join(path, k), tensors, depth + 1) for k, v in value.items()}
        items = []
        for k, v in value.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise CheckpointError(f"checkpoint key {k!r} at {path!r} is not a str or int")
            items.append([k, _encode(v, _join(path, str(k)), tensors, depth + 1)])
        return {_ITEMS: items}
    raise CheckpointError(f"checkpoint value {path!r} has unsupported type {type(value).__name__}")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _atomic_write(target: Path, data: bytes) -> None:
    folder = target.parent if str(target.parent) else Path(".")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        raise CheckpointError(f"cannot write {target}: {e}") from e


# -- reading ----------------------------------------------------------------------------------
def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and verify a checkpoint written by :func:`write_checkpoint` (CPU tensors).

    Raises:
        CheckpointError: missing, truncated, corrupt (checksum), of the old format, or not a
            swarm checkpoint.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from e
    if data.startswith(OLD_MAGIC):
        raise CheckpointError(
            f"{path} is a checkpoint of the old pickle-based format (swarm 0.1), which this "
            "version no longer reads; resume from it with swarm 0.1 and save again, "
            "or start from a fresh model"
        )
    if len(data) < 8:
        raise CheckpointError(f"{path} is not a swarm checkpoint (truncated)")
    header_len = struct.unpack_from("<Q", data, 0)[0]
    if header_len > min(MAX_HEADER_BYTES, len(data) - 8):
        raise CheckpointError(f"{path} is not a swarm checkpoint (bad header length)")
    try:
        header = json.loads(data[8 : 8 + header_len])
        meta = header["__metadata__"]
        fmt, tree_json, digest = meta["swarm.format"], meta["swarm.state"], meta["swarm.sha256"]
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise CheckpointError(f"{path} is not a swarm checkpoint (no swarm metadata)") from e
    if fmt != FORMAT:
        raise CheckpointError(f"{path} has checkpoint format {fmt!r}; this version reads {FORMAT}")
    if not isinstance(tree_json, str) or not isinstance(digest, str):
        raise CheckpointError(f"{path} has malformed swarm metadata")
    if _digest(header, tree_json, data[8 + header_len :]) != digest:
        raise CheckpointError(f"checkpoint {path} is corrupt (checksum mismatch)")
    try:
        tensors = st_load(data)
        tree = json.loads(tree_json)
    except (SafetensorError, ValueError, RecursionError) as e:
        raise CheckpointError(f"checkpoint {path} cannot be decoded: {e}") from e
    state = _decode(tree, tensors, 0)
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} does not hold a state dict")
    return state


def _decode(node: Any, tensors: dict[str, torch.Tensor], depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise CheckpointError(f"checkpoint state nested deeper than {_MAX_DEPTH}")
    if isinstance(node, list):
        return [_decode(v, tensors, depth + 1) for v in node]
    if not isinstance(node, dict):
        return node
    if _TENSOR in node:
        name = node[_TENSOR]
        if len(node) != 1 or not isinstance(name, str) or name not in tensors:
            raise CheckpointError(f"checkpoint refers to a missing tensor {name!r}")
        return tensors[name]
    if _TUPLE in node:
        items = node[_TUPLE]
        if len(node) != 1 or not isinstance(items, list):
            raise CheckpointError("checkpoint holds a malformed tuple")
        return tuple(_decode(v, tensors, depth + 1) for v in items)
    if _ITEMS in node:
        pairs = node[_ITEMS]
        if len(node) != 1 or not isinstance(pairs, list):
            raise CheckpointError("checkpoint holds a malformed mapping")
        out: dict[Any, Any] = {}
        for pair in pairs:
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], (str, int))):
                raise CheckpointError("checkpoint holds a malformed mapping entry")
            out[pair[0]] = _decode(pair[1], tensors, depth + 1)
        return out
    return {k: _decode(v, tensors, depth + 1) for k, v in node.items()}


# -- validation before a restore --------------------------------------------------------------
OPTIONAL_COUNTS = {"values_rounds": 0}
"""Counts that checkpoints of earlier versions lack, and what they then load as."""


def check_checkpoint(
    state: Mapping[str, Any],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    outer: Mapping[str, torch.Size],
) -> None:
    """Check everything a restore will write, before anything is written.

    Args:
        state: a state read by :func:`read_checkpoint`.
        model: the live model: names, shapes and dtypes must match; floats must be finite.
        optimizer: the live optimizer: same parameter groups and sizes; per-parameter state
            tensors finite and no larger than their parameter.
        outer: name -> shape of every outer-state tensor the engine restores.

    Raises:
        CheckpointError: naming the first entry that is missing, misshaped or non-finite, or a
            round or step count past :data:`~swarm.training.snapshot.MAX_ROUND`.
    """
    for key in ("round", "step", "steps_in_round", "values_rounds"):
        value = state.get(key, OPTIONAL_COUNTS.get(key))
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointError(f"checkpoint {key} {value!r} is not a non-negative integer")
        if value > MAX_ROUND:
            raise CheckpointError(f"checkpoint {key} {value} is past the largest sane count 2^40")
    samples = state.get("samples_in_round")
    if not isinstance(samples, (int, float)) or not math.isfinite(samples) or samples < 0:
        raise CheckpointError(f"checkpoint samples_in_round {samples!r} is invalid")
    expected = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    _check_tensors("model", state.get("model"), expected, strict_dtype=True)
    saved_outer = state.get("outer")
    _check_tensors("outer", saved_outer, {k: (s, None) for k, s in outer.items()})
    _check_optimizer(state.get("optimizer"), optimizer)
    averager = state.get("averager", {})
    if not isinstance(averager, dict):
        raise CheckpointError("the checkpoint's averager state is not a dict")
    _check_finite_tree("averager", averager, 0)


def _check_tensors(
    part: str,
    saved: Any,
    expected: Mapping[str, tuple[torch.Size, torch.dtype | None]],
    *,
    strict_dtype: bool = False,
) -> None:
    if not isinstance(saved, dict):
        raise CheckpointError(f"the checkpoint's {part} state is not a dict")
    missing = sorted(set(expected) - set(saved))
    extra = sorted(set(saved) - set(expected))
    if missing or extra:
        raise CheckpointError(
            f"the checkpoint's {part} state does not match this model "
            f"(missing {missing[:3]}, unexpected {extra[:3]})"
        )
    for name, (shape, dtype) in expected.items():
        value = saved[name]
        if not isinstance(value, torch.Tensor) or value.shape != shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise CheckpointError(f"{part} tensor {name} is {got}, this model has {tuple(shape)}")
        if strict_dtype and dtype is not None and value.dtype != dtype:
            raise CheckpointError(f"{part} tensor {name} is {value.dtype}, this model has {dtype}")
        _check_finite(f"{part} tensor {name}", value)


def _check_optimizer(saved: Any, optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(saved, dict) or set(saved) != {"state", "param_groups"}:
        raise CheckpointError("the checkpoint's optimizer state is malformed")
    groups, state = saved["param_groups"], saved["state"]
    live = optimizer.param_groups
    if not isinstance(groups, list) or len(groups) != len(live):
        raise CheckpointError("the checkpoint's optimizer has another number of parameter groups")
    params: dict[int, torch.Tensor] = {}
    for i, (group, mine) in enumerate(zip(groups, live, strict=True)):
        ids = group.get("params") if isinstance(group, dict) else None
        if not isinstance(ids, list) or len(ids) != len(mine["params"]):
            raise CheckpointError(f"optimizer parameter group {i} differs from this optimizer's")
        for key, value in group.items():
            if key != "params":
                _check_finite_tree(f"optimizer group {i} {key}", value, 0)
        for pid, p in zip(ids, mine["params"], strict=True):
            if not isinstance(pid, int) or isinstance(pid, bool) or pid in params:
                raise CheckpointError(f"optimizer parameter group {i} has a bad parameter id")
            params[pid] = p
    if not isinstance(state, dict):
        raise CheckpointError("the checkpoint's optimizer state is not a mapping")
    live_state = optimizer.state_dict()["state"]
    for pid, entry in state.items():
        if pid not in params or not isinstance(entry, dict):
            raise CheckpointError(f"optimizer state refers to an unknown parameter {pid!r}")
        p, mine = params[pid], live_state.get(pid, {})
        for key, value in entry.items():
            where = f"optimizer state {pid}.{key}"
            if not _is_state_value(value):
                raise CheckpointError(f"{where} is a {type(value).__name__}, not a number/tensor")
            _check_finite_tree(where, value, 0)
            if not isinstance(value, torch.Tensor):
                continue
            ref = mine.get(key)
            if isinstance(ref, torch.Tensor) and ref.shape != value.shape:
                raise CheckpointError(f"{where} is {tuple(value.shape)}, expected {ref.shape}")
            if value.dim() and value.shape != p.shape and value.numel() > p.numel():
                raise CheckpointError(f"{where} is larger than its parameter {tuple(p.shape)}")


def _is_state_value(value: Any) -> bool:
    """Tensors, numbers, None, or lists of them (LBFGS keeps lists of tensors)."""
    if value is None or isinstance(value, (torch.Tensor, int, float)):
        return True
    return isinstance(value, (list, tuple)) and all(
        v is None or isinstance(v, (torch.Tensor, int, float)) for v in value
    )


def _check_finite_tree(where: str, value: Any, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise CheckpointError(f"{where} is nested too deep")
    if isinstance(value, torch.Tensor):
        _check_finite(where, value)
    elif isinstance(value, float) and not math.isfinite(value):
        raise CheckpointError(f"{where} is not finite ({value})")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_finite_tree(f"{where}.{k}", v, depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_finite_tree(f"{where}.{i}", v, depth + 1)


def _check_finite(where: str, t: torch.Tensor) -> None:
    if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
        raise CheckpointError(f"{where} holds NaN or infinite values")
