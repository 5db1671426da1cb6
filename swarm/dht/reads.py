"""What a read keeps of several holders' answers for one key (sans-I/O).

Per slot, the newest unexpired entry whose owner signature verifies (a stale or lying holder
can neither hide nor forge another peer's entry), with ``age_s`` set to the lower median of the
witnessed ages that the holders which returned the slot reported, capped to the entry's possible
life (:mod:`swarm.dht.provenance`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

from swarm.dht.provenance import median_age, possible_life
from swarm.dht.records import DHTEntry
from swarm.identity import PeerID

Slot = tuple[bytes, str]
AgeReports = dict[Slot, dict[bytes, float]]  # slot -> {holder's node id: reported age}


def add_reports(reports: AgeReports, more: Mapping[Slot, Mapping[bytes, float]]) -> None:
    """Merge ``more`` into ``reports`` (one report per holder and slot)."""
    for slot, ages in more.items():
        reports.setdefault(slot, {}).update(ages)


def merge_reads(
    candidates: Iterable[DHTEntry],
    reports: Mapping[Slot, Mapping[bytes, float]],
    verify: Callable[[DHTEntry], bool],
    now: float,
) -> dict[tuple[PeerID, str], DHTEntry]:
    """The newest verified, unexpired entry per slot, aged (see the module docstring)."""
    merged: dict[Slot, DHTEntry] = {}
    for entry in candidates:
        if entry.expiration <= now:
            continue
        current = merged.get(entry.slot)
        if current is not None and current.expiration >= entry.expiration:
            continue
        if not verify(entry):
            continue
        merged[entry.slot] = entry
    return {
        (e.owner, e.subkey): dataclasses.replace(
            e,
            age_s=min(
                median_age(reports.get(e.slot, {}).values()), possible_life(e.expiration, now)
            ),
        )
        for e in merged.values()
    }
