"""``swarm-peer`` and ``python -m swarm``: the CLI behind a guard that turns Ctrl-C or SIGTERM
into a quiet exit 0 at any moment, even while the library (torch, aiohttp) is still importing."""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    _interrupt_on_termination()
    try:
        from swarm.cli import main as cli_main

        return cli_main(argv)
    except KeyboardInterrupt:
        return 0


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _interrupt_on_termination() -> None:
    """SIGTERM (and Windows' Ctrl-Break) act like Ctrl-C until the peer's loop takes over."""
    for name in ("SIGTERM", "SIGBREAK"):
        sig = getattr(signal, name, None)
        if sig is None:
            continue
        try:
            signal.signal(sig, _raise_interrupt)
        except (OSError, ValueError):  # not the main thread, or not settable on this platform
            continue


if __name__ == "__main__":
    sys.exit(main())
