"""Argument types the benchmarks' command lines share."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``low``, else a one-line usage error."""

    def integer(text: str) -> int:
        value = int(text)  # argparse turns a ValueError into "invalid integer value"
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return integer
