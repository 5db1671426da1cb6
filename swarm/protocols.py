"""What the averaging and training layers need from a running peer, as typed Protocols.

:class:`swarm.peer.Peer` provides all of it; tests may hand in anything with the same shape.
Naming the dependency keeps the layers honest: averaging talks to the DHT and the transport
through these few calls, never through their internals.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from swarm.address import PeerAddress
    from swarm.dht.records import DHTEntry
    from swarm.identity import PeerID
    from swarm.net.record import PeerRecord
    from swarm.net.streams import InboundStream, OutboundStream, RemotePeer, ReplyStream

    StreamHandler = Callable[[InboundStream, ReplyStream], Awaitable[None]]
    RpcHandler = Callable[[RemotePeer, dict[str, Any]], Awaitable[dict[str, Any]]]


class StreamTransport(Protocol):
    """The authenticated HTTP side of a peer: streams, RPCs, pings and its own record."""

    def record(self) -> PeerRecord: ...

    def update_record(self, **fields: Any) -> PeerRecord: ...

    def add_stream(self, name: str, handler: StreamHandler) -> None: ...

    def add_rpc(self, name: str, handler: RpcHandler) -> None: ...

    def stream(
        self,
        peer: PeerRecord,
        name: str,
        header: dict[str, Any],
        chunks: AsyncIterable[bytes],
        *,
        timeout: float,
    ) -> OutboundStream: ...

    async def call(
        self, peer: PeerRecord, name: str, payload: dict[str, Any], *, timeout: float
    ) -> dict[str, Any]: ...

    async def ping(self, address: PeerAddress, *, timeout: float | None = None) -> float: ...


class RecordStore(Protocol):
    """The DHT side of a peer: signed, expiring, merged dictionary records."""

    async def store(
        self, key: str, value: bytes, expiration: float, *, subkey: str = ""
    ) -> int: ...

    async def get(self, key: str) -> dict[tuple[PeerID, str], DHTEntry]: ...


class PeerSettings(Protocol):
    """The part of a peer's configuration others read."""

    @property
    def run_id(self) -> str: ...

    @property
    def record_ttl(self) -> float: ...


class Peer(Protocol):
    """A started peer, as the averaging and training layers use it."""

    @property
    def peer_id(self) -> PeerID: ...

    @property
    def run_id(self) -> str: ...

    @property
    def config(self) -> PeerSettings: ...

    @property
    def transport(self) -> StreamTransport: ...

    @property
    def dht(self) -> RecordStore: ...

    @property
    def departed(self) -> set[PeerID]:
        """Peers whose leave marker this peer has read: nobody waits for them."""
        ...

    async def announce(self) -> int: ...

    async def known_peers(
        self, max_age_s: float = 0.0, *, spaced: bool = False
    ) -> dict[PeerID, PeerRecord]: ...
