"""The state of a whole run, read from the peers' signed records: rows, totals, a table.

:class:`RunReader` joins the DHT as a client (it stores nothing and no peer adds it to its routing
table), reads ``{run}/peers`` on demand and turns each record into a JSON-able row. The same rows
feed ``swarm-peer status`` (a terminal table or ``--json``), the periodic status line of
``swarm-peer`` and the web dashboard.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Iterable, Sequence
from typing import Any

from swarm.address import PeerAddress
from swarm.auth import Membership
from swarm.dht import DHTNode
from swarm.errors import SwarmError
from swarm.identity import Identity
from swarm.net.record import PeerRecord
from swarm.net.transport import Transport
from swarm.peer import fetch_run_records

logger = logging.getLogger(__name__)


class RunReader:
    """Reads a run's peer records through a client DHT node. ``async with RunReader(...)``."""

    def __init__(
        self,
        initial_peers: Sequence[str],
        run_id: str,
        *,
        membership: Membership | None = None,
        identity: Identity | None = None,
        listen_host: str = "0.0.0.0",
    ):
        self.initial_peers = list(initial_peers)
        self.run_id = run_id
        self.membership = membership or Membership.open()
        self.identity = identity or Identity.generate()
        self.listen_host = listen_host
        self.dht: DHTNode | None = None

    async def __aenter__(self) -> RunReader:
        self.dht = await DHTNode.create(
            self.identity, self.membership, host=self.listen_host, port=0, client=True
        )
        try:
            if await self.dht.bootstrap(self.initial_peers) == 0:
                raise SwarmError("no initial peer answered: " + " ".join(self.initial_peers))
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self.dht is not None:
            await self.dht.close()
            self.dht = None

    async def records(self) -> list[PeerRecord]:
        """The live records of the run (leave markers and bad records left out)."""
        if self.dht is None:
            raise SwarmError("the reader is not open")
        live, _left = await fetch_run_records(self.dht, self.run_id)
        return list(live.values())

    async def snapshot(self) -> dict[str, Any]:
        """``{"run_id", "time", "peers": [row...], "totals": {...}}``, JSON-able."""
        rows = [peer_row(r) for r in await self.records()]
        rows.sort(key=lambda row: row["address"])
        add_weight_views(rows)
        return {"run_id": self.run_id, "time": time.time(), "peers": rows, "totals": totals(rows)}

    async def hint(self) -> str:
        """Why a run may show no peer: asks the initial peers which run they are in."""
        found: list[str] = []
        transport = Transport(
            self.identity,
            self.membership,
            run_id=self.run_id,
            listen=PeerAddress(self.listen_host, 0),
        )
        await transport.start()
        try:
            for text in self.initial_peers:
                try:
                    record = await transport.fetch_info(PeerAddress.parse(text), timeout=5.0)
                except (SwarmError, OSError) as e:
                    logger.debug("no /info from %s: %s", text, e)
                    continue
                if record.run_id != self.run_id:
                    found.append(f"{text} is in run {record.run_id!r}")
        finally:
            await transport.close()
        if found:
            return f"no peer announced run {self.run_id!r}: " + "; ".join(found) + " (--run-id?)"
        return (
            f"no peer announced run {self.run_id!r}: check --run-id (it must match the peers' "
            "--run-id or Swarm(run_id=...)) and --swarm-key"
        )


def peer_row(record: PeerRecord) -> dict[str, Any]:
    """One peer as plain JSON-able values (progress fields flattened in, resources nested)."""
    row: dict[str, Any] = {
        "peer": str(record.peer_id),
        "short": record.peer_id.short,
        "address": str(record.address),
        "device": record.device,
        "version": record.version,
        "bandwidth": record.bandwidth,
        "last_seen_s": max(0.0, time.time() - record.timestamp),
    }
    progress = record.progress
    if progress is not None:
        row.update(progress.as_dict())
    return row


def add_weight_views(rows: list[dict[str, Any]]) -> None:
    """Set each row's ``lowered_by`` (the other peers that published it among the peers whose
    weight they lowered, each with the weight and why) and ``weight``: the median over every
    other trainer's view, 1.0 where a trainer did not name it (None when nobody did), so that
    one peer's word cannot set it. Peers name each other by short id; a peer may only speak for
    itself, so a row naming itself is left out."""
    by_short = {r["short"]: r for r in rows}
    for r in rows:
        r["lowered_by"], r["weight"] = [], None
    for r in rows:
        for short, weight, why in r.get("lowered", ()):
            target = by_short.get(short)
            if target is not None and target is not r:
                target["lowered_by"].append({"by": r["short"], "weight": weight, "why": why})
    trainers = sum(r.get("role") == "trainer" for r in rows)
    for r in rows:
        if r["lowered_by"]:
            others = max(trainers - (r.get("role") == "trainer"), len(r["lowered_by"]))
            views = [v["weight"] for v in r["lowered_by"]]
            r["weight"] = statistics.median(views + [1.0] * (others - len(views)))


def totals(rows: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Swarm-wide figures: peers, trainers, samples/s, bandwidth, rounds, mean loss."""
    rows = list(rows)
    trainers = [r for r in rows if r.get("role") == "trainer"]
    losses = [r["loss"] for r in trainers if isinstance(r.get("loss"), float)]
    return {
        "peers": len(rows),
        "trainers": len(trainers),
        "samples_per_s": float(sum(r.get("samples_per_s", 0.0) for r in rows)),
        "bytes_in_per_s": float(sum(r.get("bytes_in_per_s", 0.0) for r in rows)),
        "bytes_out_per_s": float(sum(r.get("bytes_out_per_s", 0.0) for r in rows)),
        "max_round": max((r.get("round", 0) for r in rows), default=0),
        "mean_loss": sum(losses) / len(losses) if losses else None,
    }


_COLUMNS = (
    ("PEER", lambda r: r["short"]),
    ("ADDRESS", lambda r: r["address"]),
    ("ROLE", lambda r: r.get("role", "?")),
    ("ROUND", lambda r: str(r.get("round", ""))),
    ("STEP", lambda r: str(r.get("step", ""))),
    ("H", lambda r: str(r.get("inner_steps") or "-")),  # inner steps per round in use
    ("SAMPLES/S", lambda r: _num(r.get("samples_per_s"))),
    ("LOSS", lambda r: "" if r.get("loss") is None else f"{r['loss']:.4f}"),
    ("GROUP", lambda r: str(r.get("group_size", "")) if r.get("group_size") else "-"),
    ("IN/S", lambda r: _bytes(r.get("bytes_in_per_s"))),
    ("OUT/S", lambda r: _bytes(r.get("bytes_out_per_s"))),
    ("UTIL", lambda r: "" if "utilization" not in r else f"{r['utilization']:.0%}"),
    ("CODEC", lambda r: r.get("codec") or "-"),
    ("WEIGHT", lambda r: _weight(r)),
    ("REACH", lambda r: r.get("reachability", "?")),
    ("MACHINE", lambda r: _machine(r)),
    ("UP", lambda r: _duration(r.get("uptime_s"))),
    ("SEEN", lambda r: f"{r['last_seen_s']:.0f}s"),
)


def format_table(snapshot: dict[str, Any]) -> str:
    """The terminal table of ``swarm-peer status``: one line per peer, then the totals."""
    rows = [[name for name, _ in _COLUMNS]]
    rows += [[cell(r) for _, cell in _COLUMNS] for r in snapshot["peers"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    lines.append(summary_line(snapshot["totals"], snapshot["run_id"]))
    for r in snapshot["peers"]:
        for v in r.get("lowered_by", ()):
            lines.append(f"{r['short']}: weight x{v['weight']:.2f} in {v['by']}'s view: {v['why']}")
    return "\n".join(lines)


def summary_line(t: dict[str, Any], run_id: str) -> str:
    """One line of swarm-wide totals (also the periodic status line of ``swarm-peer``)."""
    loss = "" if t["mean_loss"] is None else f", mean loss {t['mean_loss']:.4f}"
    return (
        f"run {run_id!r}: {t['peers']} peer(s), {t['trainers']} training, round {t['max_round']}, "
        f"{_num(t['samples_per_s'])} samples/s, in {_bytes(t['bytes_in_per_s'])}/s, "
        f"out {_bytes(t['bytes_out_per_s'])}/s{loss}"
    )


def _num(value: Any) -> str:
    if not isinstance(value, float) or not math.isfinite(value):
        return ""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.1f}"


def _bytes(value: Any) -> str:
    if not isinstance(value, float):
        return ""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}B"


def _duration(value: Any) -> str:
    if not isinstance(value, float):
        return ""
    minutes, seconds = divmod(int(value), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


def _weight(row: dict[str, Any]) -> str:
    """``x0.05/3``: the median weight factor over the others' views, 3 of which lowered it;
    ``-``: none did."""
    views = row.get("lowered_by")
    return f"x{row['weight']:.2f}/{len(views)}" if views else "-"


def _machine(row: dict[str, Any]) -> str:
    res = row.get("resources")
    if not res:
        return row["device"]
    text = f"{res['cores']}c {res['ram'] / 2**30:.0f}GiB"
    if res["gpu"]:
        text += f" {res['gpu']} {res['gpu_memory'] / 2**30:.0f}GiB"
    return text
