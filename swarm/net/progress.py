"""Training progress and machine resources in a peer's record (sans-I/O, bounded, checked).

A peer publishes a :class:`Progress` under ``PeerRecord.extra["pg"]`` at every heartbeat, and a
leave marker ``extra["left"] = True`` when it closes. Both travel inside the signed record, so only
the owner can write them; they are still another peer's claims, so every field is type-checked and
bounded here before a status table, a dashboard or a metric uses it, and text must be printable
(a CPU name carrying terminal escapes is refused with the whole record).

Wire form: a msgpack list ``[FORMAT, role, round, step, ...]`` in the order of the fields below
up to the resources, then the resources, then the fields added since (read when present), about
200 bytes (up to 800 with a full list of lowered peers). Trailing items a newer version may add
are ignored.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields
from typing import Any

from swarm.errors import ConfigError

PROGRESS_FIELD = "pg"  # key of the progress in PeerRecord.extra
LEFT_FIELD = "left"  # key of the leave marker in PeerRecord.extra
FORMAT = 1
MAX_NAME_CHARS = 64  # CPU and GPU names
MAX_WORD_CHARS = 24  # role, codec, reachability, group
MAX_COUNT = 2**53  # rounds, steps, bytes: exact in a float64 (the dashboard's JavaScript)
MAX_RATE = 1e15  # samples/s and bytes/s
MAX_LOSS = 1e30
MAX_GROUP = 4096
MAX_CORES = 1 << 16
MAX_LOWERED = 8  # peers named in one progress as held below half weight
MAX_REASON_CHARS = 64
ROLES = ("trainer", "helper")
REACHABILITY = ("public", "client", "unknown")


@dataclass(frozen=True)
class Resources:
    """What a peer runs on (the machine, not the run)."""

    cpu: str  # CPU model, e.g. "AMD Ryzen 9 7950X" ("" when unknown)
    cores: int  # logical CPU cores
    ram: int  # physical memory in bytes (0 when unknown)
    gpu: str  # GPU name ("" without one)
    gpu_memory: int  # GPU memory in bytes (0 without one)


@dataclass(frozen=True)
class Progress:
    """A peer's training progress at its last heartbeat."""

    role: str  # "trainer" (runs Swarm.step) or "helper" (swarm-peer: DHT and averaging only)
    round: int  # completed averaging rounds
    step: int  # local optimizer steps
    samples_per_s: float  # samples trained per second since the previous heartbeat
    loss: float | None  # last loss the script passed to step() (None when it passes none)
    group_size: int  # members of the last round's group, this peer included (0: alone)
    group: str  # short id of the last round's group ("" when none formed)
    codec: str  # compression codec of the rounds ("" for a helper)
    bytes_in_per_s: float  # averaging bytes received per second since the previous heartbeat
    bytes_out_per_s: float  # averaging bytes sent per second since the previous heartbeat
    utilization: float  # share of wall time computing rather than waiting on the swarm, 0..1
    reachability: str  # "public" (others dial it), "client" (behind NAT), "unknown"
    uptime_s: float  # seconds since the peer started
    resources: Resources
    # added after the resources (an older peer's record ends before them)
    inner_steps: int = 0  # inner steps per round in use (0: unknown, or a helper)
    # the peers whose weight this one lowered (update scoring): (short id, weight factor, why),
    # lowest weight first, at most MAX_LOWERED
    lowered: tuple[tuple[str, float, str], ...] = ()

    def __post_init__(self) -> None:
        _word(self.role, "role", ROLES)
        _word(self.reachability, "reachability", REACHABILITY)
        _word(self.codec, "codec")
        _word(self.group, "group")
        for name in ("round", "step"):
            _count(getattr(self, name), name, MAX_COUNT)
        _count(self.group_size, "group_size", MAX_GROUP)
        for name in ("samples_per_s", "bytes_in_per_s", "bytes_out_per_s", "uptime_s"):
            _number(getattr(self, name), name, 0.0, MAX_RATE)
        _number(self.utilization, "utilization", 0.0, 1.0)
        if self.loss is not None:
            _number(self.loss, "loss", -MAX_LOSS, MAX_LOSS)
        r = self.resources
        if not isinstance(r, Resources):
            raise ConfigError("progress resources must be Resources")
        _text(r.cpu, "cpu", MAX_NAME_CHARS)
        _text(r.gpu, "gpu", MAX_NAME_CHARS)
        _count(r.cores, "cores", MAX_CORES)
        _count(r.ram, "ram", MAX_COUNT)
        _count(r.gpu_memory, "gpu_memory", MAX_COUNT)
        _count(self.inner_steps, "inner_steps", MAX_COUNT)
        _lowered(self.lowered)

    def to_wire(self) -> list[Any]:
        """The msgpack-able form for ``PeerRecord.extra``."""
        own = [getattr(self, f.name) for f in _own_fields()]
        r = self.resources
        later = [getattr(self, f.name) for f in _later_fields()]
        return [FORMAT, *own, r.cpu, r.cores, r.ram, r.gpu, r.gpu_memory, *later]

    @classmethod
    def from_wire(cls, obj: Any) -> Progress:
        """Parse what :meth:`to_wire` made, from another peer.

        Raises:
            ConfigError: wrong shape, type, range or non-printable text.
        """
        own = len(_own_fields())
        width = 1 + own + len(fields(Resources))
        if not isinstance(obj, list) or len(obj) < width or obj[0] != FORMAT:
            raise ConfigError(f"progress: expected a format-{FORMAT} list of {width} items")
        values = obj[1 : 1 + own]
        for i, f in enumerate(fields(cls)[:own]):
            # msgpack keeps 2.0 a float but a script may hand us ints for float fields
            if (
                f.type.startswith("float")
                and isinstance(values[i], int)
                and not isinstance(values[i], bool)
            ):
                values[i] = float(values[i])
        resources = Resources(*obj[1 + own : width])
        later = {f.name: v for f, v in zip(_later_fields(), obj[width:], strict=False)}
        if isinstance(later.get("lowered"), list):  # msgpack gives lists: the field has tuples
            later["lowered"] = tuple(
                tuple(e) if isinstance(e, list) else e for e in later["lowered"]
            )
        return cls(*values, resources=resources, **later)  # type: ignore[misc]

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able fields (resources nested), e.g. for ``swarm-peer status --json``."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "resources"}
        out["resources"] = {f.name: getattr(self.resources, f.name) for f in fields(Resources)}
        out["lowered"] = [list(e) for e in self.lowered]
        return out


@functools.cache  # every record read and written asks: the fields never change
def _own_fields() -> tuple[Any, ...]:
    names = [f.name for f in fields(Progress)]
    return fields(Progress)[: names.index("resources")]


@functools.cache
def _later_fields() -> tuple[Any, ...]:
    names = [f.name for f in fields(Progress)]
    return fields(Progress)[names.index("resources") + 1 :]


def check_extra_fields(extra: dict[str, Any]) -> None:
    """Check the progress and leave-marker entries of a record's ``extra``, when present.

    Raises:
        ConfigError: either is malformed.
    """
    if PROGRESS_FIELD in extra:
        Progress.from_wire(extra[PROGRESS_FIELD])
    if LEFT_FIELD in extra and extra[LEFT_FIELD] is not True:
        raise ConfigError("the leave marker must be true")


def _text(value: Any, name: str, limit: int) -> None:
    if not isinstance(value, str) or len(value) > limit or not value.isprintable():
        raise ConfigError(f"progress field {name} must be printable text of <= {limit} chars")


def _word(value: Any, name: str, allowed: tuple[str, ...] = ()) -> None:
    _text(value, name, MAX_WORD_CHARS)
    if allowed and value not in allowed:
        raise ConfigError(f"progress field {name} must be one of {', '.join(allowed)}")


def _lowered(value: Any) -> None:
    if not isinstance(value, tuple) or len(value) > MAX_LOWERED:
        raise ConfigError(f"progress field lowered must hold <= {MAX_LOWERED} entries")
    for entry in value:
        if not isinstance(entry, tuple) or len(entry) != 3:
            raise ConfigError("progress field lowered must hold [peer, weight, why] entries")
        _word(entry[0], "lowered")
        _number(entry[1], "lowered", 0.0, 1.0)
        _text(entry[2], "lowered", MAX_REASON_CHARS)


def _count(value: Any, name: str, limit: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise ConfigError(f"progress field {name} must be an integer in 0..{limit}")


def _number(value: Any, name: str, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, float) or not math.isfinite(value):
        raise ConfigError(f"progress field {name} must be a finite float")
    if not low <= value <= high:
        raise ConfigError(f"progress field {name} must be within {low:g}..{high:g}")
