"""What this machine is: CPU model and cores, RAM, GPU name and memory.

Portable: every probe has a fallback (``/proc`` on Linux, ``sysctl`` names on macOS through
:mod:`platform`, ``GlobalMemoryStatusEx`` on Windows) and an unknown value is reported as ``""``
or 0 rather than failing. Probed once per process (:func:`machine_resources` caches).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import sys
from pathlib import Path

from swarm.net.progress import MAX_NAME_CHARS, Resources

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def machine_resources() -> Resources:
    """This machine's :class:`~swarm.net.progress.Resources` (cached)."""
    gpu, gpu_memory = _gpu()
    return Resources(
        cpu=_clean(_cpu_model()),
        cores=min(os.cpu_count() or 0, 1 << 16),
        ram=_ram_bytes(),
        gpu=_clean(gpu),
        gpu_memory=gpu_memory,
    )


def _clean(text: str) -> str:
    text = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return text[:MAX_NAME_CHARS]


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        try:
            for line in cpuinfo.read_text(errors="replace").splitlines():
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1]
        except OSError as e:
            logger.debug("cannot read /proc/cpuinfo: %s", e)
    return platform.processor() or platform.machine()


def _ram_bytes() -> int:
    try:
        if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
            return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (OSError, ValueError) as e:
        logger.debug("sysconf cannot tell the RAM size: %s", e)
    if sys.platform == "win32":
        return _windows_ram()
    return 0


def _windows_ram() -> int:
    class MemoryStatus(ctypes.Structure):
        _fields_ = [
            ("length", ctypes.c_ulong),
            ("load", ctypes.c_ulong),
            ("total_phys", ctypes.c_ulonglong),
            ("avail_phys", ctypes.c_ulonglong),
            ("total_page", ctypes.c_ulonglong),
            ("avail_page", ctypes.c_ulonglong),
            ("total_virtual", ctypes.c_ulonglong),
            ("avail_virtual", ctypes.c_ulonglong),
            ("avail_extended", ctypes.c_ulonglong),
        ]

    status = MemoryStatus()
    status.length = ctypes.sizeof(MemoryStatus)
    try:
        if ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status)):  # type: ignore[attr-defined]
            return int(status.total_phys)
    except (AttributeError, OSError) as e:
        logger.debug("GlobalMemoryStatusEx failed: %s", e)
    return 0


def _gpu() -> tuple[str, int]:
    # A helper peer never imports torch: importing it (and starting CUDA) just to print a name
    # would cost seconds at startup. A training peer has it loaded already.
    torch = sys.modules.get("torch")
    if torch is None:
        return "", 0
    try:
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            count = torch.cuda.device_count()
            name = props.name if count == 1 else f"{count}x {props.name}"
            return name, int(props.total_memory) * count
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return "Apple MPS", 0  # unified memory: the RAM figure says it
    except (RuntimeError, AssertionError) as e:  # a broken driver must not stop the peer
        logger.debug("cannot query the GPU: %s", e)
    return "", 0
