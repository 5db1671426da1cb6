"""``swarm-peer dashboard``: one self-contained web page of a run, updated live.

The server reads the run's records every ``interval`` seconds (:class:`~swarm.monitor.status.
RunReader`), keeps a bounded history per peer (round, loss, samples/s and the weight the others
give it, over time) and the group membership of the last rounds, and serves:

- ``GET /``: the page (``static/dashboard.html``, shipped in the package: no CDN, works offline);
- ``GET /api/state``: the current table, totals, history and groups as JSON, polled by the page.

Everything shown comes from other peers' records, already bounded by :mod:`swarm.net.progress`;
the page writes it with ``textContent`` only, never as HTML.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from importlib import resources
from typing import Any

from aiohttp import web

from swarm.address import PeerAddress
from swarm.dashboard.status import RunReader
from swarm.errors import SwarmError

logger = logging.getLogger(__name__)

MAX_POINTS = 720  # per peer: an hour at the default 5 s heartbeat
MAX_ROUNDS = 12  # group membership of this many recent rounds
MAX_SERIES = 256  # peers with a history (oldest dropped first)


class Dashboard:
    """Polls a run and serves its page. ``async with Dashboard(reader) as d: await d.serve(a)``."""

    def __init__(self, reader: RunReader, *, interval: float = 2.0):
        self.reader = reader
        self.interval = interval
        self.snapshot: dict[str, Any] = {
            "run_id": reader.run_id,
            "time": time.time(),
            "peers": [],
            "totals": {},
        }
        self.series: OrderedDict[str, deque[dict[str, Any]]] = OrderedDict()
        self.groups: OrderedDict[int, dict[str, set[str]]] = OrderedDict()
        self.polls = 0
        self._task: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> Dashboard:
        await self.poll()
        self._task = asyncio.create_task(self._poll_forever(), name="swarm-dashboard")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def serve(self, address: PeerAddress) -> PeerAddress:
        """Start the HTTP server; returns the bound address (port 0 picks one)."""
        app = web.Application()
        app.router.add_get("/", self._page)
        app.router.add_get("/api/state", self._state)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, address.host, address.port).start()
        except OSError as e:
            raise SwarmError(f"cannot serve the dashboard on {address}: {e}") from e
        port = self._runner.addresses[0][1]
        return PeerAddress(address.host, port)

    async def poll(self) -> None:
        """Read the run once and add what changed to the history."""
        try:
            snapshot = await self.reader.snapshot()
        except SwarmError as e:
            logger.warning("dashboard: cannot read the run's records: %s", e)
            return
        self.polls += 1
        self.snapshot = snapshot
        for row in snapshot["peers"]:
            if row.get("role") != "trainer":
                continue
            self._add_point(row, snapshot["time"])
            if row.get("group"):
                rnd = self.groups.setdefault(row["round"], {})
                rnd.setdefault(row["group"], set()).add(row["short"])
        for old in sorted(self.groups)[:-MAX_ROUNDS]:
            del self.groups[old]

    def _add_point(self, row: dict[str, Any], now: float) -> None:
        series = self.series.get(row["peer"])
        if series is None:
            series = self.series[row["peer"]] = deque(maxlen=MAX_POINTS)
            while len(self.series) > MAX_SERIES:
                self.series.popitem(last=False)
        last = series[-1] if series else None
        if last is not None and last["step"] == row["step"]:
            return  # no new heartbeat since the last poll
        seen = now - row["last_seen_s"]
        series.append(
            {
                "t": seen,
                "round": row["round"],
                "step": row["step"],
                "loss": row.get("loss"),
                "samples_per_s": row["samples_per_s"],
                # the median weight factor others gave it, among those that lowered it (1.0:
                # nobody did)
                "weight": 1.0 if row.get("weight") is None else row["weight"],
            }
        )

    def state(self) -> dict[str, Any]:
        """What ``/api/state`` answers."""
        shorts = {row["peer"]: row["short"] for row in self.snapshot["peers"]}
        return {
            **self.snapshot,
            "polls": self.polls,
            "series": [
                {"peer": pid, "short": shorts.get(pid, pid[:8]), "points": list(points)}
                for pid, points in self.series.items()
            ],
            "groups": [
                {"round": rnd, "groups": [sorted(m) for _, m in sorted(groups.items())]}
                for rnd, groups in sorted(self.groups.items(), reverse=True)
            ],
        }

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.poll()

    async def _page(self, request: web.Request) -> web.Response:
        return web.Response(text=page_html(), content_type="text/html")

    async def _state(self, request: web.Request) -> web.Response:
        return web.json_response(self.state(), headers={"Cache-Control": "no-store"})


def page_html() -> str:
    """The dashboard page, from the package's data."""
    return resources.files("swarm.dashboard").joinpath("static/dashboard.html").read_text("utf-8")


class DashboardThread:
    """A dashboard served from a daemon thread with its own loop, for synchronous scripts::

        with DashboardThread(["127.0.0.1:7000"], "my-run") as dashboard:
            print("dashboard at", dashboard.url)
            ...  # train

    Args:
        initial_peers: ``HOST:PORT`` of live peers of the run.
        run_id: the run to show.
        http: where to serve the page; port 0 picks a free one.
        interval: seconds between two reads of the run's records.
        **reader_options: passed to :class:`~swarm.monitor.status.RunReader` (``membership``).
    """

    def __init__(
        self,
        initial_peers: list[str],
        run_id: str,
        *,
        http: str = "127.0.0.1:0",
        interval: float = 2.0,
        **reader_options: Any,
    ):
        import threading

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        address = PeerAddress.parse(http)
        reader = RunReader(
            initial_peers, run_id, listen_host=address.host or "0.0.0.0", **reader_options
        )
        self.dashboard = Dashboard(reader, interval=interval)

        async def start() -> PeerAddress:
            await reader.__aenter__()
            await self.dashboard.__aenter__()
            return await self.dashboard.serve(address)

        try:
            bound = asyncio.run_coroutine_threadsafe(start(), self._loop).result(60)
        except BaseException:
            self.close()
            raise
        self.url = f"http://{bound}/"

    def __enter__(self) -> DashboardThread:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop serving and end the thread. Idempotent."""
        if self._loop.is_closed():
            return

        async def stop() -> None:
            await self.dashboard.close()
            await self.dashboard.reader.close()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
        self._loop.close()
