"""Dial-back checks, relays and NAT-PMP messages on loopback (the real NATs: tests/test_nat.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import struct
from collections.abc import AsyncIterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarm.address import PeerAddress
from swarm.auth import Membership
from swarm.errors import ConfigError, PortMapError, TransportError
from swarm.identity import Identity
from swarm.net import natpmp, pcp
from swarm.net.nat import may_relay
from swarm.net.portmap import PortMapper, guess_gateway, is_home_address
from swarm.net.reachability import DialbackService, Reach, request_dialback
from swarm.net.record import PeerRecord
from swarm.net.relay import CONTROL_STREAM, MAGIC, RelayBudget, RelayLink, RelayService
from swarm.net.streams import InboundStream, ReplyStream
from swarm.net.transport import Transport
from swarm.peer import Peer
from swarm.peer_config import PeerConfig

OPEN = Membership.open()


async def _transport(host: str, **kw: object) -> Transport:
    t = Transport(Identity.generate(), OPEN, run_id="r", listen=f"{host}:0", **kw)  # type: ignore[arg-type]
    await t.start()
    return t


async def _echo(request: InboundStream, reply: ReplyStream) -> None:
    await reply.prepare({"echo": request.header.get("n")})
    async for chunk in request:
        await reply.write(bytes(chunk))


async def _chunks(parts: list[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


# ---- dial-back


async def test_dialback_reaches_a_listening_peer_and_not_a_closed_port() -> None:
    helper, asker = await _transport("127.0.0.61"), await _transport("127.0.0.62")
    try:
        DialbackService(helper, udp_probe=None)
        result = await request_dialback(asker, helper.record(), asker.port, host="10.9.9.9")
        assert result.tcp and result.observed_host == "127.0.0.62"
        assert result.address == PeerAddress("127.0.0.62", asker.port)
        closed = await request_dialback(
            asker, helper.record(), 1, host="127.0.0.62"
        )  # nothing listens on port 1
        assert not closed.tcp and not closed.udp
    finally:
        await asker.close()
        await helper.close()


async def test_dialback_refuses_junk_ports() -> None:
    helper, asker = await _transport("127.0.0.63"), await _transport("127.0.0.64")
    try:
        DialbackService(helper, udp_probe=None)
        for junk in (0, 70000, "80", True, None):
            with pytest.raises(TransportError):
                await asker.call(helper.record(), "reach.dialback", {"port": junk}, timeout=5)
    finally:
        await asker.close()
        await helper.close()


async def test_peers_on_loopback_learn_they_are_direct() -> None:
    first = await Peer.start(PeerConfig(run_id="reach", listen="127.0.0.65:0", heartbeat_s=1.0))
    try:
        second = await Peer.start(
            PeerConfig(
                run_id="reach",
                listen="127.0.0.66:0",
                initial_peers=(str(first.address),),
                heartbeat_s=1.0,
            )
        )
        try:
            # an offer changed while reach is still unknown survives the reach's publication
            second.transport.update_record(bandwidth=5e6)  # type: ignore[union-attr]
            for _ in range(200):
                if first.reach is Reach.DIRECT and second.reach is Reach.DIRECT:
                    break
                await asyncio.sleep(0.1)
            assert (first.reach, second.reach) == (Reach.DIRECT, Reach.DIRECT)
            record = second.transport.record()  # type: ignore[union-attr]
            assert record.extra["reach"] == "direct" and record.extra["relay"] is True
            assert record.bandwidth == 5e6
        finally:
            await second.close()
    finally:
        await first.close()


# ---- relays


async def test_a_stream_through_a_relay_stays_sealed_end_to_end() -> None:
    relay, hidden, caller = [await _transport(f"127.0.0.{i}") for i in (67, 68, 69)]
    service = RelayService(relay, RelayBudget(peers=1), lambda: True)
    hidden.add_stream("echo", _echo)
    link = RelayLink(hidden, relay.record(), hidden.bound_address)  # type: ignore[arg-type]
    try:
        relayed = await link.wait_ready(5.0)
        assert relayed.host == "127.0.0.67" and relayed.port != relay.port
        target = hidden.update_record(address=relayed)
        secret = b"only the two ends read this " * 1000
        async with caller.stream(target, "echo", {"n": 7}, _chunks([secret]), timeout=10) as s:
            assert s.header == {"echo": 7}
            got = b"".join([bytes(c) async for c in s])
        assert got == secret
        assert service.bytes_relayed >= 2 * len(secret)
        assert (await caller.fetch_info(relayed)).peer_id == hidden.identity.peer_id
        # the relay full: a second peer is refused, until the first one leaves
        assert service.relayed_peers == [hidden.identity.peer_id]
        other = RelayLink(caller, relay.record(), caller.bound_address)  # type: ignore[arg-type]
        with pytest.raises(TransportError):
            await other.wait_ready(5.0)
        await other.close()
        await link.close()
        for _ in range(100):
            if not service.relayed_peers:
                break
            await asyncio.sleep(0.05)
        assert service.relayed_peers == []
        link = RelayLink(hidden, relay.record(), hidden.bound_address)  # type: ignore[arg-type]
        await link.wait_ready(5.0)
        # the relay dies: the link says so
        await service.close()
        await relay.close()
        await asyncio.wait_for(link.done.wait(), 10)
    finally:
        await link.close()
        for t in (relay, hidden, caller):
            await t.close()


async def test_a_relay_drops_unknown_tokens_and_silent_connections() -> None:
    relay, hidden = await _transport("127.0.0.70"), await _transport("127.0.0.71")
    service = RelayService(relay, RelayBudget(peers=2), lambda: True)
    link = RelayLink(hidden, relay.record(), hidden.bound_address)  # type: ignore[arg-type]
    try:
        relayed = await link.wait_ready(5.0)
        reader, writer = await asyncio.open_connection(relayed.host, relayed.port)
        writer.write(MAGIC + bytes(16))  # a token nobody was given
        assert await asyncio.wait_for(reader.read(), 15) == b""
        writer.close()
        assert service.connections == 0
    finally:
        await link.close()
        await service.close()
        await relay.close()
        await hidden.close()


async def test_a_peer_that_cannot_relay_refuses() -> None:
    relay, hidden = await _transport("127.0.0.72"), await _transport("127.0.0.73")
    RelayService(relay, RelayBudget(peers=2), lambda: False)
    try:
        with pytest.raises(TransportError, match="does not relay"):
            await hidden.call(relay.record(), CONTROL_STREAM, {}, timeout=5)
    finally:
        await relay.close()
        await hidden.close()


def test_relay_budget_parse() -> None:
    assert RelayBudget.parse("3,80") == RelayBudget(peers=3, rate=10e6)
    assert not RelayBudget.parse("0").enabled
    for junk in ("", "x", "1,2,3", "-1", "2,0"):
        with pytest.raises(ConfigError):
            RelayBudget.parse(junk)


# ---- NAT-PMP messages and home addresses


def test_natpmp_answers_parse() -> None:
    answer = struct.pack("!BBHI4s", 0, 128, 0, 5, bytes([11, 0, 0, 101]))
    assert natpmp.parse_address_answer(answer) == "11.0.0.101"
    mapped = struct.pack("!BBHIHHI", 0, 130, 0, 5, 7000, 7001, 3600)
    m = natpmp.parse_mapping_answer(mapped, "tcp")
    assert (m.internal_port, m.external_port, m.lifetime_s) == (7000, 7001, 3600)
    refused = struct.pack("!BBHIHHI", 0, 129, 2, 5, 7000, 0, 0)
    with pytest.raises(PortMapError, match="refused"):
        natpmp.parse_mapping_answer(refused, "udp")
    with pytest.raises(PortMapError, match="opcode"):
        natpmp.parse_mapping_answer(mapped, "udp")  # a TCP answer to a UDP request


@given(st.binary(max_size=40))
def test_natpmp_hostile_answers_raise_one_error(data: bytes) -> None:
    for parse in (
        natpmp.parse_address_answer,
        lambda d: natpmp.parse_mapping_answer(d, "udp"),
        lambda d: natpmp.parse_mapping_answer(d, "tcp"),
    ):
        with contextlib.suppress(PortMapError):  # anything else fails the test
            parse(data)


NONCE = bytes(range(12))


def pcp_answer(
    result: int = 0,
    lifetime: int = 3600,
    nonce: bytes = NONCE,
    protocol: int = 6,
    ports: tuple[int, int] = (7000, 7001),
    external: str = "::ffff:11.0.0.101",
    op: int = 0x81,
) -> bytes:
    header = struct.pack("!BBxBII12x", 2, op, result, lifetime, 1234)
    payload = nonce + struct.pack("!B3xHH", protocol, *ports)
    return header + payload + ipaddress.IPv6Address(external).packed


def test_pcp_map_request_and_answers() -> None:
    request = pcp.map_request("udp", "192.168.1.2", 7000, 3600, NONCE)
    assert len(request) == 60 and request[:2] == bytes([2, 1])
    assert request[8:24] == ipaddress.IPv6Address("::ffff:192.168.1.2").packed
    assert request[24:36] == NONCE and request[36] == 17
    assert struct.unpack_from("!HH", request, 40) == (7000, 7000)
    m = pcp.parse_map_answer(pcp_answer(), "tcp", 7000, NONCE)
    assert (m.external_ip, m.external_port, m.lifetime_s) == ("11.0.0.101", 7001, 3600)
    removed = pcp.parse_map_answer(pcp_answer(lifetime=0, ports=(7000, 0)), "tcp", 7000, NONCE)
    assert removed.lifetime_s == 0
    wrong = {
        "refused: not authorized": pcp_answer(result=2),
        "another request": pcp_answer(nonce=bytes(12)),  # a stale or forged answer
        "NAT-PMP only": struct.pack("!BBHI", 0, 129, 1, 5),
        "opcode": pcp_answer(op=0x01),  # our own request reflected back
        "a mapping to": pcp_answer(external="2001:db8::1"),  # not an IPv4 gateway
        "61-byte": pcp_answer() + b"\0",  # options come in whole 4-byte units
    }
    for why, data in wrong.items():
        with pytest.raises(PortMapError, match=why):
            pcp.parse_map_answer(data, "tcp", 7000, NONCE)
    with pytest.raises(PortMapError, match="another request"):
        pcp.parse_map_answer(pcp_answer(), "udp", 7000, NONCE)  # a TCP answer to a UDP request
    with_option = pcp_answer() + b"\0" * 4  # an option the gateway added: ignored
    assert pcp.parse_map_answer(with_option, "tcp", 7000, NONCE).external_port == 7001
    assert pcp.is_answer(pcp_answer()) and pcp.is_answer(struct.pack("!BBHI", 0, 129, 1, 5))
    assert not pcp.is_answer(pcp_answer()[:59]) and not pcp.is_answer(b"\2" * 1104)


@given(st.binary(max_size=80), st.sampled_from(["udp", "tcp"]))
def test_pcp_hostile_answers_raise_one_error(data: bytes, protocol: str) -> None:
    with contextlib.suppress(PortMapError):  # anything else fails the test
        pcp.parse_map_answer(data, protocol, 7000, NONCE)


def test_port_mapping_methods_are_checked() -> None:
    internal = PeerAddress("192.168.1.2", 7000)
    assert PortMapper(internal).methods == ("upnp", "pcp", "natpmp")
    with pytest.raises(ValueError, match="methods"):
        PortMapper(internal, methods=("upnp", "stun"))


def test_gateway_guess() -> None:
    assert guess_gateway("192.168.7.23") == "192.168.7.1"
    assert guess_gateway("fd00::1") is None


def test_who_may_relay() -> None:
    identity = Identity.generate()

    def record(host: str, **extra: object) -> PeerRecord:
        return PeerRecord.create(identity, address=PeerAddress(host, 7000), run_id="r", extra=extra)

    assert may_relay(record("192.168.1.2", reach="direct", relay=True))
    assert may_relay(record("11.0.0.10", reach="unknown", relay=True))  # public, not checked yet
    assert not may_relay(record("192.168.1.2", reach="unknown", relay=True))  # may be NATed
    assert not may_relay(record("11.0.0.10", reach="relayed", relay=True))
    assert not may_relay(record("11.0.0.10", reach="direct", relay=False))
    assert not may_relay(record("11.0.0.10", reach="direct"))


def test_home_addresses() -> None:
    assert is_home_address("192.168.1.2") and is_home_address("10.1.2.3")
    assert is_home_address("172.20.0.1") and is_home_address("fd00::1")
    assert not is_home_address("127.0.0.1") and not is_home_address("11.0.0.10")
    assert not is_home_address("example.org")


# ---- hostile helpers and relays


@pytest.mark.parametrize(
    "answer",
    [{}, {"host": 5, "tcp": True, "udp": True}, {"host": "a b", "tcp": True, "udp": False}],
)
async def test_a_malformed_dialback_answer_is_refused(answer: dict) -> None:
    liar, asker = await _transport("127.0.0.74"), await _transport("127.0.0.75")

    async def lie(sender: object, payload: dict) -> dict:
        return answer

    liar.add_rpc("reach.dialback", lie)
    try:
        with pytest.raises(TransportError, match="dialback"):
            await request_dialback(asker, liar.record(), asker.port, host="127.0.0.75")
    finally:
        await asker.close()
        await liar.close()


@pytest.mark.parametrize("header, chunks", [({"port": "80"}, []), ({"port": 9}, [b"junk"])])
async def test_a_hostile_relay_ends_the_link(header: dict, chunks: list[bytes]) -> None:
    fake, hidden = await _transport("127.0.0.76"), await _transport("127.0.0.77")

    async def control(request: InboundStream, reply: ReplyStream) -> None:
        await reply.prepare(header)
        for chunk in chunks:
            await reply.write(chunk)

    fake.add_stream(CONTROL_STREAM, control)
    link = RelayLink(hidden, fake.record(), hidden.bound_address)  # type: ignore[arg-type]
    try:
        await asyncio.wait_for(link.done.wait(), 10)
        assert link.error and link.error != "the relay closed the control stream"
    finally:
        await link.close()
        await fake.close()
        await hidden.close()


def test_cli_flags_for_port_mapping_and_relays(monkeypatch: pytest.MonkeyPatch) -> None:
    from swarm.cli import apply_environment, build_parser

    def parse(argv: list[str]) -> argparse.Namespace:
        parser = build_parser()
        args = parser.parse_args(argv)
        apply_environment(parser, args)
        return args

    monkeypatch.delenv("SWARM_NO_PORT_MAPPING", raising=False)
    monkeypatch.delenv("SWARM_RELAY_BUDGET", raising=False)
    args = parse([])
    assert args.relay_budget == RelayBudget(peers=4) and not args.no_port_mapping
    args = parse(["--relay-budget", "2,40", "--no-port-mapping"])
    assert args.relay_budget == RelayBudget(peers=2, rate=5e6) and args.no_port_mapping
    monkeypatch.setenv("SWARM_NO_PORT_MAPPING", "1")
    monkeypatch.setenv("SWARM_RELAY_BUDGET", "0")
    args = parse([])
    assert args.no_port_mapping and not args.relay_budget.enabled
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--relay-budget", "lots"])
    assert exit_info.value.code == 2
