"""An eavesdropper on a keyed swarm reads no record: DHT datagrams and ``/info`` replies are
sealed. Recording proxies on loopback stand for the wire; an open swarm is the control (there
the same proxies do see the records, so the tests can fail)."""

from __future__ import annotations

import asyncio
import time

import pytest
from tcp_proxy import TcpProxy

from swarm.address import PeerAddress
from swarm.auth import Membership
from swarm.dht import DHTNode
from swarm.errors import AuthError
from swarm.identity import Identity
from swarm.net.confidential import open_reply, seal_reply
from swarm.net.transport import Transport

HOST = "127.0.0.1"
MARKER = b"run-record-marker-7d1f"
KEYED = Membership.with_key("the swarm key of the tests")


class UdpTap(asyncio.DatagramProtocol):
    """Forwards datagrams between one client and one server, keeping a copy of each."""

    def __init__(self, server: tuple[str, int]):
        self.server = server
        self.client: tuple[str, int] | None = None
        self.seen: list[bytes] = []
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:  # type: ignore[override]
        self.seen.append(data)
        assert self.transport is not None
        if addr[:2] == self.server:
            if self.client is not None:
                self.transport.sendto(data, self.client)
        else:
            self.client = addr[:2]
            self.transport.sendto(data, self.server)


async def _dht_traffic(membership: Membership) -> list[bytes]:
    nodes = [
        await DHTNode.create(Identity.generate(), membership, host=HOST, request_timeout=1.0)
        for _ in range(3)
    ]
    loop = asyncio.get_running_loop()
    tap_transport, tap = await loop.create_datagram_endpoint(
        lambda: UdpTap((HOST, nodes[0].port)), local_addr=(HOST, 0)
    )
    reader = None
    try:
        for node in nodes[1:]:
            assert await node.bootstrap([f"{HOST}:{nodes[0].port}"]) > 0
        for node in nodes:
            assert await node.store("run/peers", MARKER, time.time() + 60, subkey="p") > 0
        tap_port = tap_transport.get_extra_info("sockname")[1]
        reader = await DHTNode.create(Identity.generate(), membership, host=HOST, client=True)
        assert await reader.bootstrap([f"{HOST}:{tap_port}"]) > 0
        await reader.protocol.call(reader.contacts()[0], "find_value", _digest())
        found = await reader.get("run/peers")
        assert len(found) == 3
        return tap.seen
    finally:
        tap_transport.close()
        if reader is not None:
            await reader.close()
        await asyncio.gather(*(n.close() for n in nodes))


def _digest() -> bytes:
    from swarm.dht import key_digest

    return key_digest("run/peers")


async def test_an_eavesdropper_reads_no_dht_record_in_a_keyed_swarm() -> None:
    seen = await _dht_traffic(KEYED)
    assert len(seen) >= 4
    assert not any(MARKER in d for d in seen)
    open_seen = await _dht_traffic(Membership.open())
    assert any(MARKER in d for d in open_seen)  # the control: the tap does see records


async def _info_traffic(membership: Membership) -> list[bytes]:
    a = Transport(
        Identity.generate(),
        membership,
        run_id="run",
        listen=PeerAddress(HOST, 0),
        extra={"m": MARKER},
    )
    b = Transport(Identity.generate(), membership, run_id="run", listen=PeerAddress(HOST, 0))
    await a.start()
    await b.start()
    seen: list[bytes] = []

    async def tap(data: bytes, writer: asyncio.StreamWriter) -> None:
        seen.append(data)
        writer.write(data)

    try:
        async with TcpProxy(a.bound_address, up=tap, down=tap, host=HOST) as address:
            record = await b.fetch_info(address)
        assert record.extra["m"] == MARKER and record.peer_id == a.identity.peer_id
        return seen
    finally:
        await b.close()
        await a.close()


async def test_an_eavesdropper_reads_no_info_reply_in_a_keyed_swarm() -> None:
    assert not any(MARKER in d for d in await _info_traffic(KEYED))
    assert any(MARKER in d for d in await _info_traffic(Membership.open()))  # the control


def test_sealed_reply_opens_only_for_its_request_and_key() -> None:
    caller, nonce = b"c" * 32, b"n" * 16
    sealed = seal_reply(KEYED, caller=caller, request_nonce=nonce, path="/info", body=b"record")
    assert b"record" not in sealed
    assert open_reply(KEYED, caller=caller, request_nonce=nonce, path="/info", body=sealed) == (
        b"record"
    )
    other = Membership.with_key("another swarm key of the tests")
    for membership, nonce2, path in (
        (other, nonce, "/info"),
        (KEYED, b"m" * 16, "/info"),
        (KEYED, nonce, "/ping"),
    ):
        with pytest.raises(AuthError):
            open_reply(membership, caller=caller, request_nonce=nonce2, path=path, body=sealed)
