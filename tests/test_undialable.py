"""Peers that others cannot dial (behind NAT): they never lead, own no slice, and fetch an agreed model only from a
holder others can dial; every stream of theirs is one they open. Rules as pure functions, then real mergers on
loopback (where everyone can dial everyone: what is tested is that the rules hold and the average stays exact; the
NAT itself is tested in network namespaces, tests/test_wanlab.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from p2pdiloco.algorithm.outer import weighted_average
from p2pdiloco.config import GuardConfig
from p2pdiloco.network.allreduce import group_slice, owned_slice, slice_bounds, slices_owned
from p2pdiloco.network.catch_up import dealt_holder
from p2pdiloco.network.group import Group, own_claims_kept, valid_notice
from p2pdiloco.network.merger import Contribution
from p2pdiloco.network.rpc import MergeFailed
from tests.conftest import flat, merge_config, running_mergers


def _group(n: int, owners: list[int] | None, digests: list[str] | None = None, gid: str = "g1") -> Group:
    digests = digests or ["d"] * n
    return Group(gid, [f"peer{i}" for i in range(n)], [1.0] * n, [1.0] * n, len(set(digests)) > 1,
                 {"d": 1000, "s": 2000, "a": 2000}, digests=digests, owners=owners)


@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize("gid", ["a", "0f3c", "group-77"])
def test_where_every_member_can_be_dialed_slices_are_owned_as_before(n, gid):
    assert slices_owned(_group(n, None, gid=gid)) == {j: owned_slice(gid, j, n) for j in range(n)}


def test_only_members_others_can_dial_own_slices_and_their_slices_cover_the_vector():
    g = _group(5, [0, 2, 3])
    owned = slices_owned(g)
    assert sorted(owned) == [0, 2, 3] and sorted(owned.values()) == [0, 1, 2]
    bounds = sorted(group_slice(g, "d", j) for j in owned)
    assert bounds == slice_bounds(1000, 3) and bounds[0][0] == 0 and bounds[-1][1] == 1000
    for member in (1, 4):
        with pytest.raises(MergeFailed, match=f"member {member} owns no slice"):
            group_slice(g, "d", member)
    assert g.terms != _group(5, None).terms  # a member told other owners acts on other terms: its parts are refused


def _notice(**overrides) -> dict:
    h = {"group_id": "g", "members": ["a", "b", "c"], "weights": [1, 1, 1], "state_weights": [1, 1, 1],
         "digests": ["x", "x", "x"], "need_state": False}
    return {**h, **overrides}


@pytest.mark.parametrize("owners, ok", [
    (None, True), ([0], True), ([0, 2], True), ([0, 1, 2], True),
    ([], False), ([1, 2], False), ([0, 3], False), ([2, 0], False), ([0, 0, 1], False), ([0, True], False),
    ("0,1", False), ([0, 1.0], False),
])
def test_a_notice_names_owners_that_include_its_leader_in_group_order(owners, ok):
    h = _notice() if owners is None else _notice(owners=owners)
    assert valid_notice(h, "b", 8) is ok


def test_a_member_others_cannot_dial_refuses_a_notice_that_makes_it_own_a_slice():
    c = Contribution(pseudo_grad=torch.zeros(3), weight=1.0, global_params=torch.zeros(3), momentum=torch.zeros(3),
                     state_digest="x", state_weight=1.0)
    assert not own_claims_kept(_notice(), "b", c, dialable=False)  # no owners named: every member owns one
    assert not own_claims_kept(_notice(owners=[0, 1]), "b", c, dialable=False)
    assert own_claims_kept(_notice(owners=[0, 2]), "b", c, dialable=False)
    assert own_claims_kept(_notice(owners=[0, 2]), "b", c, dialable=True)  # left out of owners: harmless


def test_a_notice_lists_one_part_digest_per_member_and_a_member_refuses_one_that_changed_its_own():
    c = Contribution(pseudo_grad=torch.zeros(3), weight=1.0, global_params=torch.zeros(3), momentum=torch.zeros(3),
                     state_digest="x", state_weight=1.0)
    assert valid_notice(_notice(parts=["p", "q", "r"]), "b", 8)
    assert not valid_notice(_notice(parts=["p", "q"]), "b", 8) and not valid_notice(_notice(parts=["p", 1, "r"]), "b", 8)
    assert own_claims_kept(_notice(parts=["p", "q", "r"]), "b", c, part="q")
    assert not own_claims_kept(_notice(parts=["p", "z", "r"]), "b", c, part="q")  # a relayer could serve "z" for it
    assert own_claims_kept(_notice(), "b", c, part="q")  # none listed: its part is never relayed unchecked (refused)


def test_an_agreed_model_is_fetched_from_a_holder_others_can_dial():
    # members 0 and 1 hold the majority's model (3 of 4 with member 3), member 2 fetches it
    g = _group(4, [0, 3], digests=["m", "m", "other", "m"])
    assert dealt_holder(g, 2) in (0, 3)
    g_all = _group(4, None, digests=["m", "m", "other", "m"])
    assert dealt_holder(g_all, 2) == 0  # as before: round-robin over every holder


def _contribution(vec: torch.Tensor, weight: float) -> Contribution:
    return Contribution(pseudo_grad=vec, weight=weight, global_params=vec * 10, momentum=vec * 100,
                        state_digest="same", state_weight=1.0)


@pytest.mark.integration
def test_a_member_others_cannot_dial_never_leads_and_the_average_stays_exact(bootstrap_dht, net_loop):
    cfg = merge_config(run_id="nat", merge_window_s=8, merge_timeout_s=4, codec="none")
    guard = GuardConfig(aggregate="mean", min_cosine=-1, trust_decay=-1)
    with running_mergers(bootstrap_dht, net_loop, 3, cfg, 1001, guard=guard) as mergers:
        mergers[0].set_dialable(False)
        for rnd in range(3):
            torch.manual_seed(rnd)
            vecs = [torch.randn(1001) for _ in mergers]
            weights = [100.0, 200.0, 300.0]
            futures = []
            for m, v, w in zip(mergers, vecs, weights, strict=True):
                c = _contribution(v, w)
                c.round = rnd
                futures.append(m.submit(c))
            results = [flat(f.result(timeout=60)) for f in futures]
            by_id = {m.peer_id: (v, w) for m, v, w in zip(mergers, vecs, weights, strict=True)}
            order = results[0].group
            assert len(order) == 3 and order[0] != mergers[0].peer_id  # the leader is listed first
            expected = weighted_average([by_id[p][0] for p in order], [by_id[p][1] for p in order])
            for r in results:
                assert r.failure == "" and r.group == order and torch.equal(r.pseudo_grad, expected)


@pytest.mark.integration
def test_where_nobody_can_be_dialed_nobody_leads_and_each_merges_alone_saying_why(bootstrap_dht, net_loop, caplog):
    cfg = merge_config(run_id="nat2", merge_window_s=2, merge_timeout_s=4, codec="none", min_window_s=1.0)
    with (running_mergers(bootstrap_dht, net_loop, 2, cfg, 1001) as mergers,
          caplog.at_level(logging.WARNING, logger="p2pdiloco.network.matchmaking")):
        for m in mergers:
            m.set_dialable(False)
        said = [f"[{m.peer_id[-6:]}] merging alone: nobody can dial this peer nor any of its" for m in mergers]
        for _ in range(3):  # a search that ended before its mate's word came says nothing (its mate was not ready):
            futures = [m.submit(_contribution(torch.full((1001,), float(i)), 1.0)) for i, m in enumerate(mergers)]
            for f in futures:  # on a loaded machine that can happen in a round, so each gets up to 3 rounds
                r = flat(f.result(timeout=30))
                assert r.alone and r.pseudo_grad is None  # the learner steps on its own Δ
            if all(s in caplog.text for s in said):
                break
    for s in said:
        assert s in caplog.text


def test_until_its_verdict_comes_a_peer_takes_part_as_one_nobody_can_dial_and_does_not_wait(caplog):
    import asyncio

    from p2pdiloco.network.dialable import Dialability

    async def main() -> None:
        d = Dialability("me")
        assert d.can_lead("me") and d.says({"looking": True}) == {"looking": True}  # no check expected
        d.expect_verdict()
        assert not d.can_lead("me") and d.says({})["dialable"] is False  # never leads, owns no slice
        with caplog.at_level(logging.WARNING):
            d.nobody_leads(2, 0)
        assert "nobody can dial this peer" not in caplog.text  # it does not know that yet
        d.set(True)
        assert d.can_lead("me") and "dialable" not in d.says({})
        d.set(False)
        assert not d.can_lead("me")

    asyncio.run(main())


def test_a_peer_nobody_can_dial_whose_mates_were_simply_not_ready_does_not_blame_reachability(caplog):
    import asyncio

    from p2pdiloco.network.dialable import Dialability

    async def main() -> None:
        d = Dialability("me")
        d.set(False)
        with caplog.at_level(logging.WARNING):
            d.nobody_leads(0, 0)  # no mate ready in its window, none out of reach: an ordinary merge alone
            assert "nobody can dial" not in caplog.text
            d.nobody_leads(0, 3)  # its mates could not be told: they are as unreachable as it is
            assert "nobody can dial this peer nor any of its 0 ready mates (3 more mates out of its reach)" in caplog.text

    asyncio.run(main())
