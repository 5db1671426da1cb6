"""CPU seconds of a benchmark process per thread: its event loop's (the main thread's) against
all the others' (a round's worker threads), from ``/proc/self/task`` on Linux; elsewhere none.

Which of the two bounds a round tells where to cut: a round whose loop is busiest waits on
sockets, the AEAD and copies; one whose workers are waits on the tensor work.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def thread_cpu_s() -> dict[int, float] | None:
    """Native thread id -> its CPU seconds (user + system) so far, in clock ticks (10 ms on
    most Linux systems: time a few rounds); None without /proc."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0
    tasks = Path("/proc/self/task")
    if not tick or not tasks.is_dir():
        return None
    out = {}
    for task in tasks.iterdir():
        try:
            # the fields after the command name, which may hold spaces and parentheses
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # a thread that ended meanwhile
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


class LoopAndWorkers:
    """The CPU seconds of the main thread and of all other threads between :meth:`start` and
    :meth:`usage` (threads that ended meanwhile are not counted)."""

    def __init__(self) -> None:
        self._start: dict[int, float] | None = None

    def start(self) -> None:
        self._start = thread_cpu_s()

    def usage(self, rounds: int) -> dict[str, float | None]:
        """``loop_cpu_s_per_round`` and ``worker_cpu_s_per_round`` (None where unknown)."""
        now = thread_cpu_s()
        if self._start is None or now is None:
            return {"loop_cpu_s_per_round": None, "worker_cpu_s_per_round": None}
        main = threading.main_thread().native_id
        spent = {tid: s - self._start.get(tid, 0.0) for tid, s in now.items()}
        loop = spent.pop(main, 0.0)
        rounds = max(rounds, 1)
        return {
            "loop_cpu_s_per_round": loop / rounds,
            "worker_cpu_s_per_round": sum(spent.values()) / rounds,
        }
