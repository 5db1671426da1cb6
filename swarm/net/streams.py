"""Both ends of a sealed stream: the server's inbound request and reply, the client's stream.

Frames are read by :class:`~swarm.net.reader.FrameReader` (each bounded before it is read, so a
hostile peer cannot make us buffer more than one frame). Writes await aiohttp's drain, and
aiohttp stops reading a socket whose buffer is full, so a slow consumer slows its sender down
(backpressure) in both directions.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from swarm.errors import TransportError
from swarm.identity import PeerID
from swarm.net import wire
from swarm.net.frames import DATA, END, ERROR, HEADER, MAX_ERROR_CHARS, Sealer
from swarm.net.reader import MAX_HEADER_BYTES, FrameReader

logger = logging.getLogger(__name__)

_COALESCE_BYTES = 64 * 1024  # below this, prefix and frame go out in one write


@dataclass(frozen=True)
class RemotePeer:
    """The authenticated sender of a request, as the server sees it."""

    peer_id: PeerID
    public_key: bytes  # 32 B Ed25519
    agreement_key: bytes  # 32 B X25519 of its current process
    host: str  # IP the connection came from (our listen address on their side)


class FrameWriter:
    """Seals chunks into frames of at most ``max_chunk_bytes`` plaintext bytes."""

    def __init__(self, sealer: Sealer, max_chunk_bytes: int):
        self.sealer = sealer
        self.max_chunk_bytes = max_chunk_bytes

    def frames(self, kind: int, data: bytes | bytearray | memoryview) -> list[bytes]:
        """Byte strings to write, in order (one frame per ``max_chunk_bytes`` of data)."""
        view = memoryview(data).cast("B")
        out: list[bytes] = []
        if kind != DATA:
            self._append(out, kind, view)
            return out
        for start in range(0, len(view), self.max_chunk_bytes):
            self._append(out, DATA, view[start : start + self.max_chunk_bytes])
        return out

    def _append(self, out: list[bytes], kind: int, piece: memoryview) -> None:
        prefix, sealed = self.sealer.seal(kind, piece)
        if len(sealed) < _COALESCE_BYTES:
            out.append(prefix + sealed)
        else:
            out += (prefix, sealed)


def error_reason(exc: BaseException) -> bytes:
    return f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS].encode("utf-8", "replace")


class InboundStream:
    """Server side: the authenticated request. ``async for chunk in request`` yields verified data.

    Attributes:
        name: the stream route.
        sender: who sent it (authenticated).
        header: the request header dict (authenticated).
    """

    def __init__(self, name: str, sender: RemotePeer, header: dict[str, Any], reader: FrameReader):
        self.name = name
        self.sender = sender
        self.header = header
        self._reader = reader

    @property
    def bytes_received(self) -> int:
        return self._reader.bytes_received

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self._reader.read_chunk()
        if chunk is None:
            raise StopAsyncIteration
        return chunk


class ReplyStream:
    """Server side: the reply. ``await reply.prepare(header)``, then ``await reply.write(chunk)``.

    The framework ends the reply when the handler returns (an END frame), or aborts it with an
    ERROR frame when the handler raises, so the client never mistakes a cut reply for a whole one.
    Nothing here times out: a handler may hold its reply as long as it needs.
    """

    def __init__(self, request: web.Request, writer: FrameWriter):
        self._request = request
        self._writer = writer
        self._trailer = b""
        self.response: web.StreamResponse | None = None

    def set_trailer(self, trailer: dict[str, Any]) -> None:
        """A small dict sealed into the END frame, sent after the last chunk: what the client
        reads as ``stream.trailer`` once it reached the end (e.g. an outcome known only then).

        Raises:
            TransportError: not a small msgpack-able dict.
        """
        self._trailer = _pack_header(trailer)

    @property
    def prepared(self) -> bool:
        return self.response is not None

    async def prepare(self, header: dict[str, Any]) -> None:
        """Send the HTTP status and the sealed reply header.

        Raises:
            TransportError: called twice, the header is not a small msgpack-able dict, or the
                connection broke (``lost``).
        """
        if self.response is not None:
            raise TransportError("reply already prepared")
        payload = _pack_header(header)
        response = web.StreamResponse(status=200)
        response.content_type = "application/octet-stream"
        with _breaks_as_lost():
            await response.prepare(self._request)
        self.response = response
        await self._send(HEADER, payload)

    async def write(self, chunk: bytes | bytearray | memoryview) -> None:
        """Seal and send ``chunk`` (split into frames of at most the maximum chunk size).

        Raises:
            TransportError: not prepared, or the connection broke (``lost``).
        """
        if self.response is None:
            raise TransportError("reply.prepare(header) must come before reply.write()")
        if len(chunk):
            await self._send(DATA, chunk)

    async def _send(self, kind: int, data: bytes | bytearray | memoryview) -> None:
        response = self._prepared_response()
        with _breaks_as_lost():
            for piece in self._writer.frames(kind, data):
                await response.write(piece)

    def _prepared_response(self) -> web.StreamResponse:
        if self.response is None:
            raise TransportError("reply.prepare(header) must come first")
        return self.response

    async def finish(self) -> None:
        """End the reply (framework use, after the handler returned)."""
        if self.response is None:
            await self.prepare({})
        await self._send(END, self._trailer)
        with _breaks_as_lost():
            await self._prepared_response().write_eof()

    async def abort(self, exc: BaseException) -> None:
        """Abort a prepared reply with an ERROR frame (framework use, after the handler raised).

        When the connection itself is gone (the peer died or hung up) there is nobody to tell:
        the reply ends quietly."""
        try:
            if not self._writer.sealer.closed:
                await self._send(ERROR, error_reason(exc))
            await self._prepared_response().write_eof()
        except (ConnectionError, TransportError) as e:
            logger.debug("could not send the error reply: %r", e)


@contextlib.contextmanager
def _breaks_as_lost() -> Iterator[None]:
    """A reply's write whose connection broke (the client died, hung up or gave up) raises
    TransportError with ``lost`` (aiohttp raises its ConnectionResetError subclass)."""
    try:
        yield
    except ConnectionError as e:
        raise TransportError(f"connection lost: {e!r}", lost=True) from e


def _pack_header(header: dict[str, Any]) -> bytes:
    if not isinstance(header, dict):
        raise TransportError(f"a stream header is a dict, not {type(header).__name__}")
    try:
        payload = wire.pack(header)
    except (TypeError, ValueError, OverflowError) as e:
        raise TransportError(f"stream header is not msgpack-able: {e}") from e
    if len(payload) > MAX_HEADER_BYTES:
        raise TransportError(f"stream header of {len(payload)} bytes exceeds {MAX_HEADER_BYTES}")
    return payload


class OutboundStream:
    """Client side of a stream: ``async with transport.stream(...) as s``.

    ``s.header`` is the reply header; ``async for chunk in s`` yields verified reply chunks. Leaving
    the block before the END frame closes the connection (the server sees a cut). An exception
    raised by the caller's chunk iterator aborts the request body (the server sees an ERROR
    frame) and is re-raised here.
    """

    def __init__(
        self,
        open_response: Callable[[AsyncIterable[bytes]], Awaitable[aiohttp.ClientResponse]],
        make_reader: Callable[[aiohttp.StreamReader], FrameReader],
        writer: FrameWriter,
        header: dict[str, Any],
        chunks: AsyncIterable[bytes],
        *,
        peer: str,
    ):
        self._open_response = open_response
        self._make_reader = make_reader
        self._writer = writer
        self._request_header = _pack_header(header)
        self._chunks = chunks
        self._peer = peer
        self._response: aiohttp.ClientResponse | None = None
        self._reader: FrameReader | None = None
        self._body_error: BaseException | None = None
        self.header: dict[str, Any] = {}

    async def _body(self) -> AsyncIterator[bytes]:
        for piece in self._writer.frames(HEADER, self._request_header):
            yield piece
        try:
            async for chunk in self._chunks:
                for piece in self._writer.frames(DATA, chunk):
                    yield piece
        except Exception as e:  # the caller's iterator failed: tell the server, re-raise later
            self._body_error = e
            logger.debug("aborting the request body to %s: %s", self._peer, e)
            for piece in self._writer.frames(ERROR, error_reason(e)):
                yield piece
            return
        for piece in self._writer.frames(END, b""):
            yield piece

    async def __aenter__(self) -> OutboundStream:
        try:
            self._response = await self._open_response(self._body())
            if self._response.status != 200:
                reason = await _short_text(self._response)
                raise TransportError(
                    f"refused: {reason}", peer=self._peer, status=self._response.status
                )
            self._reader = self._make_reader(self._response.content)
            self.header = await self._reader.read_header()
        except BaseException:
            await self._close(abort=True)
            self._raise_body_error()
            raise
        return self

    def _raise_body_error(self) -> None:
        if self._body_error is not None:
            raise self._body_error

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        if self._reader is None:
            raise TransportError("use the stream inside 'async with'", peer=self._peer)
        try:
            chunk = await self._reader.read_chunk()
        except (TimeoutError, aiohttp.ClientError) as e:
            self._raise_body_error()
            raise TransportError(f"stream failed: {e!r}", peer=self._peer) from e
        if chunk is None:
            self._raise_body_error()
            raise StopAsyncIteration
        return chunk

    @property
    def bytes_received(self) -> int:
        return 0 if self._reader is None else self._reader.bytes_received

    @property
    def trailer(self) -> dict[str, Any]:
        """The reply's trailer (:meth:`ReplyStream.set_trailer`); ``{}`` until the END frame."""
        return {} if self._reader is None else self._reader.trailer

    async def __aexit__(self, *exc_info: object) -> None:
        complete = self._reader is not None and self._reader.ended
        await self._close(abort=not complete)
        if exc_info[0] is None:
            self._raise_body_error()

    async def _close(self, *, abort: bool) -> None:
        if self._response is None:
            return
        if abort:
            self._response.close()
        else:
            self._response.release()
        self._response = None


async def _short_text(response: aiohttp.ClientResponse) -> str:
    try:
        data = await response.content.read(512)
    except (aiohttp.ClientError, ConnectionError, TimeoutError):
        data = b""
    return data.decode("utf-8", "replace").strip() or (response.reason or "")
