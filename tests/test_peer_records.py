"""What a peer's records say and who reads what (network/peer_records.py): the heartbeat carries what changes, the
config record what a peer says about itself once; a starting peer reads some shards of the records, not the swarm's."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.utils.timed_storage import get_dht_time

from p2pdiloco.app import heartbeat as heartbeat_module
from p2pdiloco.app import joining
from p2pdiloco.app.heartbeat import Heartbeat
from p2pdiloco.network import peer_records
from p2pdiloco.network.peer_records import ABOUT_FIELDS, PeerSample, read_with_about, sample_peers, with_about
from p2pdiloco.network.swarm import PEER_SHARDS, config_key, read_subkeys
from p2pdiloco.observe.status import swarm_status
from tests.conftest import start_local_dht, wait_for

ME = "12D3KooWme"


def _shards(live: list[int], left: int = 0) -> dict[int, dict[str, dict]]:
    """Records by shard: `live[s]` live peers in shard s, and `left` peers that left in the last one."""
    now = get_dht_time()
    out = {s: {f"12D3KooW{s}x{i}": {"step": 1, "global_tokens": 0, "time": now} for i in range(n)}
           for s, n in enumerate(live)}
    out[len(live) - 1].update({f"12D3KooWleft{i}": {"left": True, "time": now} for i in range(left)})
    return out


class FakeReads:
    """Stands in for `swarm.read_peers`: answers from `by_shard` and remembers which shards each call read."""

    def __init__(self, by_shard: dict[int, dict[str, dict]]):
        self.by_shard, self.calls = by_shard, []

    async def __call__(self, dht, run_id, timeout=5.0, near=False, shards=None):
        shards = tuple(range(PEER_SHARDS) if shards is None else shards)
        self.calls.append((shards, near))
        return {p: r for s in shards for p, r in self.by_shard[s].items()}


def test_a_start_reads_one_shard_when_it_holds_enough_live_peers_and_every_shard_otherwise(monkeypatch):
    reads = FakeReads(_shards([5, 1, 0, 2], left=3))
    monkeypatch.setattr(peer_records, "read_peers", reads)
    monkeypatch.setattr(peer_records.random, "sample", lambda population, k: [0, 1, 2, 3])
    sample = asyncio.run(sample_peers(None, "r", ME, enough=4))
    assert reads.calls == [((0,), True)] and sample.shards == (0,) and not sample.whole
    assert len(sample.records) == 5
    # a first shard with fewer live peers (3 that left do not count, nor does this peer): every shard, one more read
    reads.by_shard[3][ME] = {"step": 0, "time": get_dht_time()}
    monkeypatch.setattr(peer_records.random, "sample", lambda population, k: [3, 0, 1, 2])
    reads.calls.clear()
    sample = asyncio.run(sample_peers(None, "r", ME, enough=4))
    assert reads.calls == [((3,), True), ((0, 1, 2), True)] and sample.whole
    assert len(sample.records) == 5 + 1 + 2 + 3 + 1


class SyncLoop:
    """`BackgroundLoop.run` without a thread."""

    @staticmethod
    def run(coro, timeout=None):
        return asyncio.run(coro)


@pytest.mark.parametrize(("case", "walked"), [
    ("fresh, nobody ahead", []),
    ("stale copy, nobody ahead", [(0,)]),
    ("fresh, a peer ahead", [tuple(range(PEER_SHARDS))]),
    ("fresh, nobody else live", [tuple(range(PEER_SHARDS))]),
])
def test_a_sample_of_the_records_stands_for_the_swarm_only_while_it_shows_live_peers_and_none_ahead(
        monkeypatch, case, walked):
    from tests.test_learner import _cfg

    by_shard = _shards([4, 3, 3, 3])
    if "ahead" in case and "nobody" not in case:
        by_shard[2]["12D3KooW2x0"]["global_tokens"] = 10**6  # in a shard the sample did not read
        by_shard[0]["12D3KooW0x1"]["global_tokens"] = 10**6
    if "nobody else" in case:
        by_shard[0] = {p: {"left": True, "time": get_dht_time()} for p in by_shard[0]}
    sampled = {p: dict(r) for p, r in by_shard[0].items()}
    if "stale" in case:
        for r in sampled.values():
            r["time"] -= 60  # written a few beats ago: a newer beat may be on another node
    reads = FakeReads(by_shard)
    monkeypatch.setattr(joining, "read_peers", reads)
    cfg = _cfg(**{"swarm.run_id": "r"})
    got = joining._look(SyncLoop(), None, cfg, ME, PeerSample(sampled, (0,)), global_tokens=0.0)
    assert [shards for shards, near in reads.calls] == walked and not any(near for _, near in reads.calls)
    assert set(got) == {p for s in {s for shards in walked for s in shards} | {0} for p in by_shard[s]}


def test_status_rows_take_what_a_peer_says_about_itself_from_its_config_record():
    now = get_dht_time()
    records = {"12D3KooWa": {"step": 7, "time": now, "fingerprint": "d1"},
               "12D3KooWb": {"step": 3, "time": now, "name": "own"},
               "12D3KooWc": {"step": 1, "time": now}}
    configs = {"12D3KooWa": {"fingerprint": {"model": {}}, "name": "alice", "device": "cpu", "version": "0.1.0",
                             "maddrs": ["/ip4/127.0.0.1/tcp/1/p2p/x"], "started": now - 5, "reach_detail": "ok"},
               "12D3KooWb": {"name": "written-once"},
               "12D3KooWc": ["not", "a", "record"]}
    merged = with_about(records, configs)
    assert merged["12D3KooWa"]["fingerprint"] == "d1"  # the full fingerprint stays out of the rows
    assert set(merged["12D3KooWa"]) == {"step", "time", "fingerprint", *ABOUT_FIELDS}
    rows = {p["peer_id"]: p for p in swarm_status(merged, "r", now)["peers"]}
    assert rows["12D3KooWa"]["name"] == "alice" and rows["12D3KooWa"]["device"] == "cpu"
    assert rows["12D3KooWa"]["maddrs"] == ["/ip4/127.0.0.1/tcp/1/p2p/x"] and rows["12D3KooWa"]["started"] == now - 5
    assert rows["12D3KooWb"]["name"] == "own"  # what the heartbeat says wins
    assert rows["12D3KooWc"]["name"] == "" and rows["12D3KooWc"]["device"] == "?"


@pytest.mark.integration
def test_the_config_record_holds_what_a_peer_says_about_itself_written_once_and_again_on_change(
        bootstrap_dht, net_loop, monkeypatch):
    peer = start_local_dht([str(m) for m in bootstrap_dht.get_visible_maddrs()])
    writes: list[str] = []
    real = heartbeat_module.write_subkey

    async def counted(dht, key, subkey, value, expiration, **kwargs):
        writes.append(key)
        return await real(dht, key, subkey, value, expiration, **kwargs)

    monkeypatch.setattr(heartbeat_module, "write_subkey", counted)
    me = peer.peer_id.to_base58()
    about = {"name": "alice", "version": "0.1.0", "maddrs": ["/ip4/127.0.0.1/tcp/1"], "device": "cpu",
             "started": 1.0, "reach_detail": ""}
    beat = Heartbeat(peer, "about", me, lambda: {"step": 1, "fingerprint": "d1", "reachable": None}, period=0.2)
    task = net_loop.submit(beat.run({"model": {"n_layer": 2}}, lambda: dict(about)))
    try:
        def config_says(detail: str):
            got = net_loop.run(read_subkeys(bootstrap_dht, config_key("about")), 10).get(me)
            return got if got and got.get("reach_detail") == detail else None

        got = wait_for(lambda: config_says(""), 15, what="the config record")
        assert got == {"fingerprint": {"model": {"n_layer": 2}}, **about}
        wait_for(lambda: beat.beats >= 5, 15, what="five heartbeats")
        assert writes.count(config_key("about")) == 1  # not with every beat
        heartbeat = net_loop.run(read_subkeys(bootstrap_dht, beat.key), 10)[me]
        assert not set(ABOUT_FIELDS) & set(heartbeat)
        about["reach_detail"] = "dialed back"  # the dial-back's verdict came: written again, at the next beat
        wait_for(lambda: config_says("dialed back"), 15, what="the config record written again")
        assert writes.count(config_key("about")) == 2
        shown = net_loop.run(read_with_about(bootstrap_dht, "about"), 10)[me]
        assert shown["name"] == "alice" and shown["step"] == 1 and "fingerprint" in shown
    finally:
        task.cancel()
        peer.shutdown()
