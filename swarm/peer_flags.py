"""The ``swarm-peer`` flag and the ``SWARM_*`` variable of every :class:`PeerConfig` field.

One table (:data:`SOURCES`) says, for each field, which flag and which environment variable set
it and how their text becomes the field's value. ``swarm-peer`` builds its options from it, and
``Swarm(...)`` reads the same variables (a training script started with ``SWARM_INITIAL_PEERS``
set joins like ``swarm-peer`` would), so a variable means the same thing everywhere.

Most fields take the generic form: ``--run-id`` / ``SWARM_RUN_ID`` for ``run_id``, the text
parsed by the field's type (:func:`swarm.options.parse_value`) and checked by the field's own
validation. A few keep units or forms people type more easily:

- ``--heartbeat SECONDS`` / ``SWARM_HEARTBEAT``: ``heartbeat_s``;
- ``--bandwidth MBIT_S`` / ``SWARM_BANDWIDTH``: ``bandwidth`` (bytes/s = Mbit/s x 125,000);
- ``--identity PATH`` / ``SWARM_IDENTITY``: ``identity_path``;
- ``--swarm-key PATH`` / ``SWARM_KEY_FILE`` (or the secret itself in ``SWARM_KEY``):
  ``membership``;
- ``--relay-budget PEERS[,MBIT]`` / ``SWARM_RELAY_BUDGET``: ``relay_slots`` and ``relay_rate``;
- ``--no-port-mapping`` / ``SWARM_NO_PORT_MAPPING=1``: ``port_mapping`` off.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarm.auth import MIN_SWARM_KEY_BYTES, Membership
from swarm.errors import ConfigError, SwarmError
from swarm.net.relay import RelayBudget
from swarm.options import parse_value, parser_of
from swarm.peer_config import PeerConfig

# fields checked against another: a flag alone is checked with that other field out of the way,
# and the whole config is checked once every flag is read
_ALONE: dict[str, dict[str, Any]] = {"record_ttl_s": {"heartbeat_s": 1e-9}}
SWARM_KEY_ENV = "SWARM_KEY"  # the key itself; SWARM_KEY_FILE names a file holding it
MBIT = 1e6 / 8  # bytes/s in one Mbit/s


@dataclass(frozen=True)
class FieldSource:
    """How one flag and its environment variable set fields of a :class:`PeerConfig`."""

    dest: str  # the flag's argparse destination
    flag: str  # "--heartbeat"
    env: str  # "SWARM_HEARTBEAT"
    fields: tuple[str, ...]  # the PeerConfig fields it sets
    convert: Callable[[str], Any]  # text -> the flag's value (raises ArgumentTypeError)
    to_fields: Callable[[Any], dict[str, Any]]  # the flag's value -> {field: value}
    default: Any  # the flag's value when neither flag nor variable is given
    help: str
    metavar: str | None = None
    nargs: str | None = None  # "*": the flag takes several values (the variable: space or comma)
    switch: bool = False  # a flag without a value: ``--x`` sets True
    shown: str | None = None  # how ``--help`` shows the default (None: as it is)

    def from_text(self, raw: str) -> Any:
        """The flag's value from a variable's text (several items: space or comma separated).

        Raises:
            argparse.ArgumentTypeError: the text is not a valid value.
        """
        if self.nargs:
            return [self.convert(item) for item in raw.replace(",", " ").split()]
        return self.convert(raw)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return value


def _mbits(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate in Mbit/s") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be 0 Mbit/s or more, got {text} Mbit/s")
    return value


def flag_value(text: str) -> bool:
    """1/0, true/false, yes/no, on/off."""
    try:
        return bool(parse_value(bool, text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not one of 1, 0, true, false, yes, no"
        ) from None


def _relay_budget(text: str) -> RelayBudget:
    try:
        return RelayBudget.parse(text)
    except SwarmError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _field_converter(name: str, hint: Any) -> Callable[[str], Any]:
    """Text -> a valid value of field ``name`` (one item of a tuple field): parsed by its type,
    checked by the config's own validation of that field."""
    several = parser_of(hint) == "tuple"

    def convert(text: str) -> Any:
        try:
            value = text.strip() if several else parse_value(hint, text)
            PeerConfig(**{name: (value,) if several else value}, **_ALONE.get(name, {}))
        except (ValueError, ConfigError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    return convert


def _generic(name: str, hint: Any, default: Any, doc: str) -> FieldSource:
    kind = parser_of(hint)
    return FieldSource(
        dest=name,
        flag="--" + name.replace("_", "-"),
        env="SWARM_" + name.upper(),
        fields=(name,),
        convert=_field_converter(name, hint),
        to_fields=lambda value, name=name, several=kind == "tuple": {
            name: tuple(value) if several and value is not None else value
        },
        default=list(default) if isinstance(default, tuple) else default,
        help=doc,
        metavar=_METAVARS.get(name, "HOST:PORT" if kind == "tuple" else name.upper()),
        nargs="*" if kind == "tuple" else None,
        switch=kind == "bool",
    )


def _special() -> list[FieldSource]:
    default = PeerConfig()
    return [
        FieldSource(
            "heartbeat",
            "--heartbeat",
            "SWARM_HEARTBEAT",
            ("heartbeat_s",),
            _seconds,
            lambda v: {"heartbeat_s": v},
            default.heartbeat_s,
            "re-announce period in seconds; a dead peer vanishes after 3 periods",
            metavar="SECONDS",
        ),
        FieldSource(
            "bandwidth",
            "--bandwidth",
            "SWARM_BANDWIDTH",
            ("bandwidth",),
            _mbits,
            lambda v: {"bandwidth": v * MBIT},
            default.bandwidth / MBIT,
            "upload rate in Mbit/s others may plan for; 0 = client-only, e.g. behind NAT",
            metavar="MBIT_S",
        ),
        FieldSource(
            "identity",
            "--identity",
            "SWARM_IDENTITY",
            ("identity_path",),
            str,
            lambda v: {"identity_path": v},
            None,
            "key file, created with mode 0600 when missing; without it the peer uses a "
            "throwaway key",
            metavar="PATH",
        ),
        FieldSource(
            "swarm_key",
            "--swarm-key",
            "SWARM_KEY_FILE",
            ("membership",),
            str,
            lambda v: {"membership": load_membership(v)},
            None,
            "file holding the swarm's shared secret, at least 16 bytes (or the secret itself "
            "in SWARM_KEY); peers without it are refused",
            metavar="PATH",
        ),
        FieldSource(
            "relay_budget",
            "--relay-budget",
            "SWARM_RELAY_BUDGET",
            ("relay_slots", "relay_rate"),
            _relay_budget,
            lambda v: {"relay_slots": v.peers, "relay_rate": v.rate},
            RelayBudget(peers=default.relay_slots, rate=default.relay_rate),
            "when reachable, relay for up to PEERS unreachable peers sharing MBIT Mbit/s each "
            "way; 0 turns relaying off",
            metavar="PEERS[,MBIT]",
            shown=f"{default.relay_slots},{default.relay_rate / MBIT:g}",
        ),
        FieldSource(
            "no_port_mapping",
            "--no-port-mapping",
            "SWARM_NO_PORT_MAPPING",
            ("port_mapping",),
            flag_value,
            lambda v: {"port_mapping": not v},
            not default.port_mapping,
            "do not ask the home router (UPnP-IGD, PCP, NAT-PMP) to forward our port",
            switch=True,
        ),
    ]


_METAVARS = {
    "run_id": "NAME",
    "listen": "HOST:PORT",
    "announce": "HOST:PORT",
    "record_ttl_s": "SECONDS",
    "dht_request_timeout_s": "SECONDS",
    "device": "TEXT",
    "reachability": "{auto,direct}",
}
_DOCS = {
    "run_id": "name of the training run",
    "listen": "address to bind; one port number serves UDP (DHT) and TCP (HTTP), so forward "
    "that one port; port 0 picks a free one",
    "announce": "address others dial, e.g. your router's public address with a forwarded "
    "port (default: the bound address)",
    "initial_peers": "live peers to join through; none starts a new swarm",
    "record_ttl_s": "seconds the peer's record lives (default: 3 heartbeats)",
    "device": "what the peer shows others it trains on",
    "dht_request_timeout_s": "longest wait for a DHT answer, in seconds",
    "metrics": "serve Prometheus metrics at http://HOST:PORT/metrics on the peer's port, "
    "readable by anyone who reaches the port",
    "relay_peers": "the only peers (HOST:PORT) that may relay for us when others cannot dial "
    "us; none given: any reachable peer",
    "reachability": "auto: map the port, learn by dial-back, use a relay when undialable; "
    "direct: announce the address as it is",
}


def _sources() -> list[FieldSource]:
    special = _special()
    covered = {f for s in special for f in s.fields}
    hints = typing.get_type_hints(PeerConfig)
    default = PeerConfig()
    generic = [
        _generic(f.name, hints[f.name], getattr(default, f.name), _DOCS.get(f.name, ""))
        for f in dataclasses.fields(PeerConfig)
        if f.name not in covered
    ]
    return generic + special


SOURCES: tuple[FieldSource, ...] = tuple(_sources())


def check_sources() -> None:
    """Raise ConfigError unless every PeerConfig field has exactly one source."""
    fields = [f for s in SOURCES for f in s.fields]
    names = [f.name for f in dataclasses.fields(PeerConfig)]
    if sorted(fields) != sorted(names):
        raise ConfigError(f"flags cover {sorted(fields)}, PeerConfig has {sorted(names)}")


def environment_fields(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """PeerConfig fields that ``SWARM_*`` variables set (the swarm key's included).

    Raises:
        ConfigError: a variable's value is invalid (the message names the variable).
    """
    environ = os.environ if environ is None else environ
    found: dict[str, Any] = {}
    for source in SOURCES:
        raw = environ.get(source.env, "").strip()
        if source.dest == "swarm_key" and not raw and environ.get(SWARM_KEY_ENV, "").strip():
            found.update(membership=load_membership(None, environ=environ))
            continue
        if not raw:
            continue
        try:
            value = source.from_text(raw)
        except argparse.ArgumentTypeError as e:
            raise ConfigError(f"environment variable {source.env}={raw!r}: {e}") from None
        found.update(source.to_fields(value))
    return found


def load_membership(
    swarm_key_file: str | None,
    source: str = "--swarm-key",
    environ: Mapping[str, str] | None = None,
) -> Membership:
    """The swarm key from a file, or the secret itself from ``SWARM_KEY``; else an open swarm.

    Args:
        swarm_key_file: path of a file holding the key (``--swarm-key`` / ``SWARM_KEY_FILE``).
        source: how the path was given, for error messages.
        environ: the environment to read ``SWARM_KEY`` from (default: the process's).

    Raises:
        ConfigError: the file is unreadable or the key too short; ``SWARM_KEY`` holds the path
            of an existing file (a path there would silently become the secret itself).
    """
    environ = os.environ if environ is None else environ
    if swarm_key_file:
        try:
            key = Path(swarm_key_file).expanduser().read_bytes().strip()
        except OSError as e:
            raise ConfigError(
                f"{source}: cannot read the swarm key file {swarm_key_file}: {e.strerror or e}"
            ) from e
        if len(key) < MIN_SWARM_KEY_BYTES:
            raise ConfigError(
                f"{source}: the swarm key in {swarm_key_file} is {len(key)} bytes long; "
                f"use at least {MIN_SWARM_KEY_BYTES}"
            )
        return Membership.with_key(key)
    raw = environ.get(SWARM_KEY_ENV, "").strip()
    if not raw:
        return Membership.open()
    if _names_a_file(raw):
        raise ConfigError(
            f"environment variable {SWARM_KEY_ENV} holds the path of an existing file ({raw}), "
            "but it takes the secret itself; give the path in SWARM_KEY_FILE or --swarm-key"
        )
    if len(raw.encode()) < MIN_SWARM_KEY_BYTES:
        raise ConfigError(
            f"environment variable {SWARM_KEY_ENV} holds a key of {len(raw.encode())} bytes; "
            f"use at least {MIN_SWARM_KEY_BYTES}"
        )
    return Membership.with_key(raw)


def _names_a_file(text: str) -> bool:
    try:
        return Path(text).expanduser().is_file()
    except (OSError, ValueError, RuntimeError):  # too long, NUL byte, unknown ~user
        return False
