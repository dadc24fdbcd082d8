"""A peer's own telemetry: recent throughput, and the Prometheus text it serves."""

from __future__ import annotations

import math
import urllib.request

import pytest
from prometheus_client import generate_latest

from p2pdiloco.config import ConfigError
from p2pdiloco.observe.telemetry import MetricsServer, metrics_registry
from p2pdiloco.training.meters import Ema, RateMeter


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_rate_meter_measures_the_recent_window_and_decays_when_stalled():
    clock = FakeClock()
    meter = RateMeter(window_s=10.0, clock=clock)
    assert meter.rate() == 0.0
    meter.add(0)
    for _ in range(100):  # 50 tokens/s for 20 s
        clock.now += 0.2
        meter.add(meter._samples[-1][1] + 10)
    assert meter.rate() == pytest.approx(50.0, rel=0.05)
    for _ in range(50):  # then 200 tokens/s for 10 s: the old pace has left the window
        clock.now += 0.2
        meter.add(meter._samples[-1][1] + 40)
    assert meter.rate() == pytest.approx(200.0, rel=0.05)
    assert len(meter._samples) <= 103  # bounded, however often it is fed
    clock.now += 10.0  # stalled: no tokens for a whole window
    assert meter.rate() < 110.0


SNAPSHOT = {
    "peer_id": "12D3KooWabc", "name": 'alice "the" \\ gpu\nbox', "run_id": "r", "device": "cpu", "version": "0.1.0",
    "step": 120, "round": 6, "tokens": 7680, "merges": 5, "merge_failures": 1, "bytes_sent": 123456,
    "bytes_received": 654321, "compute_s": 12.5, "merge_wait_s": 0.0, "tokens_per_s": 512.25, "loss": 2.5,
    "eval_loss": None, "last_merge_s": 0.4, "last_merge_time": 1.7e9, "last_group_size": 3, "started": 1.69e9,
}
COUNTERS = {"p2pdiloco_inner_steps": 120, "p2pdiloco_rounds": 6, "p2pdiloco_tokens": 7680, "p2pdiloco_merges": 5,
            "p2pdiloco_merge_failures": 1, "p2pdiloco_bytes_sent": 123456, "p2pdiloco_bytes_received": 654321,
            "p2pdiloco_compute_seconds": 12.5, "p2pdiloco_merge_wait_seconds": 0.0}
GAUGES = {"p2pdiloco_tokens_per_second": 512.25, "p2pdiloco_loss": 2.5, "p2pdiloco_last_merge_seconds": 0.4,
          "p2pdiloco_last_merge_timestamp_seconds": 1.7e9, "p2pdiloco_last_merge_group_size": 3,
          "p2pdiloco_start_time_seconds": 1.69e9}


def parse_families(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(text)}


def check_exposition(text: str, snapshot: dict) -> dict:
    """`text` parses with prometheus_client's parser and holds every family with the right type and HELP."""
    families = parse_families(text)
    for name in COUNTERS:
        f = families[name]
        assert f.type == "counter" and f.documentation
        assert [s.name for s in f.samples] == [name + "_total"]
    for name in [*GAUGES, "p2pdiloco_eval_loss", "p2pdiloco_peer_info"]:
        assert families[name].type == "gauge" and families[name].documentation
    (info,) = families["p2pdiloco_peer_info"].samples
    assert info.value == 1 and info.labels["peer_id"] == snapshot["peer_id"] and info.labels["name"] == snapshot["name"]
    return families


def test_prometheus_text_parses_with_the_expected_families_and_values():
    families = check_exposition(generate_latest(metrics_registry(lambda: SNAPSHOT)).decode(), SNAPSHOT)
    for name, value in {**COUNTERS, **GAUGES}.items():
        assert families[name].samples[0].value == value, name
    assert math.isnan(families["p2pdiloco_eval_loss"].samples[0].value)  # not evaluated yet: NaN, not absent
    assert math.isnan(families["p2pdiloco_mfu"].samples[0].value)  # a CPU peer: its peak, hence MFU, unknown
    assert len(families) == len(COUNTERS) + len(GAUGES) + 3


def test_metrics_server_serves_the_text_format(net_loop):
    snapshot = dict(SNAPSHOT)
    server = MetricsServer(lambda: snapshot, "127.0.0.1", 0)
    url = net_loop.run(server.start(), timeout=10)
    try:
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            first = parse_families(response.read().decode())
        snapshot["step"] = 121  # every scrape reads the peer's counters afresh
        with urllib.request.urlopen(url, timeout=10) as response:
            second = parse_families(response.read().decode())
        assert first["p2pdiloco_inner_steps"].samples[0].value == 120
        assert second["p2pdiloco_inner_steps"].samples[0].value == 121
        with pytest.raises(ConfigError, match="cannot serve the metrics on 127.0.0.1"):  # port taken: one line
            net_loop.run(MetricsServer(lambda: snapshot, "127.0.0.1", server.server.port).start(), timeout=10)
    finally:
        net_loop.run(server.stop(), timeout=10)


def test_ema_is_unbiased_from_the_first_value_and_follows_a_change():
    ema = Ema(span=20)
    assert math.isnan(ema.value)
    ema.add(4.0)
    assert ema.value == pytest.approx(4.0)  # bias-corrected: not pulled towards 0
    for _ in range(200):
        ema.add(2.0)
    assert ema.value == pytest.approx(2.0)
