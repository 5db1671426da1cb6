"""Receive buffers for large frames, whose memory goes back to the OS after a flood.

Why not ``readexactly``: it gathers a frame from the socket's chunks (64-256 KiB ``bytes``
each) and joins them, and an incomplete read joins them once more into the error it raises.
Every one of those blocks comes from the C allocator, and glibc serves blocks of this size
from its heap once a freed 1 MiB block has raised its dynamic mmap threshold: a flood of held
partial frames leaves a heap full of holes that ``free`` never hands back to the OS.

So a large frame is copied, piece by piece as it arrives, into a buffer of its own: an
anonymous memory map (``mmap.mmap(-1, n)``, the same on Linux, macOS and Windows), freed to
the OS the moment it is closed. Each piece from the socket is freed right after its copy, so
what a stalled sender pins is the bytes it sent, in one place, under the server's budget
(:class:`~swarm.net.limits.ByteBudget`). Mapping a fresh buffer per frame would cost its page
faults every time (about 1.2 ms per MiB, measured), so buffers go back to a :class:`FramePool`
after each frame: it keeps up to 4 MiB of them for the next frames and closes the rest.

What is left is the C heap: the socket's chunks are ``bytes`` from malloc, and glibc gives the
free pages inside its heap back only on ``malloc_trim``, which :class:`HeapTrimmer` calls a
second after frames stop failing.

Measured on a ``swarm-peer`` holding 100 partial 1 MiB frames from 4 addresses, then released
(``held_frames_memory`` in ``benchmarks/hostile_net.py``): RSS 10 s later was 101 MB above its
start before, and 4 MB above it now (the buffers, the trim, and
:func:`swarm.net.reader.forget_tracebacks`, which breaks the reference cycles that pinned
aiohttp's unread buffers until the next full garbage collection).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import mmap
import sys
import threading
import time
from collections.abc import Callable

import aiohttp

logger = logging.getLogger(__name__)

DEFAULT_IDLE_BYTES = 4 << 20
TRIM_DELAY_S = 1.0  # after the last failed frame: a flood's other frames fail within it


class FramePool:
    """Memory maps for frames being read, reused frame after frame.

    Args:
        max_idle_bytes: buffers kept for reuse between frames, in all; a buffer given back
            beyond this is unmapped at once. Every event loop of the process may share one.
    """

    def __init__(self, max_idle_bytes: int = DEFAULT_IDLE_BYTES):
        self.max_idle_bytes = max_idle_bytes
        self._idle: list[mmap.mmap] = []  # the last given back is the first taken
        self._idle_bytes = 0
        self._lock = threading.Lock()  # several peers (loops) may share the pool

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def take(self, size: int) -> mmap.mmap:
        """A buffer of at least ``size`` bytes (an idle one when one is large enough)."""
        with self._lock:
            for i in range(len(self._idle) - 1, -1, -1):  # frames of one size: the first fits
                if len(self._idle[i]) >= size:
                    buffer = self._idle.pop(i)
                    self._idle_bytes -= len(buffer)
                    return buffer
        return mmap.mmap(-1, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE)

    def give(self, buffer: mmap.mmap) -> None:
        """Return a buffer (every view of it released): kept for reuse, or unmapped."""
        with self._lock:
            if self._idle_bytes + len(buffer) <= self.max_idle_bytes:
                self._idle.append(buffer)
                self._idle_bytes += len(buffer)
                return
        buffer.close()

    def clear(self) -> None:
        """Unmap every idle buffer."""
        with self._lock:
            idle, self._idle, self._idle_bytes = self._idle, [], 0
        for buffer in idle:
            buffer.close()


FRAME_POOL = FramePool()


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None (other C libraries give free pages back themselves)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # musl and others have none
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim  # type: ignore[no-any-return]


class HeapTrimmer:
    """Gives the C heap's free pages back to the OS a second after frames stop failing.

    glibc returns the free pages inside its heap only on ``malloc_trim``; what the socket
    chunks of a flood of cut frames leave behind would otherwise stay resident. One trim took
    1.5 ms, 18 ms when it gave back 400 MB (measured in a process with torch loaded); it runs
    in a worker thread, a second after the last of a burst of failed frames: a transfer that
    completes never triggers it. Elsewhere (macOS, Windows, musl) it does nothing.
    """

    def __init__(self, trim: Callable[[int], int] | None = None):
        self._trim = trim
        self._due = 0.0  # monotonic time the pending trim is due at
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop it is scheduled on
        self._lock = threading.Lock()
        self.trims = 0

    def soon(self) -> None:
        """Ask for a trim a moment from now (the running loop's worker thread does it)."""
        if self._trim is None:
            return
        loop = asyncio.get_running_loop()
        with self._lock:
            self._due = time.monotonic() + TRIM_DELAY_S
            if self._loop is not None and not self._loop.is_closed():
                return  # already scheduled: it waits for this failure too
            self._loop = loop
        loop.call_later(TRIM_DELAY_S, self._wake)

    def _wake(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            wait = self._due - time.monotonic()
            if wait > 0:  # more frames failed meanwhile: trim after the last one
                loop.call_later(wait, self._wake)
                return
            self._loop = None
        loop.run_in_executor(None, self._run)

    def _run(self) -> None:
        assert self._trim is not None
        started = time.perf_counter()
        self._trim(0)
        self.trims += 1
        logger.debug("gave free heap pages back in %.1f ms", (time.perf_counter() - started) * 1e3)


HEAP_TRIMMER = HeapTrimmer(_load_malloc_trim())


async def read_into(content: aiohttp.StreamReader, target: memoryview) -> None:
    """Fill ``target`` from ``content``, one socket chunk at a time.

    Raises:
        asyncio.IncompleteReadError: the body ended first (with no partial copy attached).
    """
    filled, size = 0, len(target)
    while filled < size:
        piece = await content.read(size - filled)
        if not piece:
            raise asyncio.IncompleteReadError(b"", size - filled)
        target[filled : filled + len(piece)] = piece
        filled += len(piece)
