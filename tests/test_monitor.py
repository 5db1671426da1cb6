"""Seeing the swarm: `swarm-peer status`, leave markers, join/leave lines, /metrics, dashboard.

Three AsyncSwarm peers train on the test's loop (real sockets on loopback); the status command
runs as a real child process, the dashboard page in a real headless Chromium when installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import shutil
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import torch
from processes import ROOT, OutputProcess, child_env
from prometheus_client.parser import text_string_to_metric_families

from swarm.address import PeerAddress
from swarm.api import AsyncSwarm
from swarm.dashboard.status import RunReader, add_weight_views, format_table, totals
from swarm.dashboard.web import Dashboard
from swarm.monitor import tracker
from swarm.monitor.watch import PeerWatcher
from swarm.net.progress import Resources

HEARTBEAT_S = 5.0  # records expire after 15 s: a leaver still listed after close() is a failure
OPTIONS = {
    "listen": "127.0.0.1:0",
    "codec": "none",
    "inner_steps": 2,
    "matchmaking_timeout_s": 5.0,
    "round_timeout_s": 60.0,
    "heartbeat_s": HEARTBEAT_S,
    "sync_on_join": False,
}


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


async def train(swarm: AsyncSwarm, seed: int, steps: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 6, generator=g)
        loss = (swarm.model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        await swarm.step(samples=16, loss=loss.detach())
        swarm.optimizer.zero_grad()


async def train_all(swarms: list[AsyncSwarm], steps: int) -> None:
    await asyncio.gather(*(train(s, i + 10 * s.round, steps) for i, s in enumerate(swarms)))
    await asyncio.gather(*(s.wait_round() for s in swarms))  # land rounds still in flight
    # publish now rather than at the next heartbeat (what a reader sees must include the rounds)
    await asyncio.gather(*(s.peer.announce() for s in swarms))


@contextlib.asynccontextmanager
async def swarm_of(n: int, run_id: str, **options) -> AsyncIterator[list[AsyncSwarm]]:
    swarms: list[AsyncSwarm] = []
    try:
        for i in range(n):
            peers = [swarms[0].address] if swarms else []
            opt = {**OPTIONS, **options}
            m = model(i)
            swarms.append(
                await AsyncSwarm.create(
                    m,
                    torch.optim.SGD(m.parameters(), lr=0.01),
                    run_id=run_id,
                    initial_peers=peers,
                    **opt,
                )
            )
        yield swarms
    finally:
        for s in reversed(swarms):
            await s.close()


async def status_json(via: str, run_id: str) -> dict:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "swarm.cli",
        "status",
        "--once",
        "--json",
        "--initial-peers",
        via,
        "--run-id",
        run_id,
        "--listen",
        "127.0.0.1:0",
        cwd=ROOT,
        env=child_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    return json.loads(out.decode().strip().splitlines()[-1])


async def test_status_lists_every_peer_with_round_and_resources_and_drops_a_leaver() -> None:
    async with swarm_of(3, "status-run") as swarms:
        await train_all(swarms, 4)
        snap = await status_json(swarms[0].address, "status-run")
        rows = {row["address"]: row for row in snap["peers"]}
        assert set(rows) == {s.address for s in swarms}, snap
        for s in swarms:
            row = rows[s.address]
            assert row["role"] == "trainer" and row["round"] == s.round >= 2, row
            assert row["step"] == 4 and isinstance(row["loss"], float), row
            assert row["resources"]["cores"] >= 1 and row["resources"]["ram"] >= 0, row
            assert row["codec"] == "none" and row["uptime_s"] > 0, row
        averaged = [row for row in rows.values() if row["group_size"] >= 2]
        assert averaged, "no peer published an averaged round"
        assert snap["totals"]["peers"] == 3 and snap["totals"]["trainers"] == 3
        assert snap["totals"]["samples_per_s"] > 0

        leaver = swarms.pop()
        address, gone = leaver.address, leaver.peer.peer_id
        await leaver.close()  # publishes the leave marker
        snap = await status_json(swarms[0].address, "status-run")
        assert {row["address"] for row in snap["peers"]} == {s.address for s in swarms}, (
            f"{address} still listed after close(): the leave marker did not replace its record"
        )
        # the survivors' next round plans without the leaver instead of waiting for it
        await train_all(swarms, 2)
        for s in swarms:
            assert gone in s.peer.departed
            assert gone not in s.averager.prober.records


async def test_status_hints_when_the_run_id_matches_no_peer() -> None:
    async with swarm_of(1, "real-run") as swarms:
        snap = await status_json(swarms[0].address, "typo-run")
    assert snap["peers"] == []
    assert "is in run 'real-run'" in snap["hint"], snap


async def test_joins_and_leaves_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="swarm.monitor.watch")
    async with swarm_of(3, "watch-run") as swarms:
        first = swarms[0]
        await first.peer.known_peers()
        others = [s.peer.peer_id.short for s in swarms[1:]]
        assert first.peer.watcher.known == {s.peer.peer_id for s in swarms}
        assert f"peer {others[-1]} joined (3 peers)" in caplog.text
        await swarms.pop().close()
        await first.peer.known_peers()
        assert f"peer {others[-1]} left (2 peers)" in caplog.text


@pytest.mark.skipif(sys.platform == "win32", reason="stops the peer with SIGINT")
def test_swarm_peer_logs_joins_leaves_and_a_periodic_status() -> None:
    argv = [sys.executable, "-m", "swarm.cli", "--listen", "127.0.0.1:0", "--run-id", "cli-log"]
    argv += ["--heartbeat", "0.5", "--status-interval", "0.5"]
    argv += ["--record-ttl-s", "60"]  # a slow exit must not let the record expire first
    first = OutputProcess(argv)
    second = None
    try:
        address = first.wait_for(r"--initial-peers (\S+)", 60)[1]
        first.wait_for(r"status: run 'cli-log': 1 peer\(s\)", 60)
        second = OutputProcess([*argv, "--initial-peers", address])
        short = second.wait_for(r"peer \S+ \((\w+)\) is up", 60)[1]
        first.wait_for(rf"peer {short} joined \(2 peers\)", 60)
        first.wait_for(r"status: run 'cli-log': 2 peer\(s\)", 60)
        second.proc.send_signal(signal.SIGINT)
        assert second.proc.wait(30) == 0
        first.wait_for(rf"peer {short} left \(1 peers\)", 60)  # the marker, not the expiry
    finally:
        first.kill()
        if second is not None:
            second.kill()


def test_watcher_names_newcomers_and_departures(caplog: pytest.LogCaptureFixture) -> None:
    from swarm.identity import Identity

    me, a, b = (Identity.generate().peer_id for _ in range(3))
    w = PeerWatcher(me)
    caplog.set_level(logging.INFO, logger="swarm.monitor.watch")
    w.update([me])
    w.update([me, a])
    w.update([me, a, b])
    w.update([me, b], left=[a])
    w.update([me])
    assert f"peer {a.short} joined (2 peers)" in caplog.text
    assert f"peer {b.short} joined (3 peers)" in caplog.text
    assert f"peer {a.short} left (2 peers)" in caplog.text
    assert f"peer {b.short} left (its record expired) (1 peers)" in caplog.text


async def metrics_of(address: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.get(f"http://{address}/metrics") as r:
        assert r.status == 200
        text = await r.text()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}"] = sample.value
    return values


async def test_metrics_parse_and_move_after_a_round() -> None:
    async with swarm_of(2, "metrics-run", metrics=True) as swarms:
        before = await metrics_of(swarms[0].address)
        assert before["swarm_peers_known{}"] >= 1
        assert "swarm_rounds_total{outcome=averaged,reason=}" not in before
        await train_all(swarms, 2)
        await swarms[0].peer.known_peers()
        after = await metrics_of(swarms[0].address)
        rounds = sum(v for k, v in after.items() if k.startswith("swarm_rounds_total"))
        assert rounds == swarms[0].round >= 1, after
        assert after.get("swarm_rounds_total{outcome=averaged,reason=}", 0) >= 1, after
        assert after["swarm_round_bytes_total{direction=sent}"] > 0
        assert after["swarm_round_seconds_count{}"] == rounds
        assert after["swarm_matchmaking_seconds_count{}"] == rounds
        assert after["swarm_dht_operations_total{op=store}"] > before.get(
            "swarm_dht_operations_total{op=store}", 0
        )
        assert after["swarm_peers_known{}"] == 2 and after["swarm_step{}"] == 2
        # a refused (unsigned) request is counted by reason
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://{swarms[0].address}/ping") as r,
        ):
            assert r.status == 401
        refused = await metrics_of(swarms[0].address)
        assert refused["swarm_refused_total{reason=401,where=http}"] >= 1


async def test_metrics_are_off_by_default() -> None:
    async with (
        swarm_of(1, "quiet-run") as swarms,
        aiohttp.ClientSession() as session,
        session.get(f"http://{swarms[0].address}/metrics") as r,
    ):
        assert r.status == 404


def test_status_table_has_a_row_per_peer_and_totals() -> None:
    row = {
        "peer": "p" * 52,
        "short": "pppppppppp",
        "address": "127.0.0.1:1",
        "device": "cpu",
        "version": "0.1.0",
        "bandwidth": 1.0,
        "last_seen_s": 2.0,
    }
    text = format_table(
        {
            "run_id": "r",
            "peers": [row],
            "totals": {
                "peers": 1,
                "trainers": 0,
                "samples_per_s": 0.0,
                "bytes_in_per_s": 0.0,
                "bytes_out_per_s": 0.0,
                "max_round": 0,
                "mean_loss": None,
            },
        }
    )
    assert "pppppppppp" in text and "run 'r': 1 peer(s)" in text


def test_status_shows_whose_weight_other_peers_lowered_and_why() -> None:
    why = "aligned -0.61 on average, own 0.70 +- 0.10"
    rows = [
        {"short": "aaaaaaaaaa", "lowered": [["cccccccccc", 0.02, why], ["aaaaaaaaaa", 0.0, "x"]]},
        {"short": "bbbbbbbbbb", "lowered": [["cccccccccc", 0.3, why], ["zzzzzzzzzz", 0.1, "x"]]},
        {"short": "cccccccccc", "lowered": [["aaaaaaaaaa", 0.01, "a liar's word"]]},
        {"short": "dddddddddd", "lowered": []},
        {"short": "eeeeeeeeee", "lowered": []},
    ]
    for r in rows:
        r["role"] = "trainer"
    add_weight_views(rows)
    a, b, c, *_ = rows
    assert [v["by"] for v in c["lowered_by"]] == ["aaaaaaaaaa", "bbbbbbbbbb"]
    # the median over the 4 other trainers' views, 1.0 where one did not name it
    assert c["weight"] == pytest.approx(0.65)
    assert b["weight"] is None and b["lowered_by"] == []  # nobody lowered it; unknown ids dropped
    assert a["weight"] == 1.0  # one liar among four views does not move it
    for r in rows:
        r.update(peer=r["short"] * 5, address="127.0.0.1:1", device="cpu", last_seen_s=1.0)
    text = format_table({"run_id": "r", "peers": rows, "totals": totals(rows)})
    assert "x0.65/2" in text and "x1.00/1" in text
    assert f"cccccccccc: weight x0.02 in aaaaaaaaaa's view: {why}" in text


async def test_dashboard_serves_its_page_and_the_run_state() -> None:
    async with swarm_of(2, "dash-api") as swarms:
        await train_all(swarms, 2)
        reader = RunReader([swarms[0].address], "dash-api", listen_host="127.0.0.1")
        async with reader, Dashboard(reader, interval=3600) as dashboard:
            address = await dashboard.serve(PeerAddress("127.0.0.1", 0))
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://{address}/") as r:
                    page = await r.text()
                async with session.get(f"http://{address}/api/state") as r:
                    state = await r.json()
        addresses = {s.address for s in swarms}
        shorts = sorted(s.peer.peer_id.short for s in swarms)
    assert 'id="loss-chart"' in page and "<script" in page
    assert not re.search(r"(src|href)=[\"']https?:", page), "the page must not load anything"
    assert {row["address"] for row in state["peers"]} == addresses
    assert len(state["series"]) == 2 and all(s["points"] for s in state["series"])
    assert state["groups"] and state["groups"][0]["groups"][0] == shorts


# ---- the dashboard in a real browser


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    return None


async def browse(url: str, *flags: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        chromium(),
        "--headless",
        "--no-sandbox",  # as root in CI containers
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--virtual-time-budget=4000",
        "--window-size=1400,1000",
        *flags,
        url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()[-2000:]
    return out.decode()


def loss_points(dom: str) -> int:
    m = re.search(r'<svg id="loss-chart" data-points="(\d+)"', dom)
    assert m, dom[:3000]
    return int(m.group(1))


@pytest.mark.slow
@pytest.mark.skipif(chromium() is None, reason="no Chromium installed (apt-get install chromium)")
async def test_dashboard_in_headless_chromium(tmp_path: Path, monkeypatch) -> None:
    # every value on the page comes from other peers: markup in one must stay text
    hostile = Resources('<img src=x onerror="document.title=1">', 2, 1 << 30, "<b>GPU</b>", 0)
    monkeypatch.setattr(tracker, "machine_resources", lambda: hostile)
    async with swarm_of(3, "dash-run") as swarms:
        victim = swarms[2].peer.peer_id.short

        class Records:  # what a peer scoring updates publishes of those it holds lowered
            def lowered(self, limit: int) -> tuple[tuple[str, float, str], ...]:
                return ((victim, 0.04, "<b>aligned</b> -0.61 on average, others 0.70 +- 0.10"),)

        swarms[0].peer.progress.records = Records()
        await train_all(swarms, 2)
        reader = RunReader([swarms[0].address], "dash-run", listen_host="127.0.0.1")
        async with reader, Dashboard(reader, interval=3600) as dashboard:
            address = await dashboard.serve(PeerAddress("127.0.0.1", 0))
            url = f"http://{address}/"
            dom = await browse(url, "--dump-dom")
            shorts = {s.peer.peer_id.short for s in swarms}
            rows = set(re.findall(r'<tr class="peer-row" data-peer="(\w+)"', dom))
            assert rows == shorts, dom[:3000]
            first = loss_points(dom)
            assert first >= 3  # one point per trainer at least

            await train_all(swarms, 4)  # two more rounds each
            await dashboard.poll()
            dom = await browse(url, "--dump-dom")
            assert loss_points(dom) > first, "the loss chart gained no points after new rounds"
            assert 'class="round-row"' in dom  # groups of the last rounds are listed
            assert "&lt;img src=x" in dom and "<img" not in dom and "<b>GPU" not in dom
            # the weight others give each peer, over time, and why one was lowered
            m = re.search(r'<svg id="weight-chart" data-points="(\d+)"', dom)
            assert m and int(m.group(1)) >= 3, dom[:3000]
            assert dom.count('class="lowered-row"') == 1 and f"<td>{victim}</td>" in dom
            # the median of its 2 other views: 0.04 from the one that lowered it, 1.0 from the other
            assert "x0.52/1" in dom and "&lt;b&gt;aligned" in dom and "<b>aligned" not in dom

            shot = tmp_path / "dashboard.png"
            await browse(url, f"--screenshot={shot}")
            assert shot.stat().st_size > 10_000
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
