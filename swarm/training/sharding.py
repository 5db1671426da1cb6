"""Disjoint data shards without a coordinator: rendezvous hashing over the live peer list.

The dataset is cut into ``num_shards`` fixed shards (item ``i`` belongs to shard
``i % num_shards``). Shard ``s`` goes to the live peer ``p`` with the highest
``sha256(salt, s, p)`` (highest-random-weight / rendezvous hashing). Why this and not claims in the
DHT: every peer computes the same answer from the same ``{run}/peers`` listing with no extra
messages, no claim races and no expirations to tune; when a peer joins or leaves, only the shards
it wins or loses move (1/N of the data), the rest of the swarm keeps its data. The price: while
two peers' listings disagree (up to one heartbeat after churn), a shard may be read twice or
skipped; for SGD on shuffled data that is harmless, so recompute the assignment once per epoch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence


def _weight(salt: str, shard: int, peer: bytes) -> bytes:
    return hashlib.sha256(f"{salt}/{shard}/".encode() + peer).digest()


def assign_shards(
    peers: Iterable[bytes | str], num_shards: int, *, salt: str = ""
) -> dict[bytes, list[int]]:
    """Map each peer (id bytes or text) to the shards it owns; every shard has one owner.

    Raises:
        ValueError: no peers, or ``num_shards`` < 1.
    """
    ids = sorted({p.encode() if isinstance(p, str) else bytes(p) for p in peers})
    if not ids:
        raise ValueError("need at least one peer to assign shards to")
    if num_shards < 1:
        raise ValueError("num_shards must be >= 1")
    owners: dict[bytes, list[int]] = {p: [] for p in ids}
    for shard in range(num_shards):
        owner = max(ids, key=lambda p: _weight(salt, shard, p))
        owners[owner].append(shard)
    return owners


def shard_indices(num_items: int, shards: Sequence[int], num_shards: int) -> list[int]:
    """Item indices of the given shards (item ``i`` is in shard ``i % num_shards``), sorted."""
    if num_shards < 1 or num_items < 0:
        raise ValueError("num_shards must be >= 1 and num_items >= 0")
    mine = set(shards)
    return [i for i in range(num_items) if i % num_shards in mine]


def my_items(
    peers: Iterable[bytes], me: bytes, num_items: int, num_shards: int | None, *, salt: str
) -> list[int]:
    """The items peer ``me`` trains on among ``peers`` (``me`` counted in); ``num_shards``
    defaults to ``max(64, 4 x peers)``, so shards stay small as the swarm grows."""
    ids = set(peers) | {me}
    num_shards = num_shards or max(64, 4 * len(ids))
    mine = assign_shards(ids, num_shards, salt=salt)
    return shard_indices(num_items, mine[me], num_shards)
