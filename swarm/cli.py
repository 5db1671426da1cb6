"""``swarm-peer``: run a helper peer, or list the peers of a run.

    swarm-peer                                   start a new swarm; prints the --initial-peers value
    swarm-peer --initial-peers HOST:PORT         join a swarm
    swarm-peer peers --initial-peers HOST:PORT   list the peers announced in a run
    swarm-peer status --initial-peers HOST:PORT  live table of every peer's progress
    swarm-peer dashboard --initial-peers HOST:PORT  the same as a web page
    swarm-peer export CHECKPOINT OUT.safetensors the model of a checkpoint as a plain state dict

Every flag can also be set through an environment variable (``SWARM_LISTEN``,
``SWARM_INITIAL_PEERS``, ...); a flag given on the command line wins, and an error in a variable
names the variable. The peer listens on port 31415 (UDP and TCP) unless ``--listen`` says
otherwise: forward that one port on a router. Usage errors exit with status 2, failures with 1;
Ctrl-C or SIGTERM stops the peer at any moment (also while joining) with status 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from swarm.address import PeerAddress
from swarm.auth import Membership
from swarm.dashboard.commands import (
    add_monitor_commands,
    log_status_every,
    run_dashboard,
    run_status,
)
from swarm.dht import DHTNode
from swarm.errors import ConfigError, SwarmError
from swarm.identity import Identity
from swarm.net.reachability import reach_of
from swarm.net.record import PeerRecord
from swarm.peer import Peer, fetch_peer_records
from swarm.peer_config import PeerConfig
from swarm.peer_flags import SOURCES, FieldSource, load_membership
from swarm.version import __version__

logger = logging.getLogger("swarm.cli")

DEFAULT_PORT = 31415  # fixed, so a router can forward it; --listen HOST:0 picks a free one
DEFAULT_LISTEN = f"0.0.0.0:{DEFAULT_PORT}"
_STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGBREAK")  # those that exist on this platform


def _interval(text: str) -> float:
    """Seconds between periodic actions; 0 turns them off."""
    try:
        if float(text) == 0:
            return 0.0
    except ValueError:
        pass  # the seconds check says what is wrong with it
    return _positive(text)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return value


def _log_level(text: str) -> str:
    if text.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise argparse.ArgumentTypeError(f"{text!r} is not one of DEBUG, INFO, WARNING, ERROR")
    return text.upper()


# the options of every command (the others are the peer's own)
COMMON = ("initial_peers", "listen", "identity", "swarm_key", "run_id")
CLI_DEFAULTS = {"listen": DEFAULT_LISTEN}  # a helper peer listens on the fixed port
# options of swarm-peer itself, not of a PeerConfig: dest -> (variable, converter, default)
OWN_OPTIONS: dict[str, tuple[str, Any, Any]] = {
    "log_level": ("SWARM_LOG_LEVEL", _log_level, "INFO"),
    "status_interval": ("SWARM_STATUS_INTERVAL", _interval, 60.0),
}


def apply_environment(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill the options not given on the command line from ``SWARM_*``, then the defaults."""
    sources: dict[str, str] = {}
    options = [
        (s.dest, s.env, s.from_text, CLI_DEFAULTS.get(s.dest, s.default)) for s in SOURCES
    ] + [(dest, var, convert, default) for dest, (var, convert, default) in OWN_OPTIONS.items()]
    for dest, var, convert, default in options:
        if dest not in vars(args) or getattr(args, dest) is not None:
            continue
        raw = os.environ.get(var, "").strip()
        if not raw:
            setattr(args, dest, default)
            continue
        try:
            setattr(args, dest, convert(raw))
        except argparse.ArgumentTypeError as e:
            parser.error(f"environment variable {var}={raw!r}: {e}")
        sources[dest] = var
    args.from_env = sources


def _add_source(parser: argparse.ArgumentParser, source: FieldSource) -> None:
    default = CLI_DEFAULTS.get(source.dest, source.shown or source.default)
    shown = "" if default in (None, [], False) else f", default {default}"
    help_text = f"{source.help} (env {source.env}{shown})"
    if source.switch:
        action: Any = (
            "store_true" if source.dest.startswith("no_") else (argparse.BooleanOptionalAction)
        )
        parser.add_argument(
            source.flag, dest=source.dest, action=action, default=None, help=help_text
        )
        return
    parser.add_argument(
        source.flag,
        dest=source.dest,
        type=source.convert,
        nargs=source.nargs,
        metavar=source.metavar,
        help=help_text,
    )


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    peer_flags = [source for source in SOURCES if source.dest not in COMMON]
    for source in SOURCES:
        if source.dest in COMMON:
            _add_source(common, source)
    common.add_argument(
        "--log-level",
        type=_log_level,
        metavar="{DEBUG,INFO,WARNING,ERROR}",
        help="(env SWARM_LOG_LEVEL, default INFO)",
    )
    parser = argparse.ArgumentParser(
        prog="swarm-peer",
        description="Run a swarm peer that keeps DHT records and helps others find each other.",
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"swarm {__version__}")
    for source in peer_flags:
        _add_source(parser, source)
    parser.add_argument(
        "--status-interval",
        type=_interval,
        metavar="SECONDS",
        help="log a one-line status of the run this often; 0 = never "
        "(env SWARM_STATUS_INTERVAL, default 60)",
    )
    sub = parser.add_subparsers(dest="command")
    sub.add_parser(
        "peers",
        parents=[common],
        help="list the peers announced in a run",
        description="List the peers announced in a run (id, address, how others reach it: "
        "direct / mapped / relayed / client, device, last seen).",
    )
    add_monitor_commands(sub, common)
    export = sub.add_parser(
        "export",
        help="write a checkpoint's model as a plain safetensors state dict",
        description="Write the model of a swarm checkpoint as a plain safetensors state dict, "
        "for model.load_state_dict(safetensors.torch.load_file(OUT)).",
    )
    export.add_argument("checkpoint", metavar="CHECKPOINT", help="a file written by Swarm.save")
    export.add_argument("out", metavar="OUT", help="the .safetensors file to write")
    return parser


def export_checkpoint(args: argparse.Namespace) -> int:
    from swarm.training.checkpoint import export_model  # imports torch: only when asked

    count = export_model(args.checkpoint, args.out)
    print(f"wrote {count} tensors of the model to {args.out}")
    return 0


def describe_membership(membership: Membership) -> str:
    """One line to compare across machines: the swarm key's public fingerprint, or 'open'."""
    if membership.mode != "key":
        return f"membership: {membership.mode} swarm (no swarm key)"
    tag = membership.key_fingerprint.hex()
    groups = "-".join(tag[i : i + 4] for i in range(0, len(tag), 4))
    return f"swarm key fingerprint {groups} (must be the same on every peer of this swarm)"


def peer_config(args: argparse.Namespace) -> PeerConfig:
    """The PeerConfig the parsed flags and variables describe (one source per field)."""
    fields: dict[str, Any] = {}
    for source in SOURCES:
        value = getattr(args, source.dest)
        if source.dest == "swarm_key":  # errors name where the path came from
            where = _source(args, "swarm_key", "--swarm-key")
            fields["membership"] = load_membership(value, where)
        else:
            fields.update(source.to_fields(value))
    return PeerConfig(**fields)


async def run_peer(args: argparse.Namespace) -> int:
    config = peer_config(args)
    print(describe_membership(config.membership), flush=True)
    stop = asyncio.Event()
    _install_stop_handlers(stop)
    if config.initial_peers:
        print(f"joining run {config.run_id!r} through {' '.join(config.initial_peers)}", flush=True)
    # The join runs as a task, so Ctrl-C or SIGTERM ends it at once instead of after its timeout.
    starting = asyncio.create_task(Peer.start(config))
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)  # the peer closes itself
            print("stopped before the peer was up", flush=True)
            return 0
        peer = starting.result()  # raises if the join failed
        try:
            print(f"peer {peer.peer_id} ({peer.peer_id.short}) is up", flush=True)
            if config.initial_peers:
                print(f"joined run {config.run_id!r} through {' '.join(config.initial_peers)}")
            else:
                print(f"started a new swarm, run {config.run_id!r}")
            print(
                f"offering {args.bandwidth:g} Mbit/s upload, re-announcing every "
                f"{args.heartbeat:g} s",
                flush=True,
            )
            print(f"others join with: --initial-peers {peer.address}", flush=True)
            if config.metrics:
                print(f"metrics at http://{peer.address}/metrics", flush=True)
            status = asyncio.create_task(log_status_every(peer, args.status_interval))
            await stop.wait()
            status.cancel()
            await asyncio.gather(status, return_exceptions=True)
            logger.info("stopping")
        finally:
            await peer.close()
    finally:
        stopping.cancel()
    return 0


def _source(args: argparse.Namespace, dest: str, flag: str) -> str:
    """The flag or environment variable an option's value came from."""
    var = getattr(args, "from_env", {}).get(dest)
    return f"environment variable {var}" if var else flag


def _install_stop_handlers(stop: asyncio.Event) -> None:
    """Ctrl-C and SIGTERM set ``stop``; on Windows, where loops lack signal handlers, too."""
    loop = asyncio.get_running_loop()
    for name in _STOP_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is None:
            continue
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            try:
                signal.signal(sig, lambda *_: loop.call_soon_threadsafe(stop.set))
            except (OSError, ValueError):  # not settable on this platform
                continue


async def show_status(args: argparse.Namespace) -> int:
    return await run_status(args, load_membership(args.swarm_key))


async def serve_dashboard(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    _install_stop_handlers(stop)
    return await run_dashboard(args, load_membership(args.swarm_key), stop)


async def list_peers(args: argparse.Namespace) -> int:
    if not args.initial_peers:
        print("swarm-peer peers: give --initial-peers HOST:PORT of a live peer", file=sys.stderr)
        return 2
    identity = Identity.load_or_create(args.identity) if args.identity else Identity.generate()
    listen = PeerAddress.parse(args.listen)
    dht = await DHTNode.create(
        identity,
        load_membership(args.swarm_key, _source(args, "swarm_key", "--swarm-key")),
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
    """Run the CLI; returns the exit status (2 for a usage error, 1 for a failure)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "export":
        logging.basicConfig(level="WARNING")
    else:
        apply_environment(parser, args)
        logging.basicConfig(
            level=args.log_level,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            datefmt="%H:%M:%S",
        )
    commands = {"peers": list_peers, "status": show_status, "dashboard": serve_dashboard}
    command = commands.get(args.command, run_peer)
    try:
        if args.command == "export":
            return export_checkpoint(args)
        return asyncio.run(command(args))
    except ConfigError as e:
        print(f"swarm-peer: error: {e}", file=sys.stderr)
        return 2
    except SwarmError as e:
        print(f"swarm-peer: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())  # `python -m swarm` is the guarded entry point (quiet Ctrl-C during import)
