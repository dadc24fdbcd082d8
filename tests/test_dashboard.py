"""The dashboard without a swarm: its bounded history of joins, leaves and points, and its HTTP routes
served from a fake DHT."""

from __future__ import annotations

import json
import time
import urllib.request
from types import SimpleNamespace

from hivemind.utils.timed_storage import get_dht_time

from p2pdiloco.observe.dashboard import POINT_FIELDS, Dashboard, Series, SwarmHistory
from tests.conftest import wait_for


def _rec(step, t, loss=3.0, name="", **extra):
    return {"name": name, "step": step, "tokens": step * 10, "tokens_per_s": 5.0, "loss": loss, "bytes_sent": step,
            "bytes_received": 2 * step, "time": t, **extra}


def test_history_records_points_joins_leaves_and_lost_peers():
    h = SwarmHistory("r", lost_after_s=10.0)
    h.observe({"a": _rec(1, 100.0, name="alice"), "b": _rec(1, 100.0)}, now=101.0)
    h.observe({"a": _rec(2, 102.0, name="alice"), "b": _rec(1, 100.0)}, now=103.0)  # b: no new heartbeat
    assert [e["event"] for e in h.events] == ["joined", "joined"]
    state = h.state()
    a, b = state["peers"]
    assert a["points"] == [[101.0, 1, 10, 3.0, None, 5.0, 1, 2], [103.0, 2, 20, 3.0, None, 5.0, 2, 4]]
    assert state["point_fields"] == list(POINT_FIELDS)
    assert len(b["points"]) == 1
    # a read that misses a record (a DHT timeout) is not a departure...
    h.observe({"a": _rec(3, 104.0)}, now=105.0)
    assert h.peers["b"].state == "live"
    # ...but a "left" record is, and so is silence longer than lost_after_s
    h.observe({"a": {"left": True, "time": 106.0}}, now=112.0)
    assert h.peers["a"].state == "left" and h.peers["b"].state == "lost"
    assert [(e["peer_id"], e["event"]) for e in h.events[2:]] == [("a", "left"), ("b", "lost")]
    assert h.events[2]["name"] == "alice"  # the last name its records gave, though its last live record had none
    h.observe({"a": _rec(1, 120.0, name="alice")}, now=121.0)  # came back (same peer id)
    assert h.peers["a"].state == "live" and h.events[-1] == {"time": 121.0, "peer_id": "a", "name": "alice",
                                                             "event": "joined"}
    assert [p[1] for p in h.swarm.points] == [2, 2, 2, 0, 1]  # live peers at each reading
    json.dumps(h.state(), allow_nan=False)


def test_a_peer_whose_name_comes_after_its_first_reading_gets_it_on_its_joined_event():
    h = SwarmHistory("r")  # a peer's name is in its config record, which may be read a poll after its heartbeat
    h.observe({"a": _rec(1, 100.0), "b": _rec(1, 100.0, name="bob")}, now=101.0)
    assert sorted((e["peer_id"], e["name"]) for e in h.events) == [("a", ""), ("b", "bob")]
    h.observe({"a": _rec(2, 102.0, name="alice"), "b": _rec(2, 102.0, name="bob")}, now=103.0)
    assert sorted((e["peer_id"], e["name"], e["event"]) for e in h.events) == [("a", "alice", "joined"),
                                                                               ("b", "bob", "joined")]
    assert sorted(p["name"] for p in h.state()["peers"]) == ["alice", "bob"]


def test_history_is_bounded():
    h = SwarmHistory("r", max_points=10, max_events=5, max_peers=3, lost_after_s=0.5)
    for i in range(40):
        h.observe({f"p{i}": _rec(i, float(i))}, now=float(i))  # a new peer every reading; the last one leaves
    assert len(h.peers) <= 3 and len(h.events) == 5
    assert len(h.swarm.points) <= 20


def test_series_thins_but_keeps_the_whole_span():
    s = Series(8)
    for i in range(100):
        s.add([i])
    assert len(s.points) <= 8 and s.points[0] == [0] and s.points[-1] == [99]
    assert [p[0] for p in s.points] == sorted(p[0] for p in s.points)


class FakeDHT:
    """Answers `get` as hivemind does: an object whose .value maps subkeys to items with .value and expiry."""

    def __init__(self):
        self.records: dict[str, dict] = {}

    def get(self, key, latest=False, return_future=False, **kwargs):
        async def found():
            exp = get_dht_time() + 30
            items = {k: SimpleNamespace(value=v, expiration_time=exp) for k, v in self.records.items()}
            return SimpleNamespace(value=items, expiration_time=exp)

        return found()


def _get(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.headers["Content-Type"], response.read().decode()


def test_dashboard_serves_its_page_and_api_from_the_records(net_loop):
    dht = FakeDHT()
    dht.records["12D3KooWpeer1"] = _rec(5, time.time(), name="alice", device="cpu", version="0.1.0")
    dashboard = Dashboard(dht, "r", "127.0.0.1", 0, refresh_s=0.2)
    url = net_loop.run(dashboard.start(), timeout=10)
    try:
        ctype, page = _get(url)
        assert ctype.startswith("text/html")
        for needle in ('id="chart-loss"', 'id="chart-tps"', 'id="chart-peers"', 'id="chart-bytes"', "api/state"):
            assert needle in page
        assert "http://" not in page.replace('"http://www.w3.org/2000/svg"', "")  # nothing from elsewhere

        def advanced():
            dht.records["12D3KooWpeer1"] = _rec(6, time.time(), name="alice")
            state = json.loads(_get(url + "api/state")[1])
            return state if len(state["peers"]) == 1 and len(state["peers"][0]["points"]) >= 2 else None

        state = wait_for(advanced, 20, what="two readings of the peer")
        assert state["run_id"] == "r" and state["refresh_s"] == 0.2
        assert state["status"]["totals"]["peers"] == 1 and state["events"][0]["event"] == "joined"
        ctype, status = _get(url + "api/status")
        assert ctype.startswith("application/json") and json.loads(status)["peers"][0]["name"] == "alice"
    finally:
        net_loop.run(dashboard.stop(), timeout=10)


class KeyedFakeDHT:
    """A fake DHT with a dictionary per key (the peer records' shards, the config key), counting reads per key."""

    def __init__(self):
        self.keys: dict[str, dict] = {}
        self.reads: dict[str, int] = {}

    def get(self, key, latest=False, return_future=False, **kwargs):
        self.reads[key] = self.reads.get(key, 0) + 1

        async def found():
            exp = get_dht_time() + 30
            items = {k: SimpleNamespace(value=v, expiration_time=exp) for k, v in self.keys.get(key, {}).items()}
            return SimpleNamespace(value=items, expiration_time=exp)

        return found()


def test_the_dashboard_reads_what_peers_say_about_themselves_when_a_peer_is_new_not_every_poll(net_loop):
    from p2pdiloco.network.swarm import config_key, peer_shard, peers_key

    dht = KeyedFakeDHT()

    def live(peer: str, step: int) -> None:
        record = _rec(step, time.time())
        del record["name"]  # in the config record, not in a heartbeat
        dht.keys.setdefault(peers_key("r", peer_shard(peer)), {})[peer] = record

    live("12D3KooWa", 1)
    dht.keys[config_key("r")] = {"12D3KooWa": {"fingerprint": {}, "name": "alice", "device": "cpu"}}
    dashboard = Dashboard(dht, "r", "127.0.0.1", 0, refresh_s=0.2)

    def poll() -> dict:
        net_loop.run(dashboard.poll_once(), 10)
        return {p["peer_id"]: p for p in dashboard.history.status["peers"]}

    for step in (1, 2, 3):
        live("12D3KooWa", step)
        assert poll()["12D3KooWa"]["name"] == "alice"
    assert dht.reads[config_key("r")] == 1 and dht.reads[peers_key("r", peer_shard("12D3KooWa"))] == 3
    live("12D3KooWb", 1)  # a new peer, whose config record is not there yet: read at once, then again later
    assert poll()["12D3KooWb"]["name"] == "" and dht.reads[config_key("r")] == 2
    dht.keys[config_key("r")]["12D3KooWb"] = {"name": "bob", "device": "cpu"}
    assert poll()["12D3KooWb"]["name"] == "" and dht.reads[config_key("r")] == 2
    dashboard._about_read -= 10.0  # as if ABOUT_RETRY_S had passed
    assert poll()["12D3KooWb"]["name"] == "bob" and dht.reads[config_key("r")] == 3
