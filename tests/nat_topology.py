"""Real NATs for tests: home namespaces behind router namespaces on one "internet" bridge.

Linux, as root. :class:`NatTopology` builds, and removes again on exit (also on error):

- an ``inet`` namespace holding the bridge ``br0`` that plays the internet (11.0.0.0/24: a
  globally routed range, because miniupnpd refuses to map ports on a private or reserved WAN
  address; the namespaces have no route out, so no packet ever leaves them);
- public hosts: a namespace each, on the bridge at ``11.0.0.(10+i)``;
- routers: a namespace each, WAN side on the bridge at ``11.0.0.(100+r)``, LAN side
  ``192.168.(r+1).1/24``, forwarding, ``iptables -t nat ... MASQUERADE`` out of the WAN side;
  with ``upnp=True``, ``miniupnpd`` (UPnP-IGD, and PCP and NAT-PMP on port 5351) listens on
  the LAN side; with ``upnp="pmp"``, miniupnpd with UPnP turned off (PCP and NAT-PMP only);
- one home namespace behind each router at ``192.168.(r+1).2``, default route via the router.

Commands run in a namespace through :meth:`Host.argv`. Address space is private to the namespaces
the topology creates; nothing touches the host's own interfaces.

    with NatTopology(public=1, routers=[False, True]) as net:
        net.public[0].argv(["swarm-peer", ...]); net.homes[1].ip
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_COUNTER = itertools.count()
INTERNET = "11.0.0"


def iptables() -> str:
    """miniupnpd's iptables backend uses the legacy tables; the routers use them too."""
    return "iptables-legacy" if shutil.which("iptables-legacy") else "iptables"


def _sh(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")


def nat_unavailable(upnp: bool = False) -> str | None:
    """None when :class:`NatTopology` can run here, else why not (a skip reason)."""
    if not sys.platform.startswith("linux"):
        return "real NATs need Linux network namespaces"
    if os.geteuid() != 0:
        return "real NATs need root (ip netns, iptables)"
    for tool in ("ip", iptables()) + (("miniupnpd",) if upnp else ()):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install iptables miniupnpd-iptables)"
    name = f"swchk{os.getpid() % 100000}"
    try:
        _sh("ip", "netns", "add", name)
        _sh("ip", "netns", "exec", name, iptables(), "-t", "nat", "-L", "-n")
    except RuntimeError as e:
        return f"network namespaces or iptables do not work here: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


@dataclass(frozen=True)
class Host:
    """A namespace with one address others (or its router) can reach."""

    ns: str  # namespace name
    ip: str  # its address: public on the bridge, or 192.168.x.2 behind a router

    def argv(self, command: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *command]

    def run(self, *command: str) -> None:
        _sh(*self.argv(list(command)))


@dataclass(frozen=True)
class Router:
    """A home router: ``wan_ip`` on the bridge, MASQUERADE, maybe miniupnpd."""

    ns: str
    wan_ip: str
    lan_ip: str
    upnp: bool | str  # False: plain MASQUERADE; True: miniupnpd; "pmp": miniupnpd without UPnP


class NatTopology:
    """Public hosts, and home hosts behind routers (``routers[r]``: r's :attr:`Router.upnp`)."""

    def __init__(
        self,
        public: int = 1,
        routers: list[bool | str] | tuple[bool | str, ...] = (),
        rate_mbit: int | None = None,
    ):
        self.rate_mbit = rate_mbit  # tbf on every link to the bridge, both ways (benchmarks)
        self.prefix = f"sw{os.getpid() % 10000}n{next(_COUNTER)}"
        self._n_public = public
        self._router_upnp = list(routers)
        self.public: list[Host] = []
        self.routers: list[Router] = []
        self.homes: list[Host] = []
        self._namespaces: list[str] = []
        self._daemons: list[subprocess.Popen[bytes]] = []
        self._tmp = Path(tempfile.mkdtemp(prefix="swarm-nat-"))

    def __enter__(self) -> NatTopology:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _ns(self, name: str) -> str:
        ns = f"{self.prefix}{name}"
        _sh("ip", "netns", "add", ns)
        self._namespaces.append(ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        return ns

    def _build(self) -> None:
        inet = self._ns("i")
        _sh("ip", "-n", inet, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", inet, "link", "set", "br0", "up")
        for i in range(self._n_public):
            ns = self._ns(f"p{i}")
            ip = f"{INTERNET}.{10 + i}"
            self._wire(inet, f"p{i}", ns, "eth0")
            _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            self.public.append(Host(ns, ip))
        for r, upnp in enumerate(self._router_upnp):
            rns, hns = self._ns(f"r{r}"), self._ns(f"h{r}")
            wan_ip, lan_ip, home_ip = f"{INTERNET}.{100 + r}", f"192.168.{r + 1}.1", None
            self._wire(inet, f"r{r}", rns, "wan")
            _sh("ip", "-n", rns, "addr", "add", f"{wan_ip}/24", "dev", "wan")
            _sh("ip", "-n", rns, "link", "add", "lan", "type", "veth", "peer", "eth0", "netns", hns)
            _sh("ip", "-n", rns, "addr", "add", f"{lan_ip}/24", "dev", "lan")
            _sh("ip", "-n", rns, "link", "set", "lan", "up")
            home_ip = f"192.168.{r + 1}.2"
            _sh("ip", "-n", hns, "addr", "add", f"{home_ip}/24", "dev", "eth0")
            _sh("ip", "-n", hns, "link", "set", "eth0", "up")
            _sh("ip", "-n", hns, "route", "add", "default", "via", lan_ip)
            run = ["ip", "netns", "exec", rns]
            _sh(*run, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
            _sh(*run, iptables(), "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")
            router = Router(rns, wan_ip, lan_ip, upnp)
            if upnp:
                self._start_miniupnpd(router)
            self.routers.append(router)
            self.homes.append(Host(hns, home_ip))

    def _wire(self, inet: str, name: str, ns: str, inner: str) -> None:
        """A veth from the bridge in ``inet`` to interface ``inner`` in ``ns``."""
        _sh("ip", "-n", inet, "link", "add", name, "type", "veth", "peer", inner, "netns", ns)
        _sh("ip", "-n", inet, "link", "set", name, "master", "br0", "up")
        _sh("ip", "-n", ns, "link", "set", inner, "up")
        if self.rate_mbit:
            tbf = ["tbf", "rate", f"{self.rate_mbit}mbit", "burst", "128kb", "latency", "100ms"]
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", inner, "root", *tbf)
            _sh("ip", "netns", "exec", inet, "tc", "qdisc", "add", "dev", name, "root", *tbf)

    def _start_miniupnpd(self, router: Router) -> None:
        run = ["ip", "netns", "exec", router.ns, iptables()]
        # the chains miniupnpd fills (what its iptables_init.sh sets up)
        _sh(*run, "-t", "nat", "-N", "MINIUPNPD")
        _sh(*run, "-t", "nat", "-I", "PREROUTING", "-i", "wan", "-j", "MINIUPNPD")
        _sh(*run, "-t", "nat", "-N", "MINIUPNPD-POSTROUTING")
        _sh(*run, "-t", "nat", "-I", "POSTROUTING", "-o", "wan", "-j", "MINIUPNPD-POSTROUTING")
        _sh(*run, "-t", "filter", "-N", "MINIUPNPD")
        _sh(*run, "-t", "filter", "-I", "FORWARD", "-i", "wan", "!", "-o", "wan", "-j", "MINIUPNPD")
        _sh(*run, "-t", "mangle", "-N", "MINIUPNPD")
        _sh(*run, "-t", "mangle", "-I", "PREROUTING", "-i", "wan", "-j", "MINIUPNPD")
        conf = self._tmp / f"{router.ns}.conf"
        conf.write_text(
            "\n".join(
                [
                    "ext_ifname=wan",
                    f"ext_ip={router.wan_ip}",
                    "listening_ip=lan",
                    "port=0",
                    "enable_natpmp=yes",
                    f"enable_upnp={'no' if router.upnp == 'pmp' else 'yes'}",
                    "secure_mode=yes",
                    "system_uptime=yes",
                    "notify_interval=60",
                    "clean_ruleset_interval=600",
                    "uuid=3d3cec3a-8cf0-11e0-98ee-001a6bd2d07b",
                    "allow 1024-65535 192.168.0.0/16 1024-65535",
                    "deny 0-65535 0.0.0.0/0 0-65535",
                    "",
                ]
            )
        )
        pid_file = str(self._tmp / f"{router.ns}.pid")
        with open(self._tmp / f"{router.ns}.log", "wb") as log:
            daemon = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    router.ns,
                    "miniupnpd",
                    "-d",
                    "-f",
                    str(conf),
                    "-P",
                    pid_file,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._daemons.append(daemon)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # up once it listens for NAT-PMP on the LAN side
            done = subprocess.run(
                ["ip", "netns", "exec", router.ns, "ss", "-uln"], capture_output=True, text=True
            )
            if f"{router.lan_ip}:5351" in done.stdout or ":5351 " in done.stdout:
                return
            if daemon.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError("miniupnpd did not start:\n" + self.daemon_log(router))

    def daemon_log(self, router: Router) -> str:
        path = self._tmp / f"{router.ns}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def mappings(self, router: Router) -> str:
        """The router's port mappings (its MINIUPNPD nat chain), for assertions and messages."""
        done = subprocess.run(
            ["ip", "netns", "exec", router.ns, iptables(), "-t", "nat", "-S", "MINIUPNPD"],
            capture_output=True,
            text=True,
        )
        return done.stdout

    def close(self) -> None:
        for daemon in self._daemons:
            if daemon.poll() is None:
                daemon.terminate()
                try:
                    daemon.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait(timeout=5)
        self._daemons.clear()
        for ns in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._namespaces.clear()
        shutil.rmtree(self._tmp, ignore_errors=True)
