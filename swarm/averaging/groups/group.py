"""Group agreement (sans-I/O): matchmaking declarations, the leader rule and the agreed group.

A peer that wants to average declares itself under ``{run}/mm/{group_key}/{schema_hash}`` with its
signed :class:`~swarm.net.record.PeerRecord` and its deadline (which is also the entry's
expiration). Among the candidates a peer sees, the leader is the smallest PeerID that is still
looking; followers join it, and the leader's answer, the ordered member list and a random group
id (:class:`GroupInfo`), is the only thing that makes a group. Why stale views cannot split a
group:

- a follower joins one leader at a time and accepts the first answer only; after an ambiguous
  failure (a timeout: the leader may have counted it) it gives up the round instead of joining
  someone else;
- a peer that is itself joining refuses joins, and a leader with followers never joins anyone,
  so no peer is both a member of one group and the leader of another;
- a leader closes no later than the earliest deadline of its members, so it answers every
  follower while that follower still waits.

Two leaders may still start under one key when their views missed each other (a late peer, a
DHT read that did not see a declaration yet). A leader that sees a leader with a smaller PeerID
whose group has room for its own disbands before closing: it answers its followers "no group"
(they read the key again and find the smaller leader) and joins that leader itself. So the
halves of a split merge instead of averaging apart.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from swarm.errors import AuthError, AveragingError, TransportError
from swarm.identity import PeerID
from swarm.net import wire
from swarm.net.record import MAX_RECORD_BYTES, PeerRecord

GROUP_ID_BYTES = 16
MAX_GROUP_SIZE = 256
MAX_DECLARATION_BYTES = MAX_RECORD_BYTES + 256


def matchmaking_key(run_id: str, group_key: str, schema: str) -> str:
    """The DHT key under which peers of one run, group key and schema look for each other."""
    return f"{run_id}/mm/{group_key}/{schema}"


@dataclass(frozen=True)
class Declaration:
    """A peer's matchmaking announcement (the value of its DHT entry)."""

    record: PeerRecord  # how to reach the peer (signed by it)
    deadline: float  # wall-clock time at which it stops looking (= the entry's expiration)
    busy: bool = False  # already in a group: do not wait for it
    leading: bool = False  # has followers: it will not join anyone, join it instead
    size: int = 1  # members so far, the peer included (a leader's group size)

    def serialize(self) -> bytes:
        return wire.pack(
            {
                "r": self.record.serialize(),
                "d": float(self.deadline),
                "b": self.busy,
                "l": self.leading,
                "n": self.size,
            }
        )

    @classmethod
    def parse(cls, data: Any, owner: PeerID) -> Declaration:
        """Decode a DHT value stored by ``owner``.

        Raises:
            AveragingError: malformed, or the record belongs to someone else than the owner.
        """
        try:
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise TransportError(f"a declaration is bytes, not {type(data).__name__}")
            obj = wire.unpack(bytes(data), max_bytes=MAX_DECLARATION_BYTES, what="declaration")
            if not isinstance(obj, dict) or not isinstance(obj.get("r"), bytes):
                raise TransportError("declaration: expected {r: record, d: deadline, b: busy}")
            deadline, busy, leading = obj.get("d"), obj.get("b", False), obj.get("l", False)
            if not isinstance(deadline, float) or not math.isfinite(deadline):
                raise TransportError("declaration: deadline must be a finite float")
            if not isinstance(busy, bool) or not isinstance(leading, bool):
                raise TransportError("declaration: busy and leading must be bools")
            size = obj.get("n", 1)
            if isinstance(size, bool) or not isinstance(size, int):
                raise TransportError("declaration: size must be an int")
            if not 1 <= size <= MAX_GROUP_SIZE:
                raise TransportError(f"declaration: size {size} is outside [1, {MAX_GROUP_SIZE}]")
            record = PeerRecord.parse(obj["r"])
        except (TransportError, AuthError) as e:
            raise AveragingError(f"invalid matchmaking declaration: {e}") from e
        if record.peer_id != owner:
            raise AveragingError("matchmaking declaration carries another peer's record")
        return cls(record, deadline, busy, leading, size)


def choose_leader(
    candidates: Iterable[PeerID], leading: Iterable[PeerID] = (), exclude: Iterable[PeerID] = ()
) -> PeerID | None:
    """Whom to join: the smallest PeerID among those already ``leading`` (they will never join
    anyone), else the smallest candidate; never one in ``exclude``. None when nobody is left.

    ``candidates`` includes the caller itself: getting itself back means "wait as the leader".
    """
    excluded = set(exclude)
    eligible = [c for c in candidates if c not in excluded]
    leaders = [c for c in leading if c not in excluded]
    pool = leaders or eligible
    return min(pool, key=lambda p: p.digest) if pool else None


@dataclass(frozen=True)
class NoGroup:
    """Why matchmaking formed no group this round (it never raises for that)."""

    reason: str  # short and human-readable: "no planned member came"

    def __str__(self) -> str:
        return self.reason


@dataclass(frozen=True)
class GroupInfo:
    """What a group agreed on: its id and the ordered member list (the part order)."""

    group_id: bytes  # random, chosen by the leader
    members: tuple[PeerRecord, ...]  # ordered: members[j] owns part j
    # the leader's measured upload rate of each member in bytes/s (0: never measured; empty:
    # none measured); parts are planned with min(announced, measured), see plan.py
    measured: tuple[float, ...] = ()
    # every member joined with the same digest of the values it would sync (the leader's
    # word, as the member list is): a sync would move nothing, so the group skips it
    agreed: bool = False

    @classmethod
    def create(
        cls,
        members: Sequence[PeerRecord],
        measured: Mapping[PeerID, float] | None = None,
        *,
        agreed: bool = False,
    ) -> GroupInfo:
        """A new group with a fresh id; members are ordered by PeerID and carry the leader's
        ``measured`` rates (missing: 0.0, never measured)."""
        ordered = tuple(sorted(members, key=lambda r: r.peer_id.digest))
        rates = tuple(measured.get(r.peer_id, 0.0) for r in ordered) if measured else ()
        return cls(secrets.token_bytes(GROUP_ID_BYTES), ordered, rates, agreed)

    def subgroup(self, group_id: bytes, keep: Iterable[int]) -> GroupInfo:
        """The members at indices ``keep`` (in order), with their measurements, under
        ``group_id``."""
        kept = sorted(set(keep))
        measured = tuple(self.measured[i] for i in kept) if self.measured else ()
        members = tuple(self.members[i] for i in kept)
        return GroupInfo(group_id, members, measured, self.agreed)

    @property
    def peer_ids(self) -> tuple[PeerID, ...]:
        return tuple(r.peer_id for r in self.members)

    @property
    def bandwidths(self) -> tuple[float, ...]:
        return tuple(r.bandwidth for r in self.members)

    def index_of(self, peer_id: PeerID) -> int:
        """Position of ``peer_id`` in the member list.

        Raises:
            AveragingError: not a member.
        """
        for i, record in enumerate(self.members):
            if record.peer_id == peer_id:
                return i
        raise AveragingError(f"{peer_id.short} is not a member of group {self.group_id.hex()[:8]}")

    def to_wire(self) -> dict[str, Any]:
        return {
            "g": self.group_id,
            "m": [r.serialize() for r in self.members],
            "r": list(self.measured),
            "a": self.agreed,
        }

    @classmethod
    def from_wire(cls, obj: Any, *, me: PeerID, leader: PeerID) -> GroupInfo:
        """Validate a leader's answer: well formed, unique members, ``me`` and ``leader`` in it.

        Raises:
            AveragingError: anything malformed or inconsistent.
        """
        if not isinstance(obj, dict):
            raise AveragingError("group info must be a dict")
        group_id, raw = obj.get("g"), obj.get("m")
        if not isinstance(group_id, bytes) or len(group_id) != GROUP_ID_BYTES:
            raise AveragingError("group info: bad group id")
        if not isinstance(raw, list) or not 2 <= len(raw) <= MAX_GROUP_SIZE:
            raise AveragingError(f"group info: need 2..{MAX_GROUP_SIZE} members")
        try:
            members = tuple(PeerRecord.parse(r) for r in raw if isinstance(r, bytes))
        except (TransportError, AuthError) as e:
            raise AveragingError(f"group info: invalid member record: {e}") from e
        if len(members) != len(raw):
            raise AveragingError("group info: member records must be bytes")
        ids = [m.peer_id for m in members]
        if len(set(ids)) != len(ids):
            raise AveragingError("group info: duplicate members")
        if me not in ids or leader not in ids:
            raise AveragingError("group info: the leader's list leaves out the leader or us")
        measured = obj.get("r", [])
        if not isinstance(measured, list) or len(measured) not in (0, len(members)):
            raise AveragingError("group info: measured rates must be a list, one per member")
        if not all(isinstance(m, float) and 0 <= m < math.inf for m in measured):
            raise AveragingError("group info: measured rates must be finite floats >= 0")
        agreed = obj.get("a", False)
        if not isinstance(agreed, bool):
            raise AveragingError("group info: agreed must be a bool")
        return cls(group_id, members, tuple(measured), agreed)


MAX_STATE_BYTES = 32  # a state digest in a join (see GroupInfo.agreed)
MAX_ORDER = 2**53  # a round order above this is refused (it stays exact in every encoding)
ORDER_SLACK = 1024  # a member's order further ahead of ours than this is not followed


def next_order(own: int, others: Iterable[int]) -> int:
    """The largest of ``own`` and those of ``others`` at most ``ORDER_SLACK`` ahead of it.

    Honest peers fall a few rounds apart (failed rounds, restarts from a downloaded round); a
    hostile member claiming an order far ahead would otherwise drag every honest one to
    ``MAX_ORDER``, where their joins are refused as malformed.
    """
    return max([own, *followed(own, others)])


def followed(own: int, others: Iterable[int]) -> list[int]:
    """The orders of ``others`` a peer at ``own`` may follow: at most ``ORDER_SLACK`` ahead."""
    return [o for o in others if o <= own + ORDER_SLACK]


def is_order(value: Any) -> bool:
    """A well-formed round order: an int in ``[0, MAX_ORDER)`` (bool is not an int here)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_ORDER
