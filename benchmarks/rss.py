"""What a benchmark process holds in memory: its peak resident set and, per round, the growth
within it (Linux ``VmHWM`` after ``clear_refs``; elsewhere only the peak)."""

from __future__ import annotations

import contextlib
import ctypes
import math
import sys

try:
    import resource
except ImportError:  # Windows
    resource = None


def peak_rss_mb() -> float:
    """This process's peak resident set so far, in MiB; NaN where unknown (Windows)."""
    if resource is None:
        return math.nan
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # macOS: bytes, Linux: KiB
    return peak / (2**20 if sys.platform == "darwin" else 2**10)


def proc_status_mb(field: str) -> float | None:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak since the last reset) of this process, in
    MiB; None where /proc is not there (macOS, Windows)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Start ``VmHWM`` again from the resident set now (Linux 4.0+: ``clear_refs`` 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def give_back_free_pages() -> None:
    """glibc's ``malloc_trim(0)``: the free pages of the C heap go back to the OS, so that the
    resident set counts live memory only (glibc keeps a round's freed pages for the next)."""
    if sys.platform.startswith("linux"):
        # musl and others have none (and need none)
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).malloc_trim(0)


class RoundMemory:
    """Per timed round: the resident set before it (live memory: free heap pages given back
    first) and its peak during it (Linux)."""

    def __init__(self) -> None:
        self.first_rss = proc_status_mb("VmRSS")  # before the first round, warm-up included
        self.rounds: list[tuple[float, float]] = []  # (rss before, peak during), MiB
        self._before: float | None = None

    def start(self) -> None:
        give_back_free_pages()
        self._before = proc_status_mb("VmRSS")
        if not reset_peak_rss():
            self._before = None

    def end(self) -> None:
        peak = proc_status_mb("VmHWM")
        if self._before is not None and peak is not None:
            self.rounds.append((self._before, peak))

    def usage(self) -> dict:
        last = proc_status_mb("VmRSS")
        kept = last - self.first_rss if last is not None and self.first_rss is not None else None
        transient = max((peak - before for before, peak in self.rounds), default=None)
        return {"kept_mb": kept, "transient_mb": transient}
