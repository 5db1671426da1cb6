"""``swarm-peer status`` and ``swarm-peer dashboard``, and the periodic status line of a peer."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import Any

from swarm.address import PeerAddress
from swarm.auth import Membership
from swarm.dashboard.status import RunReader, format_table, peer_row, summary_line, totals
from swarm.dashboard.web import Dashboard
from swarm.errors import SwarmError
from swarm.identity import Identity
from swarm.protocols import Peer

logger = logging.getLogger("swarm.cli")

_CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen (ANSI; Windows 10+ terminals too)


def add_monitor_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """The ``status`` and ``dashboard`` subcommands of ``swarm-peer``."""
    status = sub.add_parser(
        "status",
        parents=[common],
        help="live table of every peer of a run (progress, bandwidth, machine)",
        description="Show every peer of a run: round, step, samples/s, loss, group, bandwidth, "
        "utilization, machine; with swarm-wide totals. Refreshes until Ctrl-C.",
    )
    status.add_argument("--once", action="store_true", help="print one snapshot and exit")
    status.add_argument("--json", action="store_true", help="print JSON (one object per line)")
    status.add_argument(
        "--interval", type=float, default=2.0, metavar="SECONDS", help="refresh period"
    )
    dashboard = sub.add_parser(
        "dashboard",
        parents=[common],
        help="serve a live web page of the run",
        description="Serve one self-contained web page (no internet needed) with the peers of "
        "a run, loss and samples/s over time and the groups of the last rounds.",
    )
    dashboard.add_argument(
        "--http",
        default="127.0.0.1:8080",
        metavar="HOST:PORT",
        help="where to serve the page (default %(default)s: this machine only; the page has "
        "no login, so think before exposing it)",
    )
    dashboard.add_argument(
        "--interval", type=float, default=2.0, metavar="SECONDS", help="DHT read period"
    )


def _reader(args: argparse.Namespace, membership: Membership) -> RunReader:
    if not args.initial_peers:
        raise SwarmError(f"swarm-peer {args.command}: give --initial-peers HOST:PORT of a peer")
    listen = PeerAddress.parse(args.listen)
    return RunReader(
        args.initial_peers,
        args.run_id,
        membership=membership,
        identity=Identity.load_or_create(args.identity) if args.identity else None,
        listen_host=listen.host or "0.0.0.0",
    )


async def run_status(args: argparse.Namespace, membership: Membership) -> int:
    """``swarm-peer status``: print the run's peers, once or until cancelled."""
    live = not args.once and not args.json and sys.stdout.isatty()
    async with _reader(args, membership) as reader:
        while True:
            snapshot = await reader.snapshot()
            if not snapshot["peers"]:
                snapshot["hint"] = await reader.hint()
            if args.json:
                print(json.dumps(snapshot), flush=True)
            else:
                text = format_table(snapshot)
                print((_CLEAR if live else "") + text + "\n", flush=True)
                if "hint" in snapshot:
                    print(snapshot["hint"], file=sys.stderr, flush=True)
            if args.once:
                return 0
            await asyncio.sleep(args.interval)


async def run_dashboard(
    args: argparse.Namespace, membership: Membership, stop: asyncio.Event
) -> int:
    """``swarm-peer dashboard``: serve the page until ``stop`` is set."""
    async with (
        _reader(args, membership) as reader,
        Dashboard(reader, interval=args.interval) as dashboard,
    ):
        address = await dashboard.serve(PeerAddress.parse(args.http))
        print(f"dashboard of run {args.run_id!r} at http://{address}/", flush=True)
        await stop.wait()
    return 0


async def log_status_every(peer: Peer, interval: float) -> None:
    """Log one line of swarm-wide totals every ``interval`` seconds (0: never)."""
    if not interval > 0:
        return
    while True:
        await asyncio.sleep(interval)
        try:
            records = await peer.known_peers()
        except SwarmError as e:
            logger.warning("status: cannot read the run's records: %s", e)
            continue
        rows = [peer_row(r) for r in records.values()]
        logger.info("status: %s", summary_line(totals(rows), peer.run_id))
