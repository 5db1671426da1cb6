"""One answer page of ``find_value`` (sans-I/O): a key's entries in listing order, cut to fit.

A holder answers one page at a time, with a ``[round, index]`` cursor to the next (see
:meth:`~swarm.dht.records.RecordStorage.fair_order`). Beside each entry goes the witnessed age
of its slot here, in whole seconds (``ages``, same length as ``entries``; unsigned, a reader
takes the median over holders, see :mod:`swarm.dht.provenance`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swarm.dht.records import RecordStorage
from swarm.errors import DHTError

AGE_BYTES = 5  # an age in whole seconds packs in at most 5 msgpack bytes (below 2**32)


@dataclass(frozen=True)
class Page:
    """Entries (wire form) and their slots' ages, the cursor to the next page, bytes used."""

    entries: list[Any]
    ages: list[int]
    next: list[int] | None
    used: int


def parse_cursor(cursor: Any) -> tuple[int, int]:
    """``[round, index]`` from a request (None: the first page); raises :class:`DHTError`."""
    if cursor is None:
        return 0, 0
    if (
        isinstance(cursor, list)
        and len(cursor) == 2
        and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in cursor)
    ):
        return cursor[0], cursor[1]
    raise DHTError("a find_value cursor is [round, index]")


def answer_page(
    storage: RecordStorage, key: bytes, start_round: int, start: int, budget: int
) -> Page:
    """The entries of ``key`` from the cursor on that fit in ``budget`` bytes (ages included)."""
    rounds = storage.fair_order(key)
    entries: list[Any] = []
    ages: list[int] = []
    used = 0
    next_cursor: list[int] | None = None
    if start_round < len(rounds):
        page = rounds[start_round]
        index = start
        while index < len(page):
            size = storage.size_of(page[index]) + AGE_BYTES
            if used + size > budget:
                break
            used += size
            entries.append(page[index].to_wire())
            ages.append(int(storage.witnessed_age(page[index])))
            index += 1
        if index < len(page):
            next_cursor = [start_round, index]
        elif start_round + 1 < len(rounds):
            next_cursor = [start_round + 1, 0]
    return Page(entries, ages, next_cursor, used)
