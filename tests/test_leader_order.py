"""A leader order nobody can grind (docs/security.md, "The leader order").

Groups are dealt by a public hash of (run, peer id, epoch), so an id can be ground to rank first in it. Who leads
is drawn from nonces the ready mates committed to in the census before the epoch and reveal in their ready words:
here the pieces (commitments, reveals, the order, passing over), then the attack itself against real DHTs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time

import torch
from hivemind.utils.timed_storage import get_dht_time

from p2pdiloco.network import census as census_module
from p2pdiloco.network.census import Census, commit_of, commitment, epoch_of, leader_rank, secret_of
from p2pdiloco.network.identity import PeerIdentity
from p2pdiloco.network.leaders import REVEAL_WAIT_S, SILENT_ROUNDS, Leaders
from p2pdiloco.network.merger import Contribution
from p2pdiloco.testing.hostile import silent_leader
from tests.conftest import flat, merge_config, running_mergers

N = 1001


def _census(peer: str, monkeypatch, stored: list) -> Census:
    """A census whose DHT stores are kept in `stored` and whose reads return `records` set on it."""

    async def write(dht, key, subkey, value, expiration, timeout=5.0):
        stored.append(value)
        return True

    async def read(dht, key, timeout=5.0):
        return dict(census.records)

    monkeypatch.setattr(census_module, "write_subkey", write)
    monkeypatch.setattr(census_module, "read_subkeys", read)
    monkeypatch.setattr(census_module, "read_near_subkeys", read)
    census = Census(None, "run", peer)
    census.records = {}
    return census


def test_a_record_commits_to_the_next_epochs_nonce_and_a_peer_reveals_only_what_it_committed_to_ahead(monkeypatch):
    stored: list = []
    me = _census("me", monkeypatch, stored)
    asyncio.run(me.register(7))  # first registration, in epoch 7: commits to 8's nonce only
    assert stored[-1]["epoch"] == 8 and stored[-1]["commit"] == commitment(me.nonce(8)) and "prev" not in stored[-1]
    assert me.reveal(7) is None  # a commitment stored in the epoch it counts for proves nothing
    asyncio.run(me.register(8))  # renewed in epoch 8: still stands for 8, by `prev`
    assert stored[-1]["epoch"] == 9 and commit_of(stored[-1], 8) == commitment(me.nonce(8))
    assert commit_of(stored[-1], 9) == commitment(me.nonce(9)) and commit_of(stored[-1], 7) is None
    assert me.reveal(8) == me.nonce(8) and me.nonce(8) != me.nonce(9)
    assert commit_of({"epoch": 9, "commit": b"short"}, 9) is None and commit_of([9], 9) is None


def test_commitments_read_after_this_peer_revealed_are_not_counted(monkeypatch):
    me = _census("me", monkeypatch, [])
    early, late, changed = (os.urandom(16) for _ in range(3))
    me.records = {"early": {"epoch": 5, "commit": commitment(early)}}
    asyncio.run(me.members(5))
    me.reveal(5)  # this peer's nonce for 5 is out: a commitment first seen now may have been chosen after it
    me.records = {"early": {"epoch": 5, "commit": commitment(changed)}, "late": {"epoch": 5, "commit": commitment(late)}}
    me.saw("late", 5)
    me._views[5] = (me._views[5][0] - census_module.REREAD_S, me._views[5][1])
    assert asyncio.run(me.members(5)) == {"me", "early", "late"}  # a mate, dealt and invited as any
    assert me.commit("early", 5) == commitment(early)  # the first commitment read stays
    assert me.commit("late", 5) is None  # read after this peer revealed: never leads this epoch, its nonce unmixed


def test_the_order_is_drawn_from_every_checked_nonce_and_a_wrong_or_missing_one_does_not_lead(monkeypatch):
    me = _census("me", monkeypatch, [])
    asyncio.run(me.register(4))
    asyncio.run(me.register(5))
    nonces = {p: os.urandom(16) for p in ("a", "b", "c")}
    me.records = {p: {"epoch": 5, "commit": commitment(n)} for p, n in nonces.items()}
    asyncio.run(me.members(5))
    leaders = Leaders("run", me)
    assert leaders.reveal(5) == {"nonce": me.nonce(5)}
    mates = ["me", "a", "b", "c", "d"]  # d: no commitment (its first epoch)
    for p in ("a", "b"):
        leaders.heard(p, {"epoch": 5, "nonce": nonces[p]})
    leaders.heard("c", {"epoch": 5, "nonce": os.urandom(16)})  # not what it committed to
    order = leaders.order(mates, set(mates), 5)
    assert set(order[:3]) == {"me", "a", "b"} and order[3:] == ["c", "d"]  # unchecked ones last, in dealt order
    assert leaders.order(mates, {"a", "d"}, 5) == ["a", "d"]  # only the ready ones
    # drawn from every mate's reveal, ready now or not: mates that see others start and stop looking at different
    # times still agree on who leads
    for ready in ({"me", "a"}, {"me", "b"}, {"a", "b"}):
        assert leaders.order(mates, ready, 5) == [p for p in order if p in ready]
    # every revealed nonce moves the order: over many draws each checked mate leads about equally often
    firsts = []
    for _ in range(300):
        leaders.heard("a", {"epoch": 5, "nonce": (n := os.urandom(16))})
        me._commits[5]["a"] = commitment(n)
        firsts.append(leaders.order(mates, set(mates), 5)[0])
    assert all(50 < firsts.count(p) < 150 for p in ("me", "a", "b")), {p: firsts.count(p) for p in set(firsts)}


def test_at_an_epoch_turn_a_ready_mate_whose_reveal_is_on_its_way_is_followed_first_and_both_then_agree(monkeypatch):
    """Each mate holds its own nonce for the new epoch at once and the other's a ready word later: ranking itself
    first, each would lead and decline the other's invite. Until the reveal comes (at most `REVEAL_WAIT_S`), the
    mate it waits for is first in its order; then both draw the same order."""
    views = {p: _census(p, monkeypatch, []) for p in ("a", "b")}
    for c in views.values():
        asyncio.run(c.register(5))
    records = {p: {"epoch": 6, "commit": commitment(c.nonce(6))} for p, c in views.items()}
    leaders = {}
    for c in views.values():
        c.records = records
    for p, c in views.items():
        asyncio.run(c.register(6))
        asyncio.run(c.members(6))
        leaders[p] = Leaders("run", c)
    mates = ["a", "b"]
    leaders["a"].heard("b", {"epoch": 5})  # their words of the epoch before
    leaders["b"].heard("a", {"epoch": 5})
    assert leaders["a"].order(mates, set(mates), 6)[0] == "b" and leaders["b"].order(mates, set(mates), 6)[0] == "a"
    leaders["a"].heard("b", {"epoch": 6, **leaders["b"].reveal(6)})
    leaders["b"].heard("a", {"epoch": 6, **leaders["a"].reveal(6)})
    drawn = leaders["a"].order(mates, set(mates), 6)
    assert drawn == leaders["b"].order(mates, set(mates), 6) and set(drawn) == set(mates)

    # a ready word for the epoch without its nonce, or no word past the wait: not waited for
    me, other = leaders["a"], Leaders("run", views["a"])
    other.heard("b", {"epoch": 6})
    assert other.order(mates, set(mates), 6) == ["a", "b"]
    late = Leaders("run", views["a"])
    late.heard("b", {"epoch": 5})
    assert late.order(mates, set(mates), 6)[0] == "b"
    late._began = (6, time.monotonic() - REVEAL_WAIT_S)
    assert late.order(mates, set(mates), 6) == ["a", "b"]  # b reveals nothing: it leads last
    assert me.order(mates, {"b"}, 6) == ["b"]


def test_a_peer_resumed_from_its_identity_keeps_its_nonces_and_its_mates_draw_its_order(monkeypatch, tmp_path):
    """Mates count the first commitment they read for an id. A peer killed and resumed under its id that drew new
    nonces revealed one nobody could check, yet checked it itself: it ranked itself by a mix its mates did not
    draw, and led beside the leader they followed for a whole epoch (3-peer soaks, after a SIGKILL and restart).
    Its nonces' key now comes from its identity file, the same in every process resumed from it."""
    identity = tmp_path / "identity.key"
    identity.write_bytes(os.urandom(68))
    assert secret_of(identity) == secret_of(identity) and secret_of(tmp_path / "missing") is None

    def lives(secret_of_second):
        first = _census("r", monkeypatch, [])
        first._secret = secret_of(identity)
        mate = _census("m", monkeypatch, [])
        for c in (first, mate):
            asyncio.run(c.register(5))  # each commits to its nonce for epoch 6
        records = {"r": {"epoch": 6, "commit": commitment(first.nonce(6))},
                   "m": {"epoch": 6, "commit": commitment(mate.nonce(6))}}
        second = Census(None, "run", "r", secret=secret_of_second)  # the process resumed in epoch 5
        asyncio.run(second.register(5))
        for c in (mate, second):
            c.records = records  # the mate read the first process's commitment; the second stored its own later
            asyncio.run(c.register(6))
            asyncio.run(c.members(6))
        views = {"m": Leaders("run", mate), "r": Leaders("run", second)}
        views["m"].heard("r", {"epoch": 6, **views["r"].reveal(6)})
        views["r"].heard("m", {"epoch": 6, **views["m"].reveal(6)})
        return views

    kept = lives(secret_of(identity))
    assert kept["m"].nonce("r", 6) is not None  # its reveal matches the commitment its mate counts
    assert kept["m"].order(["m", "r"], {"m", "r"}, 6) == kept["r"].order(["m", "r"], {"m", "r"}, 6)
    drawn = lives(None)  # new nonces: the mate cannot check its reveal, while it counts its own as checked
    assert drawn["m"].nonce("r", 6) is None and drawn["r"].nonce("r", 6) is not None


def test_an_id_ground_to_rank_first_leads_only_its_share_of_epochs():
    peers = [f"honest{i}" for i in range(3)]
    ground = next(f"ground{k}" for k in range(100000)  # ranks first in all of epochs 0..5 under the public hash
                  if all(leader_rank("run", f"ground{k}", e) < min(leader_rank("run", p, e) for p in peers)
                         for e in range(6)))
    led = 0
    for e in range(400):
        mix = os.urandom(16)  # the XOR of the ready mates' nonces: unknown when the id was ground
        led += min([ground, *peers], key=lambda p: census_module.lead_rank("run", p, e, mix)) == ground
    assert 60 < led < 140, led  # about 1 in 4, like any mate


def test_a_silent_leader_is_passed_over_to_the_end_of_its_epoch_and_for_some_searches():
    leaders = Leaders("run", Census(None, "run", "me"))
    leaders.pass_over("x", 3)
    counted = leaders.new_search(3)
    assert leaders.passed_over("x", counted, 3)
    for _ in range(SILENT_ROUNDS - 1):
        counted = leaders.new_search(3)
    assert leaders.passed_over("x", leaders.new_search(3), 3)  # searches used up, same epoch: still passed over
    leaders.pass_over("y", 3)
    assert not leaders.passed_over("x", leaders.new_search(4), 4)  # a new epoch: followed again
    assert leaders.passed_over("y", leaders.new_search(4), 4)  # its count of searches still runs


def test_a_leader_that_ends_a_search_without_inviting_is_passed_over_when_it_stops_or_its_next_search_begins():
    from p2pdiloco.network.search import Search

    leaders = Leaders("run", Census(None, "run", "me"))

    def search(epoch: int) -> Search:  # this peer's word reached "x" long before x's deadline (100)
        return Search(contribution=_contribution(), deadline=100.0, epoch=epoch, acked={"x": 10.0})

    # x stopped looking: passed over for this search and the next SILENT_ROUNDS
    s, silent = search(3), set()
    leaders.new_search(3)
    assert leaders.follow(s, "", "x", {"x"}, {"x": 100.0}, silent) == "x"
    assert leaders.follow(s, "x", None, set(), {}, silent) == "" and silent == {"x"}
    counted = leaders.new_search(3)
    assert leaders.passed_over("x", counted, 3)
    for _ in range(SILENT_ROUNDS):
        counted = leaders.new_search(3)
    assert not leaders.passed_over("x", counted, 3)  # its searches used up: followed again this epoch
    # the second time in the epoch it is passed over to the epoch's end; here its next search's word came before its
    # stop (they travel apart): a mate that saw only that must pass it over as one that saw the stop does
    s, silent = search(3), set()
    leaders.follow(s, "", "x", {"x"}, {"x": 100.0}, silent)
    leaders.follow(s, "x", "x", {"x"}, {"x": 130.0}, silent)
    assert silent == {"x"}
    for _ in range(SILENT_ROUNDS + 2):
        counted = leaders.new_search(3)
    assert leaders.passed_over("x", counted, 3)
    assert not leaders.passed_over("x", leaders.new_search(4), 4)  # a new epoch: followed again
    # a leader whose group formed before this peer's word reached it is not at fault
    s, silent = search(4), set()
    s.acked["x"] = 99.9
    leaders.follow(s, "", "x", {"x"}, {"x": 100.0}, silent)
    leaders.follow(s, "x", "x", {"x"}, {"x": 130.0}, silent)
    assert silent == set() and not leaders.passed_over("x", leaders.new_search(4), 4)


def _grind(run_id: str, epochs: range, victims: int = 3, tries: int = 8000) -> tuple[list, PeerIdentity]:
    """Keys for `victims` victims, and an attacker's key whose id ranks before all of theirs in the public order of
    each of `epochs` (about 4^k keys for k epochs and 3 victims; a draw of victims whose ids rank so low that it
    takes over `tries` keys is drawn again)."""
    while True:
        keys = [PeerIdentity.generate() for _ in range(victims)]
        for _ in range(tries):
            ground = PeerIdentity.generate()
            if all(leader_rank(run_id, ground.peer_id, e) < min(leader_rank(run_id, k.peer_id, e) for k in keys)
                   for e in epochs):
                return keys, ground


def _contribution() -> Contribution:
    return Contribution(pseudo_grad=torch.ones(N), weight=1.0, global_params=torch.zeros(N), momentum=torch.zeros(N),
                        state_digest="same", state_weight=1.0, round_s=1.0)


def _joined_an_epoch_ago(net_loop, merger, epoch: int) -> None:
    """Make `merger`'s peer one that was in the swarm in the epoch before `epoch`: its census record commits to its
    nonce for `epoch` too (`prev`), and it reveals it."""
    census = merger.matchmaker.census
    census._ahead.add(epoch)
    census._registered.pop(epoch + 1, None)
    net_loop.run(census.register(epoch), 10)


def test_an_id_ground_to_lead_and_never_invite_costs_victims_at_most_a_merge_an_epoch(bootstrap_dht, net_loop):
    """The attack: 3 victims; the attacker grinds keys until one ranks first in the public order of every epoch the
    test may span, joins, and looks for a group all the time, revealing its nonce and announcing plausible
    deadlines like an honest peer, but never invites. Ranked first, it would lead every epoch and cost each victim
    about one merge in four (passed over for 3 searches, then followed again): 4 of 16. Drawn from the nonces, it
    leads about one epoch in four, and once silent it is passed over to the epoch's end: a victim merges alone at
    most once an epoch (the 16 rounds span one or two)."""
    run_id, rounds, round_s = "grind", 16, 0.25
    cfg = merge_config(run_id=run_id, merge_window_s=4, merge_timeout_s=4, codec="none", min_window_s=0.5,
                       window_fraction=0.1, epoch_s=8.0)
    e0 = epoch_of(get_dht_time(), cfg.merge.epoch_s)
    keys, ground = _grind(run_id, range(e0, e0 + 5))  # 40 s: a loaded machine's start and 16 rounds fit in it
    with running_mergers(bootstrap_dht, net_loop, 4, cfg, N, identities=[*keys, ground]) as mergers:
        *victims, attacker = mergers
        epoch = epoch_of(get_dht_time(), cfg.merge.epoch_s)
        for m in mergers:
            _joined_an_epoch_ago(net_loop, m, epoch)
        request, stop = attacker.matchmaker.rpc.request, threading.Event()
        silent_leader(attacker)
        attacker.matchmaker.rpc.request = request  # its deadlines as an honest peer's: it is believed

        def attack() -> None:
            while not stop.is_set():
                with contextlib.suppress(Exception):  # closed under it at the end
                    attacker.submit(_contribution()).result(timeout=30)

        thread = threading.Thread(target=attack, daemon=True)
        thread.start()
        try:
            assert attacker.peer_id == ground.peer_id
            alone = {v.peer_id: 0 for v in victims}
            for _ in range(rounds):
                start = time.monotonic()
                futures = [v.submit(_contribution()) for v in victims]
                for v, f in zip(victims, futures, strict=True):
                    alone[v.peer_id] += flat(f.result(timeout=30)).alone
                # rounds of 0.25 s at least, as a learner's: back-to-back merges of 4 peers exceed the per-sender
                # request rate (admission.py)
                time.sleep(max(0.0, start + round_s - time.monotonic()))
            last = epoch_of(get_dht_time(), cfg.merge.epoch_s)
        finally:
            stop.set()
            attacker.close()
            thread.join(timeout=10)
    assert last <= e0 + 4  # the id was ground for every epoch the rounds spanned
    assert all(n <= last - epoch + 1 for n in alone.values()), (alone, epoch, last)


def test_the_bench_grinder_writes_a_key_that_ranks_first_against_the_other_peers_of_its_run(tmp_path, monkeypatch):
    from p2pdiloco.testing import insiders

    monkeypatch.setattr(insiders, "GRIND_EPOCHS", 3)
    others = [PeerIdentity.generate() for _ in range(3)]
    for i, key in enumerate(others, start=1):
        (tmp_path / f"peer{i}").mkdir()
        (tmp_path / f"peer{i}" / "identity.key").write_bytes(key.to_protobuf())
    (tmp_path / "peer0").mkdir()
    cfg = merge_config(run_id="bench")
    insiders.ground_identity(cfg, tmp_path / "peer0" / "identity.key")
    ground = PeerIdentity.from_protobuf((tmp_path / "peer0" / "identity.key").read_bytes()).peer_id
    e0 = epoch_of(get_dht_time(), cfg.merge.epoch_s)
    assert all(leader_rank("bench", ground, e) < min(leader_rank("bench", k.peer_id, e) for k in others)
               for e in range(e0, e0 + 2))  # the epoch may have turned since it was ground, not two


def test_a_mate_refused_streams_persistently_is_left_out_of_groups_and_does_not_lead():
    """A pinner or flooder fills its per-sender budget at a victim; were it in the victim's group, its parts would be
    refused too and the merge would fail for every member (bench byzantine's pinner: 5 of 9 merges in groups). An
    honest mate refused once or twice (a fast round brushing the rate) stays in."""
    from p2pdiloco.network.admission import REFUSING_S, SHUN_REFUSALS, StreamGate

    now = [100.0]
    gate = StreamGate(max_per_sender=1, clock=lambda: now[0])
    assert gate.admit("pinner") and gate.admit("honest")
    for _ in range(SHUN_REFUSALS - 1):
        assert not gate.admit("pinner") and not gate.admit("honest")  # both past their bound
        now[0] += 0.1
    assert not gate.refusing("pinner") and not gate.refusing("honest")  # refused a few times: not left out yet
    assert not gate.admit("pinner")  # asks again and again
    assert gate.refusing("pinner") and not gate.refusing("honest")
    leaders = Leaders("run", Census(None, "run", "me"), gate.refusing)
    assert leaders.order(["pinner", "me", "honest"], {"pinner", "me", "honest"}, 5) == ["me", "honest"]
    now[0] += REFUSING_S
    assert not gate.refusing("pinner")  # forgiven once it stays within its budget
    slow = StreamGate(max_per_sender=1, clock=lambda: now[0])
    assert slow.admit("mate")
    for _ in range(SHUN_REFUSALS):  # refusals further apart than REFUSING_S together: never left out
        assert not slow.admit("mate") and not slow.refusing("mate")
        now[0] += REFUSING_S / (SHUN_REFUSALS - 1) + 0.1
