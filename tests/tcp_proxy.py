"""A TCP proxy in front of one loopback peer, for tests: each direction's bytes pass through a
function of the test's, which writes them on, recorded, changed or held back.

    async with TcpProxy(b.bound_address, up=flip_one_byte) as address:
        ...  # dial ``address`` instead of ``b``'s
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from swarm.address import PeerAddress

Relay = Callable[[bytes, asyncio.StreamWriter], Awaitable[None]]  # writes what was read on


async def unchanged(data: bytes, writer: asyncio.StreamWriter) -> None:
    writer.write(data)


class TcpProxy:
    """Forwards connections made to it to ``target``.

    Args:
        target: where every connection goes.
        up / down: applied to each read towards ``target`` / back from it.
        host: the loopback address the proxy listens on.
    """

    def __init__(
        self,
        target: PeerAddress,
        *,
        up: Relay = unchanged,
        down: Relay = unchanged,
        host: str = "127.0.0.4",
    ):
        self.target, self.up, self.down, self.host = target, up, down, host
        self.connections = 0  # connections made to the proxy so far
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> PeerAddress:
        self._server = await asyncio.start_server(self._on_client, self.host, 0)
        return PeerAddress(self.host, self._server.sockets[0].getsockname()[1])

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection(self.target.host, self.target.port)
        for task in (
            asyncio.create_task(_pump(reader, up_writer, self.up)),
            asyncio.create_task(_pump(up_reader, writer, self.down)),
        ):
            self._tasks.add(task)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, relay: Relay) -> None:
    try:
        while data := await reader.read(65536):
            await relay(data, writer)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()
