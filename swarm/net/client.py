"""Outgoing requests of one peer: authenticated GETs and sealed streams over one ClientSession."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import aiohttp

from swarm.address import PeerAddress
from swarm.auth import AUTH_HEADER, Membership, RequestAuth
from swarm.errors import TransportError
from swarm.identity import Identity
from swarm.net.confidential import open_reply
from swarm.net.frames import TAG_BYTES, TO_CLIENT, TO_SERVER, Opener, Sealer, stream_aead
from swarm.net.reader import FrameReader
from swarm.net.record import PeerRecord
from swarm.net.streams import FrameWriter, OutboundStream


class Client:
    """Signs every request with ``identity`` (and the swarm key) and seals stream bodies."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        identity: Identity,
        membership: Membership,
        *,
        cipher: str,
        max_chunk_bytes: int,
        max_stream_bytes: int,
    ):
        self.session = session
        self.identity = identity
        self.membership = membership
        self.cipher = cipher
        self.max_chunk_bytes = max_chunk_bytes
        self.max_stream_bytes = max_stream_bytes

    async def close(self) -> None:
        await self.session.close()

    def _auth_headers(self, target: bytes, method: str, path: str) -> tuple[RequestAuth, dict]:
        auth = RequestAuth.create(
            self.identity,
            self.membership,
            target=target,
            method=method,
            path=path,
            cipher=self.cipher,
        )
        return auth, {AUTH_HEADER: auth.encode()}

    async def get(self, address: PeerAddress, path: str, limit: int, timeout: float) -> bytes:
        """GET a small body (at most ``limit`` bytes) from a route that accepts any target.

        In a keyed swarm the reply comes sealed (see :mod:`swarm.net.confidential`)."""
        auth, headers = self._auth_headers(b"", "GET", path)
        try:
            async with self.session.get(
                address.url + path,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as response:
                if response.status != 200:
                    text = (await response.content.read(512)).decode("utf-8", "replace")
                    raise TransportError(
                        f"GET {path} refused: {text}", peer=str(address), status=response.status
                    )
                body = await _read_limited(response.content, limit + TAG_BYTES, str(address))
        except TimeoutError as e:
            raise TransportError(f"GET {path} timed out", peer=str(address)) from e
        except (aiohttp.ClientError, OSError) as e:
            raise TransportError(
                f"GET {path} failed: {e!r}", peer=str(address), refused=_refused(e)
            ) from e
        return open_reply(
            self.membership,
            caller=self.identity.public_key,
            request_nonce=auth.nonce,
            path=path,
            body=body,
        )

    def stream(
        self,
        peer: PeerRecord,
        name: str,
        header: dict[str, Any],
        chunks: AsyncIterable[bytes],
        *,
        timeout: float,
    ) -> OutboundStream:
        """See :meth:`swarm.net.transport.Transport.stream` (``name`` is already validated)."""
        path = f"/stream/{name}"
        auth, headers = self._auth_headers(peer.peer_id.digest, "POST", path)
        label = f"{peer.peer_id.short}@{peer.address}"
        aead = stream_aead(
            self.identity,
            self.membership,
            peer_public_key=peer.public_key,
            peer_agreement_key=peer.agreement_key,
            initiator=True,
            stream_id=auth.nonce,
            cipher=self.cipher,
        )
        client_timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)

        async def open_response(body: AsyncIterable[bytes]) -> aiohttp.ClientResponse:
            try:
                return await self.session.post(
                    peer.address.url + path,
                    data=body,
                    headers={**headers, "Content-Type": "application/octet-stream"},
                    timeout=client_timeout,
                )
            except TimeoutError as e:
                raise TransportError(f"stream {name} timed out", peer=label) from e
            except (aiohttp.ClientError, OSError) as e:
                raise TransportError(
                    f"stream {name} failed: {e!r}",
                    peer=label,
                    refused=_refused(e),
                    unanswered=True,
                ) from e

        def make_reader(content: aiohttp.StreamReader) -> FrameReader:
            opener = Opener(aead, auth.nonce, TO_CLIENT, max_frame_bytes=self.max_chunk_bytes)
            return FrameReader(content, opener, max_stream_bytes=self.max_stream_bytes, peer=label)

        writer = FrameWriter(Sealer(aead, auth.nonce, TO_SERVER), self.max_chunk_bytes)
        return OutboundStream(open_response, make_reader, writer, header, chunks, peer=label)


async def empty_body() -> AsyncIterator[bytes]:
    return
    yield b""  # makes this an async generator


async def _read_limited(content: aiohttp.StreamReader, limit: int, peer: str) -> bytes:
    data = bytearray()
    async for piece in content.iter_chunked(64 * 1024):
        data += piece
        if len(data) > limit:
            raise TransportError(f"reply longer than {limit} bytes", peer=peer)
    return bytes(data)


def _refused(e: BaseException) -> bool:
    """The connection was refused: nothing listens at the address (the peer is gone)."""
    if isinstance(e, aiohttp.ClientConnectorError):
        e = e.os_error
    return isinstance(e, ConnectionRefusedError)
