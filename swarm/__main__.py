"""``swarm-peer`` and ``python -m swarm``: the CLI behind a guard that turns Ctrl-C or SIGTERM
into a quiet exit 0 at any moment, even while the library (torch, aiohttp) is still importing."""

from __future__ import annotations

import os
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


def _exit_quietly(signum: int, frame: object) -> None:
    # Nothing is open yet that the OS does not close for us; an exception raised here could
    # land anywhere in an import and leave the interpreter exiting by the signal instead.
    sys.stdout.flush()
    os._exit(0)


def _interrupt_on_termination() -> None:
    """Ctrl-C, SIGTERM (and Windows' Ctrl-Break) end the process with status 0 until the
    peer's loop installs its own handlers (which stop the peer cleanly). Ctrl-C is taken here
    too rather than left to KeyboardInterrupt, which a blocking call in a worker thread or a
    module's import can hold up for a long time."""
    for name in ("SIGINT", "SIGTERM", "SIGBREAK"):
        sig = getattr(signal, name, None)
        if sig is None:
            continue
        try:
            signal.signal(sig, _exit_quietly)
        except (OSError, ValueError):  # not the main thread, or not settable on this platform
            continue


if __name__ == "__main__":
    sys.exit(main())
