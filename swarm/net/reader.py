"""Reading the frames of one direction of a sealed stream, within time and memory bounds.

Each frame's length prefix is checked against the frame limit, and the running total against
the stream limit, before the frame is read. Frames above ``BUFFERED_FRAME_BYTES`` wait for
room in the server's partial-frame budget per host, per subnet and in all
(:class:`~swarm.net.limits.ByteBudget`), so stalled senders wait for their turn instead of
pinning a frame each; frames above ``POOLED_FRAME_BYTES`` are read into a pooled buffer that
goes back to the OS (:mod:`swarm.net.buffers`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import aiohttp

from swarm.errors import AuthError, TransportError
from swarm.net import wire
from swarm.net.buffers import FRAME_POOL, HEAP_TRIMMER, read_into
from swarm.net.frames import DATA, ERROR, HEADER, MAX_ERROR_CHARS, PREFIX_BYTES, TAG_BYTES, Opener
from swarm.net.limits import StreamLimits

MAX_HEADER_BYTES = 64 * 1024
BUFFERED_FRAME_BYTES = 64 * 1024  # larger frames wait for the partial-frame budget
POOLED_FRAME_BYTES = 256 * 1024  # larger ones are read into a pooled buffer


class FrameReader:
    """Reads, bounds and opens the frames of one direction of one stream."""

    def __init__(
        self,
        content: aiohttp.StreamReader,
        opener: Opener,
        *,
        max_stream_bytes: int,
        peer: str,
        limits: StreamLimits | None = None,
        source: str = "",
    ):
        self._content = content
        self._limits = limits
        self._source = source  # the sender's IP address: its host and subnet share a budget
        self._opener = opener
        self._max_stream_bytes = max_stream_bytes
        self._peer = peer
        self.bytes_received = 0
        self.trailer: dict[str, Any] = {}

    @property
    def ended(self) -> bool:
        """The END frame was read: the stream is whole."""
        return self._opener.ended

    async def read(self) -> tuple[int, bytes]:
        """Return the next ``(kind, plaintext)``.

        Raises:
            AuthError: tampered or reordered frame, or the body ends before its END frame.
            TransportError: oversized frame or stream, protocol violation, connection lost.
        """
        try:
            kind, plaintext = await self._read_frame()
        except BaseException as e:
            forget_tracebacks(e)
            raise
        if kind == DATA:
            self.bytes_received += len(plaintext)
        return kind, plaintext

    async def _read_frame(self) -> tuple[int, bytes]:
        limits = self._limits
        try:
            prefix = await self._within(self._content.readexactly(PREFIX_BYTES), 0)
            length, kind = self._opener.parse_prefix(prefix)
            if kind == DATA and self.bytes_received + length - TAG_BYTES > self._max_stream_bytes:
                raise TransportError(
                    f"stream exceeds {self._max_stream_bytes} bytes", peer=self._peer, status=413
                )
            if length <= BUFFERED_FRAME_BYTES:
                sealed = await self._within(self._content.readexactly(length), length)
                return kind, self._opener.open(kind, sealed)
            if limits is None:
                return kind, await self._read_large(kind, length)
            # partially received frames share a memory budget per host, per subnet and in
            # all: stalled senders wait for their turn (and time out) instead of pinning a
            # frame each
            budget = limits.shared_budget()
            await self._within(budget.acquire(length, self._source), 0)
            try:
                return kind, await self._read_large(kind, length)
            finally:
                budget.release(length, self._source)
        except asyncio.IncompleteReadError:
            raise AuthError(
                f"stream from {self._peer} truncated after {self._opener.index} frames"
            ) from None
        except (asyncio.TimeoutError, TimeoutError) as e:
            raise TransportError(
                "timed out waiting for the peer", peer=self._peer, status=408
            ) from e
        except (aiohttp.ClientError, ConnectionError) as e:
            raise TransportError(f"connection lost: {e!r}", peer=self._peer, lost=True) from e

    async def _read_large(self, kind: int, length: int) -> bytes:
        """Read a frame above ``BUFFERED_FRAME_BYTES`` and open it: above ``POOLED_FRAME_BYTES``
        into a pooled buffer (see :mod:`swarm.net.buffers`), below with ``readexactly``, whose
        join of one or two socket chunks costs less than a copy into a buffer."""
        if length <= POOLED_FRAME_BYTES:
            try:
                sealed = await self._within(self._content.readexactly(length), length)
            except BaseException:
                HEAP_TRIMMER.soon()  # a flood of cut frames leaves holes in the C heap
                raise
            return self._opener.open(kind, sealed)
        buffer = FRAME_POOL.take(length)
        whole = memoryview(buffer)
        view = whole[:length]
        try:
            await self._within(read_into(self._content, view), length)
            return self._opener.open(kind, view)
        except BaseException:
            HEAP_TRIMMER.soon()
            raise
        finally:
            view.release()
            whole.release()
            FRAME_POOL.give(buffer)

    async def _within(self, step: Awaitable[Any], length: int) -> Any:
        """Await ``step`` within the time a frame of ``length`` bytes may take (no limit when
        the stream has no limits: the client side times out on its own)."""
        if self._limits is None:
            return await step
        try:
            return await asyncio.wait_for(step, self._limits.frame_timeout(length))
        except asyncio.TimeoutError:
            self._limits.stalled += 1
            raise

    async def read_header(self) -> dict[str, Any]:
        kind, plaintext = await self.read()
        if kind != HEADER:  # parse_prefix already enforces this; kept for clarity
            raise TransportError("stream does not start with a header", peer=self._peer)
        header = wire.unpack(plaintext, max_bytes=MAX_HEADER_BYTES, what="stream header")
        if not isinstance(header, dict):
            raise TransportError("a stream header must be a dict", peer=self._peer)
        return header

    async def read_chunk(self) -> bytes | None:
        """The next data chunk, or None at the END frame (whose trailer lands in ``trailer``).

        Raises:
            TransportError: the sender aborted the stream (ERROR frame), a malformed trailer,
                or see :meth:`read`.
        """
        if self.ended:
            return None
        kind, plaintext = await self.read()
        if kind == DATA:
            return plaintext
        if kind == ERROR:
            reason = plaintext[:MAX_ERROR_CHARS].decode("utf-8", "replace")
            raise TransportError(f"sender aborted the stream: {reason}", peer=self._peer)
        if plaintext:
            trailer = wire.unpack(plaintext, max_bytes=MAX_HEADER_BYTES, what="stream trailer")
            if not isinstance(trailer, dict):
                raise TransportError("a stream trailer must be a dict", peer=self._peer)
            self.trailer = trailer
        return None


def forget_tracebacks(error: BaseException) -> None:
    """Drop the tracebacks of the errors behind ``error``.

    aiohttp keeps a lost connection's error on its ``StreamReader`` and raises that same object
    from every read; its traceback holds the frames that hold the reader, whose buffer holds
    what the peer sent: a reference cycle that pins the unread bytes until the garbage
    collector's next full pass, which may be minutes away. The error's own message survives.
    """
    seen: set[int] = set()
    cause = error.__cause__ or error.__context__
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        cause.__traceback__ = None
        cause = cause.__cause__ or cause.__context__
