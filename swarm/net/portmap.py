"""Port mapping on the home router: UPnP-IGD first, then PCP, then NAT-PMP.

UPnP-IGD goes through ``async-upnp-client`` (pure Python on aiohttp, so it installs everywhere
swarm does, asyncio-native, and kept up as Home Assistant's UPnP layer); PCP (RFC 6887) and its
predecessor NAT-PMP (RFC 6886) are single datagrams to the gateway's port 5351, handled in
:mod:`swarm.net.pcp` and :mod:`swarm.net.natpmp`. A gateway that speaks neither is silent on
that port, so NAT-PMP is only tried when PCP got an answer (a NAT-PMP gateway answers a PCP
request with its version 0). One port number is mapped for both TCP (HTTP) and UDP (the DHT),
for ``lease_s``, renewed at half the lease, and removed on close.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
from dataclasses import dataclass
from typing import Any

from swarm.address import PeerAddress
from swarm.errors import PortMapError
from swarm.net import natpmp, pcp

logger = logging.getLogger(__name__)

DESCRIPTION = "swarm peer"
_PROTOCOLS = ("tcp", "udp")
SSDP_WAIT_S = 2  # seconds a UPnP search listens for gateways (SSDP MX)
METHODS = ("upnp", "pcp", "natpmp")  # in the order they are tried


@dataclass(frozen=True)
class PortMapping:
    """A mapping the router granted."""

    method: str  # "upnp", "pcp" or "natpmp"
    external: PeerAddress  # the router's public address and the mapped port
    internal: PeerAddress  # our LAN address and port
    lease_s: int  # seconds the router keeps it without a renewal


def is_home_address(host: str) -> bool:
    """Whether ``host`` is a private LAN address behind a router (RFC 1918 / unique local)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if address.version == 4:
        return any(address in net for net in _RFC1918)
    return address in ipaddress.ip_network("fc00::/7")


_RFC1918 = tuple(ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"))


def default_gateway() -> str | None:
    """The IPv4 default gateway from ``/proc/net/route`` (Linux); None elsewhere."""
    try:
        with open("/proc/net/route", encoding="ascii") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 2 and fields[1] == "00000000":
            return str(ipaddress.IPv4Address(bytes.fromhex(fields[2])[::-1]))
    return None


def guess_gateway(host: str) -> str | None:
    """Where no routing table can be read (Windows, macOS): ``.1`` of our /24, the usual one."""
    try:
        address = ipaddress.IPv4Address(host)
    except ValueError:
        return None
    return str(ipaddress.IPv4Network(f"{address}/24", strict=False).network_address + 1)


class PortMapper:
    """Maps ``internal`` (our LAN ``IP:PORT``) on the router and keeps the mapping alive.

    Args:
        internal: the address the peer is bound to (a specific LAN address, not a wildcard).
        lease_s: lease asked for; renewed at half of what the router grants.
        timeout: seconds for discovery and for each router request.
        methods: the protocols to try, in order (a subset of :data:`METHODS`).
    """

    def __init__(
        self,
        internal: PeerAddress,
        *,
        lease_s: int = 3600,
        timeout: float = 3.0,
        methods: tuple[str, ...] = METHODS,
    ):
        if not methods or not set(methods) <= set(METHODS):
            raise ValueError(f"port mapping methods must be some of {METHODS}, not {methods}")
        self.internal = internal
        self.lease_s = lease_s
        self.timeout = timeout
        self.methods = methods
        self.mapping: PortMapping | None = None
        self._device: Any = None
        self._gateway: str | None = None
        self._nonce = os.urandom(pcp.NONCE_BYTES)  # names our PCP mappings in renewals
        self._renewal: asyncio.Task[None] | None = None

    async def map(self) -> PortMapping:
        """Ask the router for a mapping (UPnP, then PCP, then NAT-PMP); start renewing it.

        Raises:
            PortMapError: none works; the message says what each answered.
        """
        reasons = []
        for name in self.methods:
            if name == "natpmp" and any(r.startswith("PCP: no answer") for r in reasons):
                continue  # the port PCP found silent is NAT-PMP's too
            try:
                self.mapping = await self._map_with(name)
            except (PortMapError, OSError, TimeoutError) as e:
                reasons.append(str(e) or type(e).__name__)
                continue
            except Exception as e:  # a malformed device description from the router
                reasons.append(f"{name}: {type(e).__name__}: {e}")
                continue
            self._renewal = asyncio.create_task(self._renew_loop(), name="swarm-portmap-renew")
            logger.info(
                "router mapped %s to %s (%s, lease %d s)",
                self.mapping.external,
                self.internal,
                self.mapping.method,
                self.mapping.lease_s,
            )
            return self.mapping
        raise PortMapError("; ".join(reasons))

    async def _map_with(self, method: str) -> PortMapping:
        return await getattr(self, f"_map_{method}")()

    # ---- UPnP-IGD

    async def _map_upnp(self, lease_s: int | None = None) -> PortMapping:
        from async_upnp_client.aiohttp import AiohttpRequester
        from async_upnp_client.client_factory import UpnpFactory
        from async_upnp_client.profiles.igd import IgdDevice

        if self._device is None:
            found = await IgdDevice.async_search(
                source=(self.internal.host, 0), timeout=SSDP_WAIT_S
            )
            locations = sorted({str(r["location"]) for r in found if "location" in r})
            if not locations:
                raise PortMapError("UPnP: no Internet Gateway Device answered")
            factory = UpnpFactory(AiohttpRequester(timeout=max(1, int(self.timeout))))
            self._device = await factory.async_create_device(locations[0])
        lease = self.lease_s if lease_s is None else lease_s
        address = await self._upnp_call("GetExternalIPAddress")
        external_ip = address.get("NewExternalIPAddress")
        if not external_ip:
            raise PortMapError("UPnP: the router did not tell its external address")
        for protocol in _PROTOCOLS:
            # NewRemoteHost "" means any remote host ("0.0.0.0" would mean that one address)
            await self._upnp_call(
                "AddPortMapping",
                NewRemoteHost="",
                NewExternalPort=self.internal.port,
                NewProtocol=protocol.upper(),
                NewInternalPort=self.internal.port,
                NewInternalClient=self.internal.host,
                NewEnabled=True,
                NewPortMappingDescription=DESCRIPTION,
                NewLeaseDuration=lease,
            )
        return PortMapping(
            "upnp", PeerAddress(external_ip, self.internal.port), self.internal, lease
        )

    async def _upnp_call(self, name: str, **arguments: Any) -> dict[str, Any]:
        """Call ``name`` on the device's WANIPConnection (or WANPPPConnection) service."""
        device = self._device
        services = [
            s
            for s in device.all_services  # type: ignore[attr-defined]
            if "WANIPConnection" in s.service_type or "WANPPPConnection" in s.service_type
        ]
        for service in services:
            if service.has_action(name):
                try:
                    return dict(await service.action(name).async_call(**arguments))
                except Exception as e:  # the library raises its own UpnpError tree
                    raise PortMapError(f"UPnP: router refused {name}: {e}") from e
        raise PortMapError(f"UPnP: the router offers no {name}")

    # ---- PCP

    async def _map_pcp(self, lease_s: int | None = None) -> PortMapping:
        lease = self.lease_s if lease_s is None else lease_s
        granted = [await self._pcp_map(protocol, lease) for protocol in _PROTOCOLS]
        ports = {g.external_port for g in granted}
        addresses = {g.external_ip for g in granted}
        if len(ports) != 1 or len(addresses) != 1:  # one HOST:PORT for TCP and UDP
            await self._remove_pcp()
            raise PortMapError(f"PCP: router gave different addresses for TCP and UDP: {granted}")
        lease = min(g.lifetime_s for g in granted)
        external = PeerAddress(addresses.pop(), ports.pop())
        return PortMapping("pcp", external, self.internal, lease)

    async def _pcp_map(self, protocol: str, lease_s: int) -> pcp.MapAnswer:
        host, port = self.internal.host, self.internal.port
        request = pcp.map_request(protocol, host, port, lease_s, self._nonce)
        answer = await natpmp.exchange(
            self._gateway_address("PCP"),
            request,
            local_host=host,
            accept=pcp.is_answer,
            protocol_name="PCP",
        )
        return pcp.parse_map_answer(answer, protocol, port, self._nonce)

    async def _remove_pcp(self) -> None:
        for protocol in _PROTOCOLS:
            await self._pcp_map(protocol, 0)

    # ---- NAT-PMP

    def _gateway_address(self, protocol_name: str) -> str:
        gateway = self._gateway or default_gateway() or guess_gateway(self.internal.host)
        if gateway is None:
            raise PortMapError(f"{protocol_name}: no default gateway found")
        self._gateway = gateway
        return gateway

    async def _map_natpmp(self, lease_s: int | None = None) -> PortMapping:
        gateway = self._gateway_address("NAT-PMP")
        host = self.internal.host
        answer = await natpmp.exchange(
            gateway, natpmp.address_request(), local_host=host, answer_size=12
        )
        external_ip = natpmp.parse_address_answer(answer)
        lease = self.lease_s if lease_s is None else lease_s
        granted = []
        for protocol in _PROTOCOLS:
            request = natpmp.mapping_request(
                protocol, self.internal.port, self.internal.port, lease
            )
            answer = await natpmp.exchange(gateway, request, local_host=host, answer_size=16)
            granted.append(natpmp.parse_mapping_answer(answer, protocol))
        ports = {g.external_port for g in granted}
        if len(ports) != 1:  # TCP and UDP must share one port number (one HOST:PORT)
            await self._remove_natpmp()
            raise PortMapError(f"NAT-PMP: router gave different ports for TCP and UDP: {ports}")
        lease = min(g.lifetime_s for g in granted)
        return PortMapping("natpmp", PeerAddress(external_ip, ports.pop()), self.internal, lease)

    async def _remove_natpmp(self) -> None:
        if self._gateway is None:
            raise PortMapError("NAT-PMP: nothing was mapped")
        for protocol in _PROTOCOLS:
            request = natpmp.mapping_request(protocol, self.internal.port, 0, 0)
            await natpmp.exchange(
                self._gateway, request, local_host=self.internal.host, answer_size=16
            )

    # ---- lifetime

    async def _renew_loop(self) -> None:
        while self.mapping is not None:
            await asyncio.sleep(max(30.0, self.mapping.lease_s / 2))
            try:
                renewed = await self._map_with(self.mapping.method)
            except Exception as e:  # keep the old one; the router may still honour it
                logger.warning("could not renew the port mapping %s: %s", self.mapping.external, e)
                continue
            if renewed.external != self.mapping.external:
                logger.warning("the router moved our mapping to %s", renewed.external)
            self.mapping = renewed

    async def close(self) -> None:
        """Stop renewing and remove the mapping from the router (best effort, bounded)."""
        if self._renewal is not None:
            self._renewal.cancel()
            await asyncio.gather(self._renewal, return_exceptions=True)
            self._renewal = None
        mapping, self.mapping = self.mapping, None
        if mapping is None:
            return
        try:
            async with asyncio.timeout(self.timeout):
                if mapping.method == "upnp":
                    for protocol in _PROTOCOLS:
                        await self._upnp_call(
                            "DeletePortMapping",
                            NewRemoteHost="",
                            NewExternalPort=mapping.external.port,
                            NewProtocol=protocol.upper(),
                        )
                elif mapping.method == "pcp":
                    await self._remove_pcp()
                else:
                    await self._remove_natpmp()
        except Exception as e:  # the router may be gone; the lease ends the mapping anyway
            logger.warning("could not remove the port mapping %s: %s", mapping.external, e)
        else:
            logger.info("removed the port mapping %s", mapping.external)
