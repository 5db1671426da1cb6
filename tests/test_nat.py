"""Peers behind real NATs: iptables MASQUERADE routers and miniupnpd in network namespaces.

Linux as root with iptables (and miniupnpd for the UPnP case); skipped elsewhere, with the reason.
Every peer is a real process in its own namespace (tests/nat_topology.py).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from nat_topology import NatTopology, nat_unavailable
from processes import OutputProcess, child_env

HERE = Path(__file__).resolve().parent
PEER = [sys.executable, "-m", "swarm.cli", "--heartbeat", "1", "--log-level", "INFO"]
WORKER = [sys.executable, str(HERE / "averaging_worker.py")]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _skip_unless(upnp: bool = False) -> None:
    if (why := nat_unavailable(upnp)) is not None:
        pytest.skip(why)


@pytest.fixture
def processes():
    started: list[OutputProcess] = []

    def start(argv: list[str]) -> OutputProcess:
        p = OutputProcess(argv)
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()


def _peer(host, start, *args: str) -> tuple[OutputProcess, str]:
    p = start(host.argv([*PEER, "--listen", f"{host.ip}:0", *args]))
    address = p.wait_for(r"others join with: --initial-peers (\S+)", 60)[1]
    return p, address


def peers_table(host, bootstrap: str, run_id: str = "default") -> dict[str, list[str]]:
    """``swarm-peer peers`` run in ``host``'s namespace: {peer short id: [address, reach, ...]}."""
    argv = [sys.executable, "-m", "swarm.cli", "peers", "--initial-peers", bootstrap]
    argv += ["--listen", f"{host.ip}:0", "--run-id", run_id]
    done = subprocess.run(
        host.argv(argv),
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
        cwd=HERE.parent,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:3] == ["PEER", "ADDRESS", "REACHABLE"], done.stdout
    return {line.split()[0]: line.split()[1:] for line in lines[1:-1]}


def _short(process: OutputProcess) -> str:
    return process.wait_for(r"peer \S+ \((\S+)\) is up")[1]


def test_a_peer_behind_a_upnp_router_maps_its_port_and_is_dialed_directly(processes) -> None:
    _skip_unless(upnp=True)
    with NatTopology(public=1, routers=[True]) as net:
        public, home, router = net.public[0], net.homes[0], net.routers[0]
        _, bootstrap = _peer(public, processes)
        behind, _ = _peer(home, processes, "--initial-peers", bootstrap)
        m = behind.wait_for(r"reachable \(mapped\) at (\S+): (\S+) dialed us back", 60)
        mapped = m[1]
        assert mapped.startswith(f"{router.wan_ip}:"), behind.output()
        port = mapped.rsplit(":", 1)[1]
        assert f"--dport {port}" in net.mappings(router), net.mappings(router)
        table = peers_table(public, bootstrap)
        assert table[_short(behind)][:2] == [mapped, "mapped"], table
        # the public peer dials the mapped address itself: a fresh TCP connection through the
        # router's forwarding reaches the peer behind it
        probe = subprocess.run(
            public.argv(
                [
                    sys.executable,
                    "-c",
                    "import socket,sys; socket.create_connection(sys.argv[1:3], 5)",
                ]
            )
            + mapped.split(":"),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert probe.returncode == 0, probe.stderr
        behind.proc.send_signal(signal.SIGINT)  # a clean exit removes the mapping
        behind.proc.wait(timeout=30)
        assert f"--dport {port}" not in net.mappings(router), behind.output()


MAP_ONCE = """
import asyncio, sys
from swarm.address import PeerAddress
from swarm.net.portmap import PortMapper

async def main():
    mapper = PortMapper(PeerAddress(sys.argv[1], int(sys.argv[2])), methods=(sys.argv[3],))
    mapping = await mapper.map()
    print("MAPPED", mapping.method, mapping.external, mapping.lease_s, flush=True)
    sys.stdin.readline()  # the test looks at the router's rules meanwhile
    await mapper.close()
    print("REMOVED", flush=True)

asyncio.run(main())
"""


def test_a_router_without_upnp_maps_through_pcp_or_nat_pmp(processes) -> None:
    """miniupnpd with UPnP off: PCP and NAT-PMP each map both protocols and remove them; a peer
    behind that router maps through PCP and is dialed directly."""
    _skip_unless(upnp=True)
    with NatTopology(public=1, routers=["pmp"]) as net:
        home, router = net.homes[0], net.routers[0]
        for method, port in (("natpmp", 40001), ("pcp", 40002)):
            argv = [sys.executable, "-c", MAP_ONCE, home.ip, str(port), method]
            once = subprocess.Popen(
                home.argv(argv),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=child_env(),
                cwd=HERE.parent,
            )
            try:
                line = once.stdout.readline().split()
                assert line[:3] == ["MAPPED", method, f"{router.wan_ip}:{port}"], (line, once)
                assert int(line[3]) > 0, line
                rules = net.mappings(router)
                assert rules.count(f"--dport {port}") == 2, rules  # TCP and UDP
                out, _ = once.communicate("\n", timeout=30)
            finally:
                once.kill()
            assert "REMOVED" in out, out
            assert f"--dport {port}" not in net.mappings(router), net.mappings(router)
        _, bootstrap = _peer(net.public[0], processes)
        behind, _ = _peer(home, processes, "--initial-peers", bootstrap)
        m = behind.wait_for(r"reachable \(mapped\) at (\S+): (\S+) dialed us back", 60)
        assert m[1].startswith(f"{router.wan_ip}:"), behind.output()
        assert re.search(r"router mapped \S+ to \S+ \(pcp, lease", behind.output())


def test_no_port_mapping_leaves_the_router_alone_and_says_why(processes) -> None:
    _skip_unless(upnp=True)
    with NatTopology(public=1, routers=[True]) as net:
        _, bootstrap = _peer(net.public[0], processes)
        behind, _ = _peer(
            net.homes[0], processes, "--initial-peers", bootstrap, "--no-port-mapping"
        )
        m = behind.wait_for(r"behind NAT, no port mapping \((.*)\), relayed through (\S+)", 60)
        assert m[1] == "port mapping turned off", behind.output()
        assert "--dport" not in net.mappings(net.routers[0])


def test_two_peers_behind_nat_are_relayed_and_average_correctly(processes, tmp_path) -> None:
    _skip_unless()
    numel = 200_000
    with NatTopology(public=1, routers=[False, False]) as net:
        hosts = [net.public[0], *net.homes]
        common = ["--wait-peers", "3", "--wait-reachable", "3", "--min-group", "3"]
        common += ["--target-group", "3", "--numel", str(numel), "--matchmaking-timeout", "20"]
        common += ["--linger", "60"]  # the swarm stays up for swarm-peer peers
        workers, bootstrap = [], None
        for rank, host in enumerate(hosts):
            argv = [*WORKER, *common, "--seed", str(rank + 1), "--listen", f"{host.ip}:0"]
            argv += ["--out", str(tmp_path / f"peer{rank}.pt")]
            argv += ["--initial-peers", bootstrap] if bootstrap else []
            workers.append(processes(host.argv(argv)))
            if bootstrap is None:
                bootstrap = workers[0].wait_for(r"^ADDRESS (\S+)", 60)[1]
        for w in workers:
            w.wait_for("^DONE", 180)
        ids = [w.wait_for(r"^ID (\S+)")[1] for w in workers]
        from averaging_worker import make_tensor

        want = sum(make_tensor(rank + 1, numel).double() for rank in range(3)) / 3
        for rank, w in enumerate(workers):
            (report,) = w.rounds()
            assert report["averaged"], report
            assert all(sorted(p) == sorted(ids) for p in report["parts"].values()), report
            assert len(report["parts"]) == 3, report
            got = torch.load(tmp_path / f"peer{rank}.pt")["none"]["last"]
            assert float((got.double() - want).abs().max()) <= 1e-5
        # both see each other as relayed, through the public peer
        for home in net.homes:
            table = peers_table(home, bootstrap, run_id="avg-test")
            reach = {peer: row[1] for peer, row in table.items()}
            assert sorted(reach.values()) == ["direct", "relayed", "relayed"], table
            for row in table.values():
                if row[1] == "relayed":
                    assert row[0].startswith(f"{net.public[0].ip}:"), table


def test_a_dead_relay_is_replaced(processes) -> None:
    _skip_unless()
    with NatTopology(public=2, routers=[False]) as net:
        first, bootstrap = _peer(net.public[0], processes)
        second, _ = _peer(net.public[1], processes, "--initial-peers", bootstrap)
        second.wait_for(r"reachable \(direct\)", 60)
        behind, _ = _peer(net.homes[0], processes, "--initial-peers", bootstrap)
        # both relays linked (one announced, one standby) before the announced one dies
        m = behind.wait_for(r"relayed through (\S+) at (\S+)", 60)
        relay_host = m[2].rsplit(":", 1)[0]
        relays = {net.public[0].ip: first, net.public[1].ip: second}
        survivor_host = next(h for h in relays if h != relay_host)
        relays[survivor_host].wait_for(r"relaying for", 30)  # the standby link is up
        seen = len(behind.lines)
        relays[relay_host].kill()
        # the bound: the standby takes over as soon as the control stream breaks (at once for a
        # killed process; after 12 s of silence for a vanished machine), announced at once
        pattern = re.compile(rf"relayed through \S+ at {re.escape(survivor_host)}:\d+")
        behind.wait_for(pattern, 20)
        assert any(pattern.search(line) for line in behind.lines[seen:]), behind.output()
        survivor_address = next(
            line.split("--initial-peers ")[1]
            for line in relays[survivor_host].lines
            if "others join with" in line
        )
        short = _short(behind)
        survivor = next(h for h in net.public if h.ip == survivor_host)
        for _ in range(10):
            table = peers_table(survivor, survivor_address)
            if table.get(short, [""])[0].startswith(survivor_host + ":"):
                break
            time.sleep(1)
        assert table[short][0].startswith(survivor_host + ":"), table
        assert table[short][1] == "relayed", table


TRAINER = [sys.executable, str(HERE / "training_worker.py")]


def _train(hosts, processes, tmp_path, tag: str) -> list[float]:
    """Four training peers, one per host, rank 0 first; the loss after every round of rank 0."""
    common = ["--shards", "4", "--inner-steps", "10", "--batch", "16", "--lr", "0.1"]
    common += ["--rounds", "12", "--wait-peers", "4", "--wait-reachable", "4", "--min-group", "4"]
    common += ["--matchmaking-timeout", "20", "--linger", "5"]
    workers, bootstrap = [], None
    for rank, host in enumerate(hosts):
        argv = [*TRAINER, *common, "--rank", str(rank), "--listen", f"{host.ip}:0"]
        argv += ["--out", str(tmp_path / f"{tag}{rank}.pt")]
        argv += ["--initial-peers", bootstrap] if bootstrap else []
        workers.append(processes(host.argv(argv)))
        if bootstrap is None:
            bootstrap = workers[0].wait_for(r"^ADDRESS (\S+)", 60)[1]
    for w in workers:
        w.wait_for("^DONE", 220)
    rounds = workers[0].rounds()
    assert sum(r["averaged"] and r["group"] == 4 for r in rounds) >= len(rounds) - 1, rounds
    return [r["loss"] for r in rounds]


def test_four_peers_two_behind_nat_train_like_four_public(processes, tmp_path) -> None:
    _skip_unless()
    with NatTopology(public=4, routers=[False, False]) as net:
        public = _train(net.public, processes, tmp_path, "pub")
        mixed = _train([*net.public[:2], *net.homes], processes, tmp_path, "nat")
    # same data, seeds and exact averaging: the relayed run follows the same loss curve
    assert mixed[-1] <= 1.05 * public[-1] + 1e-4, (mixed, public)
    assert public[-1] < 0.5 * public[0] and mixed[-1] < 0.5 * mixed[0], (mixed, public)
