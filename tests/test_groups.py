"""Bounded merge groups: ready peers split into groups of at most `merge.group_size`, redrawn every
epoch, and every peer computes the same split from the same ready records."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch

from p2pdiloco.config import GuardConfig
from p2pdiloco.network.census import my_group, registered_now
from p2pdiloco.network.merger import Contribution
from tests.conftest import flat, force_leader_order, merge_config, running_mergers, wait_for


def _split(ready, epoch, size):
    return {p: tuple(my_group("run", p, ready, epoch, size)) for p in ready}


@pytest.mark.parametrize(("n", "size"), [(1, 8), (4, 8), (8, 8), (9, 8), (12, 4), (13, 4), (32, 8), (33, 8)])
def test_every_peer_computes_the_same_groups_of_at_most_group_size(n, size):
    ready = [f"peer{i:02d}" for i in range(n)]
    split = _split(ready, 5, size)
    groups = set(split.values())
    assert all(p in split[p] for p in ready)  # each peer is in the group it computed
    assert sorted(p for g in groups for p in g) == sorted(ready)  # the groups partition the ready peers
    for g in groups:
        assert all(split[p] == g for p in g)  # and every member computed the same group, the same leader first
    sizes = [len(g) for g in groups]
    assert max(sizes) <= size and max(sizes) - min(sizes) <= 1
    assert len(groups) == -(-n // size)  # the fewest groups that fit


def test_groups_change_every_epoch_and_no_peer_leads_every_one():
    ready = [f"peer{i:02d}" for i in range(32)]
    together, leads = Counter(), Counter()
    for epoch in range(200):
        for g in set(_split(ready, epoch, 8).values()):
            leads[g[0]] += 1
            together.update((a, b) for a in g for b in g if a < b)
    # in 200 epochs of 4 random groups of 8, every pair of peers met (each epoch: P = 7/31)
    assert len(together) == 32 * 31 // 2
    assert max(leads.values()) < 200 * 4 / 32 * 2.5  # about 25 leads each; no id leads every group


@pytest.mark.parametrize("n", [4, 12])
def test_real_peers_merge_in_groups_of_at_most_four_with_dht_work_that_does_not_grow(bootstrap_dht, net_loop, n):
    cfg = merge_config(run_id=f"groups{n}", merge_window_s=15, merge_timeout_s=10, codec="none", group_size=4, sync=True)
    with running_mergers(bootstrap_dht, net_loop, n, cfg, 64, guard=GuardConfig(aggregate="mean")) as mergers:
        # every census record stored (read through the bootstrap node: the mergers' own reads are counted)
        wait_for(lambda: len(net_loop.run(registered_now(bootstrap_dht, cfg.swarm.run_id, 5, cfg.merge.epoch_s), 10)) >= n, 30,
                 what="every peer in the census")
        # parts 10..21: no group's largest is over 4x its median norm (with 0..11, a group such as 0, 1, 3, 9 had
        # its largest part left out by the norm guard, and this test failed about one run in 15)
        futures = [m.submit(Contribution(pseudo_grad=torch.full((64,), 10.0 + i), weight=1.0,
                                         global_params=torch.zeros(64), momentum=torch.zeros(64), state_digest="same",
                                         state_weight=1.0)) for i, m in enumerate(mergers)]
        results = [flat(f.result(timeout=90)) for f in futures]
        # the DHT requests of matchmaking, whatever n: census stores for this epoch and the next (one more if an
        # epoch ends during the test, and a store that timed out on a loaded machine is tried again), a read or two
        work = [(m.matchmaker.census.writes, m.matchmaker.census.reads) for m in mergers]
        assert all(w <= 5 and r <= 3 for w, r in work), work
    groups = {tuple(r.group) for r in results}
    assert all(2 <= len(r.group) <= 4 and r.failure == "" for r in results)  # everyone merged, none alone
    assert sorted(p for g in groups for p in g) == sorted(m.peer_id for m in mergers)  # each in exactly one group
    for r in results:  # and each group's members hold the mean of that group's parts, not the swarm's
        values = [10.0 + i for i, m in enumerate(mergers) if m.peer_id in r.group]
        assert torch.allclose(r.pseudo_grad, torch.full((64,), sum(values) / len(values)))


def test_the_last_merge_of_peers_finishing_together_takes_them_all_and_ends_with_one_global_model(
        bootstrap_dht, net_loop):
    """Groups of 2 among 6 peers: their global models differ (digests), and the run's last merge brings all six
    to one (θg, momentum), bit for bit."""
    cfg = merge_config(run_id="last", merge_window_s=15, merge_timeout_s=10, codec="none", group_size=2, sync=True)
    gen = torch.Generator().manual_seed(3)
    with running_mergers(bootstrap_dht, net_loop, 6, cfg, 64, guard=GuardConfig(aggregate="mean")) as mergers:
        futures = []
        for i, m in enumerate(mergers):
            c = Contribution(pseudo_grad=torch.randn(64, generator=gen), weight=1.0,
                             global_params=1.0 + 0.01 * torch.randn(64, generator=gen), momentum=torch.zeros(64),
                             state_digest=f"group-history-{i}", state_weight=100.0)
            c.final = True
            futures.append(m.submit(c))
        results = [flat(f.result(timeout=90)) for f in futures]
    assert all(len(r.group) == 6 and r.failure == "" and r.final for r in results), [r.group for r in results]
    states = [r.global_state for r in results]
    assert all(s is not None for s in states)
    assert all(torch.equal(s, states[0]) for s in states)  # one (θg, momentum) on every peer, bit for bit


def test_groups_a_little_out_of_phase_at_the_end_of_a_run_still_end_in_one_last_merge(
        bootstrap_dht, net_loop, monkeypatch):
    """Decoupled, groups of 2 among 4 peers, dealt {a1, a2} and {b1, b2}: the a's are a round ahead. a1 submits
    its last contribution and a2 one near its end, while the b's still merge as a pair; then the b's submit theirs
    near their end. All four meet in one last merge. Before a search near a peer's end was dealt like a final one,
    the b's merged as a pair again, the a's after their window as another, and the a's ended apart from the b's
    (16 peers in `bench scale`: two groups of 8)."""
    cfg = merge_config(run_id="phase", merge_window_s=10, merge_timeout_s=5, codec="none", group_size=2,
                      min_window_s=0.5, window_fraction=0.1)
    with running_mergers(bootstrap_dht, net_loop, 4, cfg, 64, guard=GuardConfig(aggregate="mean")) as mergers:
        a1, b1, a2, b2 = mergers  # the leader order of every epoch: dealt round-robin into {a1, a2}, {b1, b2}
        order = [m.matchmaker.peer_id for m in mergers]
        force_leader_order(monkeypatch, lambda peer, epoch: bytes([order.index(peer)]))

        def submit(m, value, final=False, closing=False):
            c = Contribution(pseudo_grad=torch.full((64,), value), weight=1.0, global_params=torch.zeros(64),
                             momentum=torch.zeros(64), state_digest="same", state_weight=1.0, round_s=1.0)
            c.final, c.closing = final, closing
            return m.submit(c)

        ahead = [submit(a1, 1.0, final=True), submit(a2, 2.0, closing=True)]
        pair = [submit(b1, 3.0), submit(b2, 4.0)]
        assert all(sorted(r.group) == sorted(order[1::2]) for r in (flat(f.result(timeout=30)) for f in pair))
        last = [submit(b1, 5.0, closing=True), submit(b2, 6.0, closing=True)]
        results = [flat(f.result(timeout=30)) for f in ahead + last]
    assert all(len(r.group) == 4 and r.failure == "" and r.final for r in results), [r.group for r in results]
    assert all(torch.equal(r.pseudo_grad, torch.full((64,), 3.5)) for r in results)  # (1 + 2 + 5 + 6) / 4


def test_a_finishing_peer_does_not_end_in_the_group_of_a_leader_that_is_not_near_its_end(
        bootstrap_dht, net_loop, monkeypatch):
    """Groups of 2 among 4 peers, dealt {lead, last} and {c1, c2} in the order lead, c1, last, c2: `last`
    submits its last contribution while `lead`, first in the order and not near its end, looks for its pair, and
    c1 and c2 submit theirs near their end. Before, `last` followed `lead` (the first ready peer in its order)
    and ended in a pair with it while c1 and c2 ended as another pair: two models at the end (32 peers in
    `bench scale`). Now a search near its end follows and accepts only a leader whose search is too, where
    groups do not span the census: the three finishing peers end in one merge; `lead` merges alone and goes on."""
    cfg = merge_config(run_id="apart", merge_window_s=4, merge_timeout_s=5, codec="none", group_size=2,
                      min_window_s=0.5, window_fraction=0.1)
    with running_mergers(bootstrap_dht, net_loop, 4, cfg, 64, guard=GuardConfig(aggregate="mean")) as mergers:
        lead, c1, last, c2 = mergers
        order = [m.matchmaker.peer_id for m in mergers]
        force_leader_order(monkeypatch, lambda peer, epoch: bytes([order.index(peer)]))

        def submit(m, value, final=False, closing=False, round_s=1.0):
            c = Contribution(pseudo_grad=torch.full((64,), value), weight=1.0, global_params=torch.zeros(64),
                             momentum=torch.zeros(64), state_digest="same", state_weight=1.0, round_s=round_s)
            c.final, c.closing = final, closing
            return m.submit(c)

        leading = submit(lead, 1.0, round_s=40.0)  # a window of 4 s: still looking when the others come
        ending = [submit(last, 2.0, final=True), submit(c1, 3.0, closing=True), submit(c2, 4.0, closing=True)]
        results = [flat(f.result(timeout=30)) for f in ending]
        lead_result = flat(leading.result(timeout=30))
    finishers = {order[1], order[2], order[3]}
    assert all(set(r.group) == finishers and r.failure == "" and r.final for r in results), [r.group for r in results]
    # (2 + 3 + 4) / 3, to fp32 rounding (summed in member order), the same bits on every member
    assert all(torch.equal(r.pseudo_grad, results[0].pseudo_grad) for r in results)
    torch.testing.assert_close(results[0].pseudo_grad, torch.full((64,), 3.0))
    assert order[2] not in lead_result.group


def test_an_epochs_first_census_read_takes_one_nodes_copy_only_when_it_looks_whole(monkeypatch):
    """`Census.members`: an epoch's first read asks the census key's nearest node (a third of a walk's bytes), and
    walks instead when that copy lacks this peer or holds fewer peers than the last view; the first read of all and
    every re-read walk (a copy from one node once hid the others for 22 s: docs/experiments.md, "The census read
    from one node")."""
    from p2pdiloco.network import census as census_module

    calls, copies, reading = [], {}, {}

    def reader(kind):
        async def read(dht, key, timeout=5.0):
            calls.append(kind)
            return {p: {"t": 0.0, "epoch": reading["epoch"]} for p in copies[kind]}
        return read

    monkeypatch.setattr(census_module, "read_near_subkeys", reader("near"))
    monkeypatch.setattr(census_module, "read_subkeys", reader("walk"))
    census = census_module.Census(None, "run", "me")
    census._registered = {e: 0.0 for e in range(1, 6)}  # registered for these epochs

    def members(epoch: int) -> set[str]:
        reading["epoch"] = epoch
        return set(asyncio.run(census.members(epoch)))

    copies["walk"] = {"me", "a", "b"}
    assert members(1) == {"me", "a", "b"} and calls == ["walk"]  # the first read of all walks
    copies["near"] = {"me", "a", "b", "c"}
    assert members(2) == {"me", "a", "b", "c"} and calls[-1] == "near"  # whole: taken, no walk
    copies["near"], copies["walk"] = {"me", "a"}, {"me", "a", "b", "c"}
    assert members(3) == {"me", "a", "b", "c"} and calls[-2:] == ["near", "walk"]  # fewer than the last view
    copies["near"] = {"a", "b", "c", "d"}  # this peer's own registration missing: a copy not to be trusted
    copies["walk"] = {"me", "a", "b", "c", "d"}
    assert members(4) == {"me", "a", "b", "c", "d"} and calls[-2:] == ["near", "walk"]
    census.saw("e", 4)  # an unknown peer announced itself: read again (once REREAD_S has passed), by a walk
    census._views[4] = (census._views[4][0] - census_module.REREAD_S, census._views[4][1])
    copies["walk"] = {"me", "a", "b", "c", "d", "e"}
    assert members(4) == copies["walk"] and calls[-1] == "walk"
    assert (census.reads, census.walks) == (5, 4)


def test_a_census_forgets_the_epochs_it_no_longer_holds_a_view_of(monkeypatch):
    """A peer runs for days, an epoch a minute: what the census keeps by epoch stays that of the last two."""
    from p2pdiloco.network import census as census_module

    async def read(dht, key, timeout=5.0):
        return {"a": {"t": 0.0, "epoch": 0}}

    monkeypatch.setattr(census_module, "read_near_subkeys", read)
    monkeypatch.setattr(census_module, "read_subkeys", read)
    census = census_module.Census(None, "run", "me")
    for epoch in range(1_000):
        asyncio.run(census.members(epoch))
        assert not census.settled(epoch)  # a search that ended before its epoch's view was read again
    assert len(census._stale) <= 2 and len(census._views) <= 2


def test_a_census_record_counts_for_the_epoch_it_was_written_for_and_the_one_before():
    """One census key for every epoch: a peer's record names the epoch it registered for (the next one, written in
    the current one), and a reader of an epoch counts the records for it and the two after it (a clock a little
    ahead), not a record for an earlier epoch (a peer that stopped registering) nor one without a number."""
    from p2pdiloco.network.census import census_key, census_of, in_epoch

    records = {"now": {"epoch": 7}, "next": {"epoch": 8}, "ahead": {"epoch": 9}, "far": {"epoch": 10},
               "gone": {"epoch": 6}, "text": {"epoch": "7"}, "bare": {"t": 1.0}, "list": [7]}
    assert census_of(records, 7) == {"now", "next", "ahead"}
    assert census_of(records, 8) == {"next", "ahead", "far"}
    assert not in_epoch(None, 7) and in_epoch({"epoch": 7}, 7)
    assert census_key("run") == "run_census"  # the same key every epoch: its nearest nodes are looked up once a minute


def test_a_peer_registers_with_one_store_an_epoch(monkeypatch):
    from p2pdiloco.network import census as census_module

    stored = []

    async def write(dht, key, subkey, value, expiration, timeout=5.0):
        stored.append((key, subkey, value["epoch"], expiration))
        return True

    monkeypatch.setattr(census_module, "write_subkey", write)
    census = census_module.Census(None, "run", "me")
    for epoch in (10, 10, 11, 12):
        asyncio.run(census.register(epoch))
    assert [(k, e) for k, _, e, _ in stored] == [("run_census", 11), ("run_census", 12), ("run_census", 13)]
    assert all(a[3] < b[3] for a, b in zip(stored, stored[1:], strict=False))  # each expires later: replaces the last
    assert set(census._registered) == {12, 13}
