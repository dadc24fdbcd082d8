"""`bench dht`: both store paths run on real DHT nodes, every node's heartbeat stays findable, and the
per-request split adds up to the total."""

from __future__ import annotations

import pytest

from p2pdiloco.bench import dht as bench
from p2pdiloco.network import census, swarm
from p2pdiloco.network.dht_store import DHT_REPLICAS, store_near


@pytest.mark.integration
@pytest.mark.parametrize("baseline", [True, False], ids=["hivemind", "store_near"])
def test_a_short_run_measures_traffic_and_finds_every_heartbeat(baseline, monkeypatch):
    monkeypatch.setattr(bench, "SETTLE_S", 3.0)
    r = bench.run_dht(3, seconds=4.0, baseline=baseline)
    assert r["records_seen"] == 3
    assert r["bytes_per_s_max"] >= r["bytes_per_s_mean"] > 0
    # every byte a node counted is a find, a store or a ping of its own or served for others
    split = sum(v["bytes_per_s"] for v in r["by_rpc"].values())
    assert split == pytest.approx(r["bytes_per_s_mean"], rel=1e-6)
    assert r["by_rpc"]["store"]["requests_per_s"] > 0
    # the baseline's patch is undone
    assert swarm.store_near is store_near and swarm.DHT_READ_BEAM == swarm.DHT_REPLICAS == DHT_REPLICAS
    assert census.read_near_subkeys is swarm.read_near_subkeys
