"""``swarm-peer``: run a helper peer, or list the peers of a run.

    swarm-peer                                   start a new swarm; prints the --initial-peers value
    swarm-peer --initial-peers HOST:PORT         join a swarm
    swarm-peer peers --initial-peers HOST:PORT   list the peers announced in a run

Every flag can also be set through an environment variable (``SWARM_LISTEN``,
``SWARM_INITIAL_PEERS``, ...); a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from swarm.address import PeerAddress
from swarm.auth import Membership
from swarm.config import DEFAULT_LISTEN, PeerConfig
from swarm.dht import DHTNode
from swarm.errors import SwarmError
from swarm.identity import Identity
from swarm.net.reachability import reach_of
from swarm.net.record import PeerRecord
from swarm.net.relay import RelayBudget
from swarm.peer import Peer, fetch_peer_records
from swarm.version import __version__

logger = logging.getLogger("swarm.cli")

SWARM_KEY_ENV = "SWARM_KEY"  # the key itself; SWARM_KEY_FILE names a file holding it


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"SWARM_{name}", default)


def _env_list(name: str) -> list[str]:
    value = _env(name)
    return value.replace(",", " ").split() if value else []


def _relay_budget(text: str) -> RelayBudget:
    try:
        return RelayBudget.parse(text)
    except SwarmError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--initial-peers",
        nargs="+",
        default=_env_list("INITIAL_PEERS"),
        metavar="HOST:PORT",
        help="live peers to join through (env SWARM_INITIAL_PEERS, space separated); "
        "none starts a new swarm",
    )
    common.add_argument(
        "--listen",
        default=_env("LISTEN", DEFAULT_LISTEN),
        metavar="HOST:PORT",
        help="address to bind; one port number serves UDP (DHT) and TCP (HTTP); port 0 picks "
        "a free one (env SWARM_LISTEN, default %(default)s)",
    )
    common.add_argument(
        "--identity",
        default=_env("IDENTITY"),
        metavar="PATH",
        help="key file, created with mode 0600 when missing (env SWARM_IDENTITY); "
        "without it the peer uses a throwaway key",
    )
    common.add_argument(
        "--swarm-key",
        default=_env("KEY_FILE"),
        metavar="FILE",
        help="file holding the swarm's shared secret (env SWARM_KEY_FILE, or the key itself "
        "in SWARM_KEY); peers without it are refused",
    )
    common.add_argument(
        "--run-id",
        default=_env("RUN_ID", "default"),
        help="name of the training run (env SWARM_RUN_ID, default %(default)s)",
    )
    common.add_argument(
        "--log-level",
        default=_env("LOG_LEVEL", "INFO"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help="(env SWARM_LOG_LEVEL, default %(default)s)",
    )

    parser = argparse.ArgumentParser(
        prog="swarm-peer",
        description="Run a swarm peer that keeps DHT records and helps others find each other.",
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"swarm {__version__}")
    parser.add_argument(
        "--announce",
        default=_env("ANNOUNCE"),
        metavar="HOST:PORT",
        help="address others dial, e.g. your router's public address with a forwarded port "
        "(env SWARM_ANNOUNCE; default: the bound address)",
    )
    parser.add_argument(
        "--heartbeat",
        type=float,
        default=_env("HEARTBEAT", "10"),  # argparse applies type=float: a clear error
        metavar="SECONDS",
        help="re-announce period; a dead peer vanishes after 3 periods "
        "(env SWARM_HEARTBEAT, default %(default)s)",
    )
    parser.add_argument(
        "--bandwidth",
        type=float,
        default=_env("BANDWIDTH", "100"),
        metavar="MBIT",
        help="upload rate in Mbit/s others may plan for; 0 = client-only, e.g. behind NAT "
        "(env SWARM_BANDWIDTH, default %(default)s)",
    )
    parser.add_argument(
        "--no-port-mapping",
        action="store_true",
        default=_env("NO_PORT_MAPPING", "") not in ("", "0"),
        help="do not ask the home router (UPnP-IGD, NAT-PMP) to forward our port "
        "(env SWARM_NO_PORT_MAPPING=1)",
    )
    parser.add_argument(
        "--relay-budget",
        type=_relay_budget,
        default=_env("RELAY_BUDGET", "4,100"),
        metavar="PEERS[,MBIT]",
        help="when reachable, relay for up to PEERS unreachable peers sharing MBIT Mbit/s "
        "each way; "
        "0 turns relaying off (env SWARM_RELAY_BUDGET, default %(default)s)",
    )
    sub = parser.add_subparsers(dest="command")
    sub.add_parser(
        "peers",
        parents=[common],
        help="list the peers announced in a run",
        description="List the peers announced in a run (id, address, how others reach it: "
        "direct / mapped / relayed / client, device, last seen).",
    )
    return parser


def load_membership(swarm_key_file: str | None) -> Membership:
    """The swarm key from a file or the SWARM_KEY variable; an open swarm without either."""
    if swarm_key_file:
        try:
            key = Path(swarm_key_file).expanduser().read_bytes().strip()
        except OSError as e:
            raise SwarmError(f"cannot read the swarm key file {swarm_key_file}: {e}") from e
        return Membership.with_key(key)
    if os.environ.get(SWARM_KEY_ENV):
        return Membership.with_key(os.environ[SWARM_KEY_ENV])
    return Membership.open()


async def run_peer(args: argparse.Namespace) -> int:
    budget = args.relay_budget
    config = PeerConfig(
        port_mapping=not args.no_port_mapping,
        relay_peers=budget.peers,
        relay_rate=budget.rate,
        run_id=args.run_id,
        listen=args.listen,
        announce=args.announce,
        initial_peers=tuple(args.initial_peers),
        identity_path=args.identity,
        membership=load_membership(args.swarm_key),
        bandwidth=args.bandwidth * 1e6 / 8,
        heartbeat_s=args.heartbeat,
    )
    stop = asyncio.Event()
    _install_stop_handlers(stop)
    async with Peer(config) as peer:
        print(f"peer {peer.peer_id} ({peer.peer_id.short}) is up", flush=True)
        if config.initial_peers:
            print(f"joined run {config.run_id!r} through {' '.join(config.initial_peers)}")
        else:
            print(f"started a new swarm, run {config.run_id!r}")
        print(f"others join with: --initial-peers {peer.address}", flush=True)
        await stop.wait()
        logger.info("stopping")
    return 0


def _install_stop_handlers(stop: asyncio.Event) -> None:
    """Ctrl-C and SIGTERM set ``stop``; on Windows, where loops lack signal handlers, too."""
    loop = asyncio.get_running_loop()
    for name in ("SIGINT", "SIGTERM", "SIGBREAK"):
        sig = getattr(signal, name, None)
        if sig is None:
            continue
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            signal.signal(sig, lambda *_: loop.call_soon_threadsafe(stop.set))


async def list_peers(args: argparse.Namespace) -> int:
    if not args.initial_peers:
        print("swarm-peer peers: give --initial-peers HOST:PORT of a live peer", file=sys.stderr)
        return 2
    identity = Identity.load_or_create(args.identity) if args.identity else Identity.generate()
    listen = PeerAddress.parse(args.listen)
    dht = await DHTNode.create(
        identity,
        load_membership(args.swarm_key),
        host=listen.host or "0.0.0.0",
        port=0,
        client=True,
    )
    try:
        if await dht.bootstrap(args.initial_peers) == 0:
            raise SwarmError("no initial peer answered: " + " ".join(args.initial_peers))
        records = await fetch_peer_records(dht, args.run_id)
    finally:
        await dht.close()
    print(format_peer_table(records.values()))
    return 0


def format_peer_table(records: Sequence[PeerRecord] | object) -> str:
    rows = [("PEER", "ADDRESS", "REACHABLE", "DEVICE", "LAST SEEN")]
    now = time.time()
    for record in sorted(records, key=lambda r: str(r.address)):  # type: ignore[attr-defined]
        rows.append(
            (
                record.peer_id.short,
                str(record.address),
                reach_of(record).value,
                record.device,
                f"{max(0.0, now - record.timestamp):.0f}s ago",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines.append(f"{len(rows) - 1} peer(s)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    command = list_peers if args.command == "peers" else run_peer
    try:
        return asyncio.run(command(args))
    except SwarmError as e:
        print(f"swarm-peer: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
