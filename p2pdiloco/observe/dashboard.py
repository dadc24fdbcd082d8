"""The web dashboard: a page with live charts of a swarm, and the JSON API it reads.

The dashboard reads the peers' heartbeat records from the DHT every `refresh_s` seconds (and what each peer says
about itself, its config record's name, device and version, when a new peer shows up) and keeps, in
memory and bounded, what it has seen: each peer's points over time (loss, tokens/s, bytes), the swarm's
totals over time, and when peers joined and left. The DHT holds only the latest record of each peer, so
this history starts when the dashboard does. The page (``dashboard.html``, one self-contained file with
its own SVG drawing, no CDN) polls ``/api/state``.

Routes: ``/`` the page, ``/api/state`` status + history, ``/api/status`` what `p2pdiloco status --json`
prints.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources

import hivemind
from aiohttp import web

from p2pdiloco.config import SwarmConfig
from p2pdiloco.network.peer_records import about_of, with_about
from p2pdiloco.network.swarm import (
    BackgroundLoop,
    SwarmError,
    config_key,
    live_records,
    read_peers,
    read_subkeys,
    start_dht,
)
from p2pdiloco.observe.serve import HttpServer
from p2pdiloco.observe.status import swarm_status
from p2pdiloco.util.memory import keep_releasing_memory

logger = logging.getLogger(__name__)

RELEASE_EVERY_S = 60.0
"""Seconds between two hand-backs of the dashboard's freed memory to the operating system (util/memory)."""
ABOUT_EVERY_S = 60.0
"""The peers' config records (what each says about itself, written once) are read again after this long, or when a
live peer shows up; the heartbeats, every `refresh_s`."""
ABOUT_RETRY_S = 10.0
"""A live peer whose config record the last reading lacked (not written yet) is looked for again after this long."""
POINT_FIELDS = ("time", "step", "tokens", "loss", "eval_loss", "tokens_per_s", "bytes_sent", "bytes_received")
"""The columns of a peer's points in ``/api/state`` (time: Unix seconds, when the dashboard saw it)."""


class Series:
    """Points in time order, bounded: when full, every other point is dropped, so the whole span since the
    start stays visible at a coarser resolution instead of the oldest part being cut off."""

    def __init__(self, max_points: int):
        self.max_points = max(4, max_points)
        self.points: list[list] = []

    def add(self, point: list) -> None:
        self.points.append(point)
        if len(self.points) > self.max_points:
            self.points = self.points[:-1:2] + self.points[-1:]  # keep the first and the newest, halve the rest


@dataclass
class PeerTrack:
    """What the dashboard has seen of one peer."""

    peer_id: str
    first_seen: float
    last_seen: float
    """When the dashboard last received a new record of this peer."""
    series: Series
    state: str = "new"
    """live, left (said goodbye) or lost (its records stopped coming); new until its first reading."""
    row: dict = field(default_factory=dict)
    """Its latest record, as `status.peer_row` normalizes it."""
    record_time: float = 0.0
    name: str = ""
    """The last name its records gave (its config record may be read a poll or more after its first heartbeat)."""


class SwarmHistory:
    """A bounded memory of a swarm as seen through successive readings of its peer records.

    Args:
        max_points: points kept per peer and for the swarm's totals (thinned, see `Series`).
        max_events: joins and leaves kept.
        max_peers: peers kept once gone (live peers are always kept); the ones gone longest are forgotten first.
        lost_after_s: a peer whose records stop coming for this long is marked lost (a record expires after
            four heartbeats; one failed DHT read must not make every peer leave and join again).
    """

    def __init__(self, run_id: str, max_points: int = 400, max_events: int = 200, max_peers: int = 200,
                 lost_after_s: float = 10.0):
        self.run_id, self.max_points, self.max_events = run_id, max_points, max_events
        self.max_peers, self.lost_after_s = max_peers, lost_after_s
        self.peers: dict[str, PeerTrack] = {}
        self.swarm = Series(max_points * 2)
        self.events: list[dict] = []
        self.status = swarm_status({}, run_id, 0.0)
        self.started = time.time()

    def _event(self, now: float, track: PeerTrack, what: str) -> None:
        self.events.append({"time": now, "peer_id": track.peer_id, "name": track.name, "event": what})
        del self.events[: -self.max_events]

    def _named(self, track: PeerTrack, name: str) -> None:
        """`track`'s records now give `name`: its events that were taken with no name get it."""
        if not track.name:
            for event in self.events:
                if event["peer_id"] == track.peer_id and not event["name"]:
                    event["name"] = name
        track.name = name

    def observe(self, records: dict[str, dict], now: float) -> None:
        """Take one reading: ``{peer_id: record}`` from the DHT, at Unix time `now`."""
        self.status = swarm_status(records, self.run_id, now)
        for row in self.status["peers"]:
            track = self.peers.get(row["peer_id"])
            if track is None:
                track = PeerTrack(row["peer_id"], now, now, Series(self.max_points))
                self.peers[row["peer_id"]] = track
            if row.get("name") and row["name"] != track.name:
                self._named(track, row["name"])
            if track.state != "live":
                track.state = "live"
                self._event(now, track, "joined")
            track.row = row
            if row["time"] != track.record_time:  # a new heartbeat: one point
                track.record_time, track.last_seen = row["time"], now
                track.series.add([now] + [row[k] for k in POINT_FIELDS[1:]])
        live_ids = {row["peer_id"] for row in self.status["peers"]}
        for track in self.peers.values():
            if track.state != "live" or track.peer_id in live_ids:
                continue
            if records.get(track.peer_id, {}).get("left"):
                track.state = "left"
            elif now - track.last_seen > self.lost_after_s:
                track.state = "lost"
            else:
                continue
            self._event(now, track, track.state)
        self._forget()
        live = [t for t in self.peers.values() if t.state == "live"]
        losses = [t.row["loss"] for t in live if t.row.get("loss") is not None]
        self.swarm.add([now, len(live), sum(t.row.get("tokens_per_s", 0.0) for t in live),
                        sum(losses) / len(losses) if losses else None])

    def _forget(self) -> None:
        gone = sorted((t for t in self.peers.values() if t.state != "live"), key=lambda t: t.last_seen)
        for track in gone[: max(0, len(self.peers) - self.max_peers)]:
            del self.peers[track.peer_id]

    def state(self) -> dict:
        """Everything the page draws, as ``/api/state`` serves it."""
        return {
            "run_id": self.run_id, "now": time.time(), "started": self.started, "status": self.status,
            "point_fields": list(POINT_FIELDS), "swarm_fields": ["time", "peers", "tokens_per_s", "loss"],
            "swarm": self.swarm.points, "events": self.events,
            "peers": [
                {"peer_id": t.peer_id, "name": t.name, "device": t.row.get("device", "?"),
                 "state": t.state, "first_seen": t.first_seen, "last_seen": t.last_seen, "row": t.row,
                 "points": t.series.points}
                for t in sorted(self.peers.values(), key=lambda t: t.first_seen)
            ],
        }


class Dashboard:
    """The dashboard's web server and DHT poller, on an asyncio loop that the DHT is usable from.

    Args:
        dht: a DHT node joined to the swarm (a client is enough; `local` passes its bootstrap node).
        run_id: the swarm's run id.
        host, port: where to listen (port 0: any free one).
        refresh_s: seconds between DHT readings; the page polls at the same pace.
    """

    def __init__(self, dht: hivemind.DHT, run_id: str, host: str = "127.0.0.1", port: int = 8080,
                 refresh_s: float = 2.0):
        self.dht, self.run_id, self.refresh_s = dht, run_id, refresh_s
        self.history = SwarmHistory(run_id)
        app = web.Application()
        app.router.add_get("/", self._page)
        app.router.add_get("/api/state", self._state)
        app.router.add_get("/api/status", self._status)
        self.server = HttpServer(app, host, port, "dashboard")
        self._poller: asyncio.Task | None = None
        self._about: dict[str, dict] = {}
        """What each peer says about itself (its config record's `ABOUT_FIELDS`), as last read."""
        self._about_read = -math.inf
        self._html = resources.files("p2pdiloco.observe").joinpath("dashboard.html").read_text(encoding="utf-8")

    async def start(self) -> str:
        """Serve, start polling, and return the URL."""
        url = await self.server.start()
        self._poller = asyncio.create_task(self._poll_forever())
        return url

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        await self.server.stop()

    async def poll_once(self) -> None:
        timeout = max(1.0, self.refresh_s * 2)
        records = await read_peers(self.dht, self.run_id, timeout=timeout)
        live, since = live_records(records), time.monotonic() - self._about_read
        if (any(p not in self._about for p in live) or since >= ABOUT_EVERY_S
                or (since >= ABOUT_RETRY_S and not all(self._about[p] for p in live))):
            configs = await read_subkeys(self.dht, config_key(self.run_id), timeout)
            self._about = {p: about_of(configs.get(p)) for p in {*configs, *live}}
            self._about_read = time.monotonic()
        self.history.observe(with_about(records, self._about), time.time())

    async def _poll_forever(self) -> None:
        await keep_releasing_memory(RELEASE_EVERY_S)  # what malloc keeps of the readings' freed buffers grows for hours
        while True:
            t0 = time.monotonic()
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a failed reading is a gap in the charts, not the end of the dashboard
                logger.warning("reading the swarm's records failed: %r", e)
            await asyncio.sleep(max(0.1, self.refresh_s - (time.monotonic() - t0)))

    async def _page(self, _request: web.Request) -> web.Response:
        return web.Response(text=self._html, content_type="text/html", headers={"Cache-Control": "no-store"})

    async def _state(self, _request: web.Request) -> web.Response:
        return web.json_response({**self.history.state(), "refresh_s": self.refresh_s},
                                 headers={"Cache-Control": "no-store"})

    async def _status(self, _request: web.Request) -> web.Response:
        return web.json_response(self.history.status, headers={"Cache-Control": "no-store"})


class BackgroundDashboard:
    """A `Dashboard` served from a loop of its own, for a process whose main thread does other work
    (`p2pdiloco local` draws its table; `p2pdiloco dashboard` waits for Ctrl+C). Serving when constructed."""

    def __init__(self, dht: hivemind.DHT, run_id: str, host: str, port: int, refresh_s: float = 2.0):
        self.loop = BackgroundLoop("p2pdiloco-dashboard")
        try:
            self.dashboard = Dashboard(dht, run_id, host, port, refresh_s)
            self.url = self.loop.run(self.dashboard.start(), timeout=30)
        except BaseException:
            self.loop.close()
            raise

    def close(self) -> None:
        try:
            self.loop.run(self.dashboard.stop(), timeout=10)
        except Exception as e:  # shutting down: log, never raise
            logger.debug("stopping the dashboard: %r", e)
        self.loop.close()


def run_dashboard(initial_peers: list[str], run_id: str, host: str, port: int, refresh_s: float,
                  stop: threading.Event, announce: Callable[[str], None] = print, swarm_key: str = "") -> None:
    """`p2pdiloco dashboard`: join the swarm as a DHT client, serve the dashboard until `stop` is set.

    Raises:
        SwarmError: the initial peers cannot be reached, or the DHT process dies.
        ConfigError: the port cannot be used.
    """
    dht = start_dht(SwarmConfig(run_id=run_id, initial_peers=initial_peers, swarm_key=swarm_key), client_mode=True)
    try:
        served = BackgroundDashboard(dht, run_id, host, port, refresh_s)
        try:
            announce(f"dashboard of swarm {run_id!r}: {served.url}  (Ctrl+C to stop)")
            while not stop.wait(1.0):
                if not dht.is_alive():
                    raise SwarmError("the DHT process died; restart the dashboard")
        finally:
            served.close()
    finally:
        dht.shutdown()
