"""What ``inner_steps`` may be: a count of steps, ``"auto"``, or a duration on the wall clock.

Parsed here, below both the config that checks it and the cadence that follows it
(:mod:`swarm.training.cadence` says what each form does).
"""

from __future__ import annotations

import math
import re

_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*s")


def round_period(inner_steps: int | str) -> float | None:
    """Seconds between rounds when ``inner_steps`` is a duration (``"30s"``), else None."""
    if not isinstance(inner_steps, str):
        return None
    match = _DURATION.fullmatch(inner_steps.strip())
    return float(match.group(1)) if match else None


def parse_inner_steps(value: object, fragments: int, lowest: object, highest: object) -> int | str:
    """``inner_steps`` checked: a positive multiple of ``fragments``, ``"auto"`` (with a valid
    range ``lowest..highest``) or a positive duration such as ``"30s"``.

    Raises:
        ValueError: with what is wrong.
    """
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if value == "auto":
        if not isinstance(lowest, int) or not isinstance(highest, int):
            raise ValueError("min_inner_steps and max_inner_steps must be integers")
        if not 1 <= lowest <= highest:
            raise ValueError("need 1 <= min_inner_steps <= max_inner_steps")
        if highest < fragments:
            raise ValueError("max_inner_steps must be at least fragments")
        return value
    period = round_period(value) if isinstance(value, str) else None
    if period is not None:
        if not 0 < period < math.inf:
            raise ValueError(f"inner_steps {value!r}: a round period must be positive")
        return "".join(value.split())  # as given, so that it parses again the same
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"inner_steps must be an integer >= 1, 'auto' or seconds such as '30s', not {value!r}"
        )
    if value % fragments:
        raise ValueError(
            f"inner_steps ({value}) must be a multiple of fragments ({fragments}): a "
            "fragment's round comes every inner_steps / fragments steps"
        )
    return value
