"""A peer's own telemetry: recent throughput, and the Prometheus text it serves."""

from __future__ import annotations

import pytest

from p2pdiloco.telemetry import RateMeter


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
