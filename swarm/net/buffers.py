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
faults every time (about 1.1 ms per MiB, measured; a copy into a mapped buffer costs 0.07 ms),
so buffers go back to a :class:`FramePool` after each frame. It keeps 4 MiB of them for good, and
up to 32 MiB for a few seconds after they were last used: in a butterfly of 8 peers each reads up
to 14 frames of 1 MiB at once (7 parts in, 7 averages back), round after round, and with only
4 MiB kept it mapped a third of its frames afresh (about 9 ms of CPU per peer and round). After
a flood, what is above 4 MiB is unmapped :data:`IDLE_HOLD_S` after the flood's last frame.

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

KEPT_IDLE_BYTES = 4 << 20  # idle buffers kept for good
MAX_IDLE_BYTES = 32 << 20  # idle buffers kept for a moment, in all
IDLE_HOLD_S = 3.0  # how long an idle buffer above KEPT_IDLE_BYTES is kept
TRIM_DELAY_S = 1.0  # after the last failed frame: a flood's other frames fail within it


class FramePool:
    """Memory maps for frames being read, reused frame after frame.

    Args:
        max_idle_bytes: buffers kept for reuse between frames, in all; a buffer given back
            beyond this is unmapped at once. Every event loop of the process may share one.
        kept_idle_bytes: of those, what is kept however long it sits idle (at most
            ``max_idle_bytes``); a buffer above it is unmapped once idle for ``hold_s``.
        hold_s: seconds an idle buffer above ``kept_idle_bytes`` waits for its next frame.
    """

    def __init__(
        self,
        max_idle_bytes: int = MAX_IDLE_BYTES,
        kept_idle_bytes: int = KEPT_IDLE_BYTES,
        hold_s: float = IDLE_HOLD_S,
    ):
        self.max_idle_bytes = max_idle_bytes
        self.kept_idle_bytes = min(kept_idle_bytes, max_idle_bytes)
        self.hold_s = hold_s
        self._idle: list[tuple[mmap.mmap, float]] = []  # (buffer, given back at), oldest first
        self._idle_bytes = 0
        self._lock = threading.Lock()  # several peers (loops) may share the pool
        self._sweeper: asyncio.AbstractEventLoop | None = None  # the loop a sweep waits on

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def take(self, size: int) -> mmap.mmap:
        """A buffer of at least ``size`` bytes (an idle one when one is large enough)."""
        with self._lock:
            for i in range(len(self._idle) - 1, -1, -1):  # frames of one size: the first fits
                if len(self._idle[i][0]) >= size:
                    buffer, _ = self._idle.pop(i)
                    self._idle_bytes -= len(buffer)
                    return buffer
        return mmap.mmap(-1, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE)

    def give(self, buffer: mmap.mmap) -> None:
        """Return a buffer (every view of it released): kept for reuse, or unmapped."""
        now = time.monotonic()
        self._sweep(now)
        with self._lock:
            kept = self._idle_bytes + len(buffer) <= self.max_idle_bytes
            if kept:
                self._idle.append((buffer, now))
                self._idle_bytes += len(buffer)
            above = self._idle_bytes > self.kept_idle_bytes
        if not kept:
            buffer.close()
        elif above:
            self._sweep_soon(self.hold_s)

    def clear(self) -> None:
        """Unmap every idle buffer."""
        with self._lock:
            idle, self._idle, self._idle_bytes = self._idle, [], 0
        for buffer, _ in idle:
            buffer.close()

    def _sweep(self, now: float) -> float | None:
        """Unmap the buffers above ``kept_idle_bytes`` idle for ``hold_s``, oldest first;
        the seconds until the next one is due (None: nothing above it is left)."""
        expired = []
        due = None
        with self._lock:
            while self._idle_bytes > self.kept_idle_bytes:
                buffer, since = self._idle[0]
                if now - since < self.hold_s:
                    due = since + self.hold_s - now
                    break
                del self._idle[0]
                self._idle_bytes -= len(buffer)
                expired.append(buffer)
        for buffer in expired:
            buffer.close()
        return due

    def _sweep_soon(self, delay: float) -> None:
        """Sweep ``delay`` seconds from now on the running loop (none running: the next
        ``give`` sweeps), unless a sweep is already waiting on a live loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        with self._lock:
            if self._sweeper is not None and not self._sweeper.is_closed():
                return
            self._sweeper = loop
        loop.call_later(delay, self._wake)

    def _wake(self) -> None:
        with self._lock:
            self._sweeper = None  # first: a buffer given back meanwhile asks for its own sweep
        due = self._sweep(time.monotonic())
        if due is not None:
            self._sweep_soon(due)


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
