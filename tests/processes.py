"""Child processes for tests: output lines collected by a thread, waits on patterns."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment with unbuffered output and the checkout importable."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **(extra or {})}


class OutputProcess:
    """A child process whose stdout and stderr lines are collected as they come."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None):
        self.proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=child_env(env),
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str | re.Pattern[str], timeout: float = 60.0) -> re.Match[str]:
        """The first output line matching ``pattern``; AssertionError with the output if none
        comes within ``timeout`` or the process ends first."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := regex.search(line):
                    return m
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"{regex.pattern!r} not seen; output:\n" + self.output())

    def output(self) -> str:
        return "\n".join(self.lines)

    def rounds(self) -> list[dict]:
        """The JSON of every ``ROUND {...}`` line."""
        return [json.loads(line[6:]) for line in list(self.lines) if line.startswith("ROUND ")]

    def kill(self) -> None:
        """SIGKILL (TerminateProcess on Windows) unless already ended; then reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._reader.join(timeout=5)
