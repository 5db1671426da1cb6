"""Peers named in another peer's record by a short tag: the first hex characters of their
PeerID digest (12 characters, 48 bits: a list of 8 takes about 110 of a record's 768 bytes of
extra fields). The gone list (:mod:`.prober`) and the apart list (:mod:`.apart`) use them."""

from __future__ import annotations

from collections.abc import Iterable

from swarm.identity import PeerID
from swarm.net.record import PeerRecord

TAG_CHARS = 12


def tag_of(peer: PeerID) -> str:
    """The tag that names ``peer`` in a record."""
    return peer.digest.hex()[:TAG_CHARS]


def by_tag(peers: Iterable[PeerID]) -> dict[str, PeerID]:
    """``peers`` by their tags (to resolve the tags a record lists)."""
    return {tag_of(p): p for p in peers}


def tags_in(record: PeerRecord, field: str, limit: int) -> list[str]:
    """The tags ``record`` lists under ``extra[field]``: [] when the entry is missing, not a
    list or longer than ``limit``; entries that are not tags are left out."""
    raw = record.extra.get(field)
    if not isinstance(raw, list) or len(raw) > limit:
        return []
    return [t for t in raw if isinstance(t, str) and len(t) == TAG_CHARS]
