"""Joining mid-run: state download from live peers, verified; and a swarm that outlives its bootstrap node."""

from __future__ import annotations

import json
import random
import subprocess

import psutil
import pytest
import torch

from p2pdiloco.algorithm.outer import state_digest
from p2pdiloco.network.state_sync import (
    GlobalState,
    StateError,
    StateSync,
    bounded_counters,
    donor_order,
    pack_state,
    unpack_state,
    wanted_digest,
)
from p2pdiloco.network.wire import ByteCounter
from tests.conftest import interrupt_and_reap, start_local_dht, wait_for
from tests.test_cli import CLI
from tests.test_decoupled import PACED, merges

pytestmark = pytest.mark.integration


def _state(seed: int, round_: int, n: int = 1000) -> GlobalState:
    g = torch.Generator().manual_seed(seed)
    return GlobalState(torch.randn(n, generator=g), torch.randn(n, generator=g), round_, round_ * 10, round_ * 100.0)


def test_pack_unpack_verifies_everything():
    header, payload = pack_state(_state(0, 3))
    got = unpack_state(header, payload, 1000)
    assert torch.equal(got.global_params, _state(0, 3).global_params) and got.round == 3 and got.step == 30
    with pytest.raises(StateError, match="checksum"):
        unpack_state(header, payload[:-4] + b"\x00\x00\x80\x7f", 1000)
    with pytest.raises(StateError, match="expected 999"):
        unpack_state(header, payload, 999)
    nan = pack_state(GlobalState(torch.full((1000,), float("nan")), torch.zeros(1000), 1, 1, 1.0))
    with pytest.raises(StateError, match="non-finite"):
        unpack_state(*nan, 1000)


def test_a_copy_of_the_records_counts_as_fresh_only_if_every_other_live_record_is_from_the_last_heartbeat():
    """A starting peer's first read is one node's copy, refreshed every few beats: a joiner 12 s into a run read
    the swarm's first beats there (nobody ahead) and trained alone from step 0. It reads again by walks unless
    every other live record is younger than one heartbeat."""
    from hivemind.utils.timed_storage import get_dht_time

    from p2pdiloco.app.joining import _fresh

    now = get_dht_time()
    fresh = {"a": {"time": now - 1.0, "global_tokens": 0}, "b": {"time": now - 4.0}}
    assert _fresh(fresh, "me", 5.0) and _fresh({}, "me", 5.0)
    assert not _fresh({**fresh, "c": {"time": now - 12.0, "global_tokens": 0}}, "me", 5.0)  # a beat may be newer
    assert not _fresh({**fresh, "c": {"global_tokens": 9}}, "me", 5.0)  # no time: not known fresh
    assert _fresh({**fresh, "me": {"time": now - 60.0}, "gone": {"left": True, "time": now - 60.0}}, "me", 5.0)


def test_donor_order_most_agreed_first_and_spread():
    records = {"a": {"global_digest": "x"}, "b": {"global_digest": "x"}, "c": {"global_digest": "y", "round": 99},
               "d": {"global_digest": ""}, "me": {"global_digest": "x"}}
    orders = {tuple(donor_order(records, "me", random.Random(s))) for s in range(20)}
    # a claim (round 99) buys nothing: the model two peers hold comes first; a peer with no model is no donor
    assert all(o[-1] == "c" and set(o[:2]) == {"a", "b"} and "d" not in o for o in orders)
    assert len(orders) == 2  # joiners arriving together do not all pick the same first donor


def test_donors_others_cannot_dial_are_tried_after_those_holding_the_same_model():
    records = {"nat": {"global_digest": "x", "reachable": False}, "open": {"global_digest": "x", "reachable": True},
               "old": {"global_digest": "x"}, "lone": {"global_digest": "y"}}
    orders = {tuple(donor_order(records, "me", random.Random(s))) for s in range(20)}
    assert all(set(o[:2]) == {"open", "old"} and o[2:] == ("nat", "lone") for o in orders)  # support comes first


def test_bounded_counters_cap_a_donors_claims_by_the_median_record():
    claimed = GlobalState(torch.zeros(3), torch.zeros(3), round=10**9, step=10**9, global_tokens=1e30)
    records = {"a": {"round": 7, "step": 70, "global_tokens": 700.0}, "b": {"round": 8, "step": 80, "global_tokens": 800.0},
               "liar": {"round": 10**9, "step": 10**9, "global_tokens": 1e30}, "me": {"step": 10**12}}
    got = bounded_counters(claimed, records, "me")
    assert (got.round, got.step, got.global_tokens) == (8, 80, 800.0)
    honest = GlobalState(torch.zeros(3), torch.zeros(3), round=7, step=70, global_tokens=700.0)
    assert (bounded_counters(honest, records, "me").step, bounded_counters(honest, {}, "me").step) == (70, 70)


def _started(dhts, net_loop, states):
    syncs = [StateSync(d, "j", 1000, (lambda st=st: st), ByteCounter()) for d, st in zip(dhts, states, strict=True)]
    for s in syncs:
        net_loop.run(s.start(), 10)
    return syncs


def test_joiner_downloads_bit_identical_state_and_skips_a_bad_donor(bootstrap_dht, net_loop):
    maddrs = [str(m) for m in bootstrap_dht.get_visible_maddrs()]
    dhts = [start_local_dht(maddrs) for _ in range(3)]
    try:
        good = _state(1, 7)
        digest = state_digest(good.global_params, good.momentum)
        donor, liar, joiner = _started(dhts, net_loop, [good, None, None])  # the liar has no state to give
        ids = [d.peer_id.to_base58() for d in dhts]
        records = {ids[0]: {"round": 7, "step": 70, "global_tokens": 700.0, "global_digest": digest},
                   ids[1]: {"round": 8, "step": 80, "global_tokens": 800.0, "global_digest": digest}}
        state, source = net_loop.run(joiner.fetch(records, ids[2], timeout=10), 30)
        assert source == ids[0]  # whichever was tried first, the one without a state gave none
        assert torch.equal(state.global_params, good.global_params) and torch.equal(state.momentum, good.momentum)
        assert (state.round, state.step, state.global_tokens) == (7, 70, 700.0)
        assert joiner.counter.received > 2 * 1000 * 4
    finally:
        for d in dhts:
            d.shutdown()


def test_joiner_refuses_a_state_no_other_live_peer_holds(bootstrap_dht, net_loop):
    """Poisoned joiners: a donor serving a model of its own (digest in its own record only) and claiming
    step 10⁹ is refused; the joiner takes the state two live peers hold, with counters as the records say."""
    maddrs = [str(m) for m in bootstrap_dht.get_visible_maddrs()]
    dhts = [start_local_dht(maddrs) for _ in range(4)]
    try:
        good = _state(1, 7)
        poison = GlobalState(-good.global_params, good.momentum, 10**9, 10**9, 1e30)
        digest, bad_digest = (state_digest(s.global_params, s.momentum) for s in (good, poison))
        _, _, hostile, joiner = _started(dhts, net_loop, [good, good, poison, None])
        ids = [d.peer_id.to_base58() for d in dhts]
        honest = {"round": 7, "step": 70, "global_tokens": 700.0, "global_digest": digest}
        records = {ids[0]: honest, ids[1]: honest,
                   ids[2]: {"round": 10**9, "step": 10**9, "global_tokens": 1e30, "global_digest": bad_digest}}
        refused = net_loop.run(joiner.fetch({ids[2]: records[ids[2]], ids[0]: {"global_digest": "zz"}}, ids[3], timeout=10), 30)
        assert refused is None  # the hostile donor's state is held by nobody else: not taken
        state, source = net_loop.run(joiner.fetch(records, ids[3], timeout=10), 30)
        assert source in ids[:2] and torch.equal(state.global_params, good.global_params)
        assert (state.round, state.step, state.global_tokens) == (7, 70, 700.0)
    finally:
        for d in dhts:
            d.shutdown()


def test_joiner_reads_the_records_again_when_rounds_outpace_heartbeats(bootstrap_dht, net_loop):
    """Where rounds are shorter than a heartbeat, a donor serves a state that no record names yet: the joiner
    reads the records again (up to `passes`), keeping what every read named, and takes the state once a live
    peer's record has named it; a state only its donor's record ever names stays refused through every pass."""
    maddrs = [str(m) for m in bootstrap_dht.get_visible_maddrs()]
    dhts = [start_local_dht(maddrs) for _ in range(3)]
    try:
        fresh = _state(2, 9)
        digest = state_digest(fresh.global_params, fresh.momentum)
        _, _, joiner = _started(dhts, net_loop, [fresh, None, None])
        ids = [d.peer_id.to_base58() for d in dhts]
        lagging = {ids[0]: {"round": 8, "global_digest": "older"}, ids[1]: {"round": 8, "global_digest": "older"}}
        reads = []

        async def refresh(named_by_b: str):
            reads.append(named_by_b)
            return {ids[0]: {"round": 9, "global_digest": "newer"}, ids[1]: {"round": 9, "global_digest": named_by_b}}

        assert net_loop.run(joiner.fetch(lagging, ids[2], timeout=10, refresh=lambda: refresh(digest), passes=1), 30) is None
        assert reads == []  # one pass: the records are not read again
        # B's record named the donor's state in between (then moved on): enough
        state, source = net_loop.run(joiner.fetch(lagging, ids[2], timeout=10, refresh=lambda: refresh(digest), passes=3), 30)
        assert source == ids[0] and torch.equal(state.global_params, fresh.global_params) and reads == [digest]
        reads.clear()
        refused = net_loop.run(joiner.fetch(lagging, ids[2], timeout=10, refresh=lambda: refresh("other"), passes=3), 30)
        assert refused is None and reads == ["other", "other"]  # no other peer ever held it: refused after every pass
    finally:
        for d in dhts:
            d.shutdown()


def test_a_joiner_asks_for_the_digest_most_records_name_and_the_most_tokens_among_equals():
    records = {"a": {"global_digest": "x", "global_tokens": 100.0}, "b": {"global_digest": "x", "global_tokens": 100.0},
               "c": {"global_digest": "y", "global_tokens": 200.0}, "d": {"global_digest": "y", "global_tokens": 200.0},
               "e": {"global_digest": "y", "global_tokens": 200.0}, "me": {"global_digest": "z"}}
    assert wanted_digest(records, "me") == "y"  # three records name y
    records["f"] = records["g"] = {"global_digest": "x", "global_tokens": 100.0}
    assert wanted_digest(records, "me") == "x"  # a claim of more tokens buys nothing against more records
    records = {"a": {"global_digest": "x", "global_tokens": 100.0}, "b": {"global_digest": "x", "global_tokens": float("nan")},
               "c": {"global_digest": "y", "global_tokens": 1e30}, "d": {"global_digest": "y", "global_tokens": 1.0}}
    assert wanted_digest(records, "me") == "y"  # a tie in records: the most tokens claimed (a NaN claims none)
    # no digest named by two live peers: nothing to ask for; one live peer with a model: its own digest
    assert wanted_digest({"a": {"global_digest": "x"}, "b": {"global_digest": "y"}}, "me") is None
    assert wanted_digest({"a": {"global_digest": "x"}, "b": {"global_digest": ""}}, "me") == "x"


def test_donors_serve_the_state_their_records_name_after_moving_on(bootstrap_dht, net_loop):
    """Rounds shorter than a heartbeat: both donors moved on to states of their own that no record names, but they
    still hold the one their records name, and serve it when asked: the joiner takes it in its first pass, without
    reading the records again. A donor that holds it no longer serves its current state (refused as before)."""
    maddrs = [str(m) for m in bootstrap_dht.get_visible_maddrs()]
    dhts = [start_local_dht(maddrs) for _ in range(3)]
    try:
        named, now_a, now_b = _state(3, 7), _state(4, 8), _state(5, 8)
        digest = state_digest(named.global_params, named.momentum)
        held = {digest: named}
        syncs = [StateSync(d, "j", 1000, (lambda st=st: st), ByteCounter(), held=h)
                 for d, st, h in zip(dhts, [now_a, now_b, None], [held.get, held.get, None], strict=True)]
        for s in syncs:
            net_loop.run(s.start(), 10)
        ids = [d.peer_id.to_base58() for d in dhts]
        records = {ids[0]: {"round": 7, "global_digest": digest}, ids[1]: {"round": 7, "global_digest": digest}}
        state, source = net_loop.run(syncs[2].fetch(records, ids[2], timeout=10, passes=1), 30)
        assert source in ids[:2] and torch.equal(state.global_params, named.global_params)
        assert torch.equal(state.momentum, named.momentum) and state.round == 7
        held.clear()  # the donors no longer hold it: each serves its own current state, which no record names
        assert net_loop.run(syncs[2].fetch(records, ids[2], timeout=10, passes=1), 30) is None
    finally:
        for d in dhts:
            d.shutdown()


def test_peer_joining_mid_run_takes_the_swarm_state_and_merges(tmp_path):
    local = subprocess.Popen([*CLI, "local", "--peers", "2", "--steps", "100000", "--run-dir", str(tmp_path / "swarm"),
                              *PACED], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    joiner = None
    try:
        wait_for(lambda: len(merges(tmp_path / "swarm", "peer0")) >= 3, 90, what="the swarm's first merges")
        maddr = (tmp_path / "swarm" / "bootstrap.maddr").read_text().strip()
        jdir = tmp_path / "joiner"
        log = tmp_path / "joiner.log"
        with open(log, "wb") as out:
            joiner = subprocess.Popen([*CLI, "peer", "--initial-peers", maddr, "--host", "127.0.0.1", "--run-dir",
                                       str(jdir), "--steps", "100000", *PACED], stdout=out, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL)

        def joined_and_merged():
            path = jdir / "metrics.jsonl"
            rows = [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")] if path.exists() else []
            return [r for r in rows if r["kind"] == "join"] and [r for r in rows if r["kind"] == "merge" and r["group_size"] > 1]

        try:
            wait_for(joined_and_merged, 90, what="the joiner to download the state and merge")
        except pytest.fail.Exception:
            print("the joiner's output, last 60 lines:", *log.read_text(errors="replace").splitlines()[-60:], sep="\n")
            raise
        rows = [json.loads(x) for x in (jdir / "metrics.jsonl").read_text().splitlines() if x.endswith("}")]
        (join,) = [r for r in rows if r["kind"] == "join"]
        assert join["round"] >= 3 and join["step"] > 0
        assert rows[0]["kind"] == "start" and rows[0]["process_s"] > 0  # the download is part of this start-up
        laps = rows[0]["startup"]
        assert set(laps) == {"interpreter_and_imports", "device_and_tokenizer", "dht_with_data_and_model", "merger",
                             "learner"}
        in_turn = sum(v["wall"] if isinstance(v, dict) else v for v in laps.values())  # parallel parts: their wall
        assert in_turn <= rows[0]["process_s"] + 0.01
        donor_digests = {m["global_digest"] for p in ("peer0", "peer1") for m in merges(tmp_path / "swarm", p)}
        assert join["global_digest"] in donor_digests  # bit-identical to a state the donor held
    finally:
        for proc in (joiner, local):
            interrupt_and_reap(proc)


def test_swarm_outlives_its_bootstrap_node(tmp_path):
    maddr_file = tmp_path / "boot.maddr"
    boot = subprocess.Popen([*CLI, "bootstrap", "--host", "127.0.0.1", "--port", "0", "--identity", str(tmp_path / "b.key"),
                             "--maddr-file", str(maddr_file)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL)
    procs = []
    try:
        wait_for(maddr_file.exists, 30, what="bootstrap address")
        maddr = maddr_file.read_text().split()[0]

        def peer(name: str, initial: str) -> subprocess.Popen:
            return subprocess.Popen([*CLI, "peer", "--initial-peers", initial, "--host", "127.0.0.1", "--name", name,
                                     "--run-dir", str(tmp_path / name), "--steps", "100000", *PACED],
                                    stdout=(tmp_path / f"{name}.log").open("w"), stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)

        def merged(name: str, after: int = 0) -> bool:
            path = tmp_path / name / "metrics.jsonl"
            rows = [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")] if path.exists() else []
            return sum(1 for r in rows if r["kind"] == "merge" and r["group_size"] > 1) > after

        procs = [peer("a", maddr), peer("b", maddr)]
        wait_for(lambda: merged("a") and merged("b"), 90, what="a and b merging")
        tree = [psutil.Process(boot.pid), *psutil.Process(boot.pid).children(recursive=True)]
        for p in tree:
            p.kill()  # the bootstrap host loses power
        psutil.wait_procs(tree, timeout=10)
        # a newcomer joins through a live peer's address, which every peer prints at start
        line = next(x for x in (tmp_path / "a.log").read_text().splitlines() if "others can join with" in x)
        procs.append(peer("c", line.split()[-1]))
        wait_for(lambda: merged("c"), 90, what="the newcomer merging without the bootstrap node")
    finally:
        for p in procs:
            interrupt_and_reap(p)
        if boot.poll() is None:
            boot.kill()
        boot.wait()


def test_a_peer_restarted_after_the_swarm_finished_does_not_train_on_alone(bootstrap_dht, net_loop, tmp_path):
    from hivemind.utils.timed_storage import get_dht_time

    from p2pdiloco.app.heartbeat import Heartbeat, swarm_finished
    from p2pdiloco.network.swarm import read_peers

    # a peer that finished leaves a 'finished' record that outlives its heartbeats (real DHT, real expiry)
    done, late = start_local_dht([str(m) for m in bootstrap_dht.get_visible_maddrs()]), None
    try:
        late = start_local_dht([str(m) for m in bootstrap_dht.get_visible_maddrs()])
        hb = Heartbeat(done, "fin", done.peer_id.to_base58(), lambda: {"step": 100}, period=0.5)
        net_loop.run(hb.leave(finished_at=100), 10)
        me = late.peer_id.to_base58()

        def finished():
            records = net_loop.run(read_peers(late, "fin"), 10)
            return swarm_finished(records, me, total_steps=100)

        wait_for(lambda: finished() is not None, 20, what="the finished record")
        assert finished() == (done.peer_id.to_base58(), 100)
        assert hb._expiration > get_dht_time() + 600  # not 3 heartbeats: an hour
        # what the restarted peer does with it: trains nothing, and says so in its summary, so that the run's
        # summary leaves its model out of the final models (`local --chaos` reported such runs "apart")
        from p2pdiloco.app.joining import join_swarm_state
        from p2pdiloco.network.peer_records import PeerSample
        from p2pdiloco.network.swarm import PEER_SHARDS
        from p2pdiloco.testing.inmemory import InMemoryMerger
        from tests.test_learner import _cfg, _learner

        cfg = _cfg(**{"swarm.run_id": "fin", "run.total_steps": 100})
        learner = _learner(cfg, InMemoryMerger(me, {"group_size": 2}), tmp_path, 0)
        join_swarm_state(learner, None, net_loop, late, cfg, me, learner.report.metrics)
        summary = learner.run()
        assert summary["arrived_after_end"] is True and summary["inner_steps"] == 0
        # a peer decides by the records it read once at its start (for its config check too), with no DHT to read,
        # where every live record in them is from the last heartbeat
        records = net_loop.run(read_peers(late, "fin"), 10)
        live = {done.peer_id.to_base58(): {"step": 50, "global_tokens": 0, "time": get_dht_time()}}
        for given, over in ((records, True), (live, False)):
            (tmp_path / f"again{over}").mkdir()
            again = _learner(cfg, InMemoryMerger(me, {"group_size": 2}), tmp_path / f"again{over}", 0)
            every = PeerSample(given, tuple(range(PEER_SHARDS)))
            join_swarm_state(again, None, net_loop, None, cfg, me, again.report.metrics, every=every)
            assert again.ended_with_swarm is over and again.report.arrived_after_end is over
    finally:
        for d in (done, late):
            if d is not None:
                d.shutdown()
    # live peers, a peer that left early, or one that finished fewer steps: the run is not over
    assert swarm_finished({"a": {"step": 50}, "b": {"left": True, "finished": True, "step": 100}}, "me", 100) is None
    assert swarm_finished({"b": {"left": True, "step": 100}}, "me", 100) is None
    assert swarm_finished({"b": {"left": True, "finished": True, "step": 90}}, "me", 100) is None
    assert swarm_finished({"me": {"left": True, "finished": True, "step": 100}}, "me", 100) is None
