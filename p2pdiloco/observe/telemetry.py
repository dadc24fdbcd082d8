"""What a peer tells the world about itself: its counters in Prometheus's text exposition format (written
by `prometheus_client`), served over HTTP on the peer's network loop (the meters behind them live in
training/meters.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from p2pdiloco.observe.serve import HttpServer

# (name, type, help, snapshot key). Names and units follow Prometheus conventions: base units (seconds,
# bytes), counters end in _total, Unix times in _timestamp_seconds. Losses are unitless (nats per byte).
METRICS = [
    ("p2pdiloco_inner_steps_total", "counter", "Inner optimizer steps taken by this peer.", "step"),
    ("p2pdiloco_rounds_total", "counter", "Rounds completed: merges applied, alone or in a group.", "round"),
    ("p2pdiloco_tokens_total", "counter", "Tokens (bytes of text) this peer trained on.", "tokens"),
    ("p2pdiloco_merges_total", "counter", "Merges with at least one other peer.", "merges"),
    ("p2pdiloco_merge_failures_total", "counter", "Group merges abandoned; the peer kept its own update.",
     "merge_failures"),
    ("p2pdiloco_bytes_sent_total", "counter", "Bytes sent to other peers in merges.", "bytes_sent"),
    ("p2pdiloco_bytes_received_total", "counter", "Bytes received from other peers in merges.", "bytes_received"),
    ("p2pdiloco_compute_seconds_total", "counter", "Seconds spent in inner steps.", "compute_s"),
    ("p2pdiloco_merge_wait_seconds_total", "counter",
     "Seconds the learner waited for merges (sync; decoupled: outer.land_wait and the last merge).", "merge_wait_s"),
    ("p2pdiloco_tokens_per_second", "gauge", "Tokens per second over the last 30 seconds.", "tokens_per_s"),
    ("p2pdiloco_mfu", "gauge", "Model FLOPs utilization over the last 30 seconds: (6N + attention) FLOPs per token x "
     "tokens/s / the device's peak (NaN where the peak is unknown, e.g. CPUs).", "mfu"),
    ("p2pdiloco_loss", "gauge", "Training loss over about the last 20 inner steps (moving average), in nats per "
     "byte (NaN before the first step).", "loss"),
    ("p2pdiloco_eval_loss", "gauge", "Validation loss of the global model at its last evaluation, in nats per byte.",
     "eval_loss"),
    ("p2pdiloco_last_merge_seconds", "gauge", "How long the last merge took.", "last_merge_s"),
    ("p2pdiloco_last_merge_timestamp_seconds", "gauge", "Unix time of the last merge (0 before the first).",
     "last_merge_time"),
    ("p2pdiloco_last_merge_group_size", "gauge", "Peers in the last merge group (1: merged alone).",
     "last_group_size"),
    ("p2pdiloco_start_time_seconds", "gauge", "Unix time this peer started.", "started"),
]
INFO_LABELS = ("peer_id", "name", "run_id", "device", "version")
INFO_HELP = "Who this peer is: its labels carry the identity; the value is always 1."
# generate_latest writes the classic text format, version 0.0.4, but prometheus_client's CONTENT_TYPE_LATEST
# says 1.0.0 in recent releases; scrapers (Prometheus >= 3) pick their parser by this header, so name 0.0.4
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _number(v: object) -> float:
    """A sample's value: NaN for anything missing or not a number (a bool is not a count)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return math.nan
    return float(v)


class SnapshotCollector:
    """A `prometheus_client` collector that reads every value from `snapshot()` at each scrape.

    Identity goes in one info metric (`p2pdiloco_peer_info`, value 1) rather than in labels on every
    sample, as Prometheus recommends; the scrape target's own labels tell peers apart.

    Args:
        snapshot: returns the heartbeat record (`learner.report.record()` plus the static fields), with `peer_id`,
            `run_id`, `merge_failures`, `compute_s` and `merge_wait_s` added. Missing values are written as
            NaN.
    """

    def __init__(self, snapshot: Callable[[], dict]):
        self.snapshot = snapshot

    def collect(self):
        snapshot = self.snapshot()
        # InfoMetricFamily appends _info to the name; the text format writes it as a gauge
        identity = {k: str(snapshot.get(k, "")) for k in INFO_LABELS}
        yield InfoMetricFamily("p2pdiloco_peer", INFO_HELP, value=identity)
        for name, kind, help_, key in METRICS:
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, help_, value=_number(snapshot.get(key)))


def metrics_registry(snapshot: Callable[[], dict]) -> CollectorRegistry:
    """A registry of its own holding only this peer's metrics (not the process-wide default one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot))
    return registry


class MetricsServer:
    """Serves ``/metrics`` (Prometheus text format) from `snapshot()`, on the peer's network loop.

    Args:
        snapshot: returns the current values (see `SnapshotCollector`); called once per scrape.
        host, port: where to listen (port 0: any free one).
    """

    def __init__(self, snapshot: Callable[[], dict], host: str, port: int):
        self.registry = metrics_registry(snapshot)
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/", self._index)
        self.server = HttpServer(app, host, port, "metrics")

    async def start(self) -> str:
        """Listen; returns the URL of /metrics. Raises ConfigError if the port cannot be used."""
        return await self.server.start() + "metrics"

    async def stop(self) -> None:
        await self.server.stop()

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE})

    async def _index(self, _request: web.Request) -> web.Response:
        return web.Response(text="p2pdiloco peer: metrics at /metrics\n")
