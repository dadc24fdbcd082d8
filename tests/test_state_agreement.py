"""Members whose global models differ agree on one: through the real merger (hivemind DHTs,
p2p daemons, loopback), as int8 differences from a state all members hold (an anchor) when there is one, else
from the int8 average of their models; members end bit-identical either way, and either costs a fraction of an
fp32 exchange's bytes."""

from __future__ import annotations

import pytest
import torch

from p2pdiloco.algorithm.guards import FORGED
from p2pdiloco.algorithm.outer import state_digest, weighted_average
from p2pdiloco.config import GuardConfig, OuterOptConfig
from p2pdiloco.network.group import Group, own_claims_kept
from p2pdiloco.network.merger import Contribution, Merged
from p2pdiloco.network.state_sync import GlobalState
from p2pdiloco.training.global_model import GlobalModel, HeldStates
from tests.conftest import flat, merge_config, running_mergers

N = 40_001


def test_a_global_model_keeps_its_recent_states_by_digest_newest_first():
    g = GlobalModel(torch.zeros(N), OuterOptConfig(), anchors=2)
    first = g.digest()
    assert list(g.anchors()) == [first]
    delta = torch.full((N,), 1e-3)
    g.merge(Merged(delta, 1.0), alone=True)
    second = g.digest()
    g.merge(Merged(delta, 1.0), alone=True)
    assert list(g.anchors()) == [g.digest(), second]  # at most 2: the first fell out
    assert torch.equal(g.anchors()[g.digest()], torch.cat([g.params, g.momentum]))
    g.adopt(torch.ones(N), torch.zeros(N))  # a donor's state is an anchor too
    assert list(g.anchors())[0] == g.digest() and len(g.anchors()) == 2
    assert GlobalModel(torch.zeros(N), OuterOptConfig(), anchors=0).anchors() == {}


def test_a_peer_serves_its_recent_states_by_digest_with_the_counters_it_had_then():
    g = GlobalModel(torch.zeros(N), OuterOptConfig(), anchors=2)
    held = HeldStates(g)
    held.note(GlobalState(g.params, g.momentum, 0, 0, 0.0))
    first = g.digest()
    for r in (1, 2):
        g.merge(Merged(torch.full((N,), 1e-3), 1.0), alone=True)
        held.note(GlobalState(g.params, g.momentum, r, 10 * r, 100.0 * r))
    now, before = held.get(g.digest()), held.get(list(g.anchors())[1])
    assert (now.round, now.step, now.global_tokens) == (2, 20, 200.0) and now.global_params is g.params
    assert (before.round, before.step, before.global_tokens) == (1, 10, 100.0)
    assert state_digest(before.global_params, before.momentum) == list(g.anchors())[1]
    assert held.get(first) is None and held.get("unknown") is None  # fell out of the 2 anchors; never held


def test_a_global_models_digest_is_hashed_once_a_state_and_follows_every_change(monkeypatch):
    import p2pdiloco.training.global_model as gm

    hashed = []
    monkeypatch.setattr(gm, "state_digest", lambda *t: hashed.append(1) or state_digest(*t))
    g = GlobalModel(torch.zeros(N), OuterOptConfig())
    assert [g.digest() for _ in range(3)] == [state_digest(g.params, g.momentum)] * 3 and len(hashed) == 1
    g.merge(Merged(torch.full((N,), 1e-3), 1.0), alone=True)  # new tensors
    assert g.digest() == state_digest(g.params, g.momentum) and len(hashed) == 2
    before = g.digest()
    g.momentum[7] += 1.0  # changed in place, as no caller should, is still seen (the tensor's version)
    assert g.digest() != before and g.digest() == state_digest(g.params, g.momentum)
    g.params = g.params.clone()  # replaced by equal values: hashed again, same digest
    assert g.digest() == state_digest(g.params, g.momentum) and len(hashed) == 4


def _states(n_members: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A common anchor and each member's (θg, momentum) a few outer steps away from it (one member still on it)."""
    gen = torch.Generator().manual_seed(3)
    anchor = torch.cat([torch.randn(N, generator=gen), 1e-2 * torch.randn(N, generator=gen)])
    states = [anchor.clone()] + [anchor + 1e-2 * torch.randn(2 * N, generator=gen) for _ in range(n_members - 1)]
    return anchor, states


@pytest.mark.integration
@pytest.mark.parametrize("common_anchor", [True, False])
def test_differing_members_agree_bit_identically_and_an_anchor_cuts_the_bytes(bootstrap_dht, net_loop, common_anchor):
    cfg = merge_config(run_id=f"agree{int(common_anchor)}", merge_window_s=8, merge_timeout_s=10, codec="none",
                      sync=True)
    anchor, states = _states(3)
    weights = [100.0, 200.0, 300.0]
    with running_mergers(bootstrap_dht, net_loop, 3, cfg, N, guard=GuardConfig(enabled=False)) as mergers:
        futures = []
        for i, (m, s, w) in enumerate(zip(mergers, states, weights, strict=True)):
            held = {"common": anchor} if common_anchor else {f"only-{i}": anchor}
            c = Contribution(pseudo_grad=torch.zeros(N), weight=1.0, global_params=s[:N], momentum=s[N:],
                             state_digest=f"member-{i}", state_weight=w, anchors={f"own-{i}": s, **held})
            futures.append((m.peer_id, m.submit(c)))
        results = {pid: flat(f.result(timeout=60)) for pid, f in futures}
    by_id = {pid: (s, w) for (pid, _), s, w in zip(futures, states, weights, strict=True)}
    first = next(iter(results.values()))
    exact = weighted_average([by_id[p][0] for p in first.group], [by_id[p][1] for p in first.group])
    for r in results.values():
        assert r.failure == "" and len(r.group) == 3 and r.global_state is not None, r.failure
        assert torch.equal(r.global_state, first.global_state)  # every member holds the same bits
    spread = float((torch.stack(states) - anchor).abs().max())
    err = float((first.global_state - exact).abs().max())
    if common_anchor:
        # int8 differences from the anchor: off the fp32 average by at most ~1/127 of the largest difference
        # in a block, far below the differences themselves
        assert 0 < err <= spread / 100, (err, spread)
    else:
        # no anchor: the int8 average of the states is made one, then the models' differences from it travel. int8
        # on the model itself is off by up to 1/254 of a block's largest value; the second exchange takes that back
        model_err = float((first.global_state[:N] - exact[:N]).abs().max())
        model_int8_err = float(torch.stack(states)[:, :N].abs().max()) / 254
        assert 0 < model_err <= model_int8_err / 10 and model_err <= spread / 20, (model_err, model_int8_err, spread)
        # the momentum is the first exchange's int8 average: each part and then the average rounded once, each off
        # by at most 1/254 of the momenta's largest value (none of the model's scale: see P2PMerger._agree)
        momentum_err = float((first.global_state[N:] - exact[N:]).abs().max())
        assert 0 < momentum_err <= 2 * float(torch.stack(states)[:, N:].abs().max()) / 254 * 1.001, momentum_err
    fp32_state = 2 * (3 - 1) / 3 * 8 * N  # what one member sends of a sliced fp32 (θg, momentum) exchange
    for r in results.values():
        state_bytes = r.state_bytes_sent
        assert r.state_anchored is common_anchor
        assert state_bytes <= r.bytes_sent - r.pseudo_grad_bytes_sent  # the rest is matchmaking
        if common_anchor:
            assert state_bytes < 0.3 * fp32_state, (state_bytes, fp32_state)  # 1 byte a value, not 4
        else:
            # an int8 exchange of (θg, momentum), then one of θg's differences (the momentum's half zeros, deflated)
            assert 0.3 * fp32_state < state_bytes < 0.42 * fp32_state, (state_bytes, fp32_state)


def test_a_member_refuses_a_notice_naming_an_anchor_it_does_not_hold_or_another_digest():
    """A leader cannot make a member add its differences to a state it does not hold (its model would be lost), nor
    write down another model for it (to make the group skip or force an agreement)."""
    held = torch.zeros(4)
    c = Contribution(pseudo_grad=held, weight=10.0, global_params=held, momentum=held, state_digest="mine",
                     state_weight=5.0, anchors={"mine": held, "older": held})
    notice = {"members": ["you", "me"], "weights": [10.0, 10.0], "state_weights": [5.0, 5.0], "need_state": True,
              "digests": ["yours", "mine"]}
    assert own_claims_kept({**notice, "anchor": "older"}, "me", c)
    assert own_claims_kept({**notice, "anchor": ""}, "me", c) and own_claims_kept(notice, "me", c)  # no anchor
    assert not own_claims_kept({**notice, "anchor": "not-held"}, "me", c)
    assert not own_claims_kept({**notice, "anchor": ["older"]}, "me", c)  # not even a digest
    assert not own_claims_kept({**notice, "digests": ["yours", "yours"]}, "me", c)  # not the model it holds


def test_a_merge_alone_steps_with_the_alone_lr_and_a_group_merge_with_the_outer_lr():
    """outer.alone_lr: sparseloco's outer lr 3 makes up for averaging sparse parts that rarely overlap; applied to a
    peer's own dense Δ alone it overshoots (measured: two merges alone took a final model from 1.6053 to 1.7708)."""
    from p2pdiloco.algorithm.outer import outer_step

    outer = OuterOptConfig(lr=3.0, momentum=0.0, alone_lr=1.0)
    theta, delta = torch.randn(N, generator=torch.Generator().manual_seed(4)), torch.full((N,), 1e-3)
    g = GlobalModel(theta.clone(), outer)
    g.merge(Merged(delta, 1.0), alone=True)
    assert torch.equal(g.params, outer_step(theta, torch.zeros(N), delta, 1.0, 0.0)[0])  # θg − Δ: the local model
    before, momentum = g.params, g.momentum
    g.merge(Merged(delta, 2.0))
    assert torch.equal(g.params, outer_step(before, momentum, delta, 3.0, 0.0)[0])  # a group's Δ̄: lr 3
    unset = GlobalModel(theta.clone(), OuterOptConfig(lr=3.0, momentum=0.0))  # 0: the outer lr, as before
    unset.merge(Merged(delta, 1.0), alone=True)
    assert torch.equal(unset.params, outer_step(theta, torch.zeros(N), delta, 3.0, 0.0)[0])


def test_a_merges_phases_run_at_once_a_failed_exchange_cancels_the_agreement_and_a_failed_agreement_does_not():
    """The Δ exchange and the agreement run together (p2p_merger._together). A failed exchange cancels the
    agreement before the failure is raised, so nothing goes on sending for a merge given up; a failed agreement
    (this member refused a holder's state) lets the exchange finish first, since the others' merge needs this
    member's slice, and then raises."""
    import asyncio

    from p2pdiloco.network.p2p_merger import _together
    from p2pdiloco.network.rpc import MergeFailed

    async def main() -> tuple[list, bool, list[str]]:
        started = asyncio.Event()

        async def first() -> str:  # finishes only once the second has started: run one after the other, it never would
            await asyncio.wait_for(started.wait(), 10)
            return "d"

        async def second() -> str:
            started.set()
            return "s"

        both = await _together(first(), second())

        async def fail() -> None:
            raise MergeFailed("a member left")

        other = asyncio.ensure_future(asyncio.sleep(30))
        with pytest.raises(MergeFailed):
            await asyncio.wait_for(_together(fail(), other), 10)

        served = []

        async def slice_owed() -> str:
            await asyncio.sleep(0.2)  # still reducing the others' slice when the agreement fails
            served.append("slice")
            return "d"

        with pytest.raises(MergeFailed, match="refused"):
            await asyncio.wait_for(_together(slice_owed(), _refuse()), 10)
        return both, other.cancelled(), served

    async def _refuse() -> None:
        raise MergeFailed("refused the holder's model")

    both, cancelled, served = asyncio.run(main())
    assert both == ["d", "s"]
    assert cancelled  # the other phase was cancelled, not waited for
    assert served == ["slice"]  # the exchange ran to its end before the refusal was raised


def _majority_case(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The majority's (θg, momentum) and a model a few outer steps off it."""
    gen = torch.Generator().manual_seed(seed)
    held = torch.cat([torch.randn(N, generator=gen), 1e-2 * torch.randn(N, generator=gen)])
    return held, held + 1e-2 * torch.randn(2 * N, generator=gen)


def _offer(state: torch.Tensor, digest: str | None = None, state_weight: float = 100.0,
           anchors: dict[str, torch.Tensor] | None = None) -> Contribution:
    return Contribution(pseudo_grad=torch.zeros(N), weight=1.0, global_params=state[:N], momentum=state[N:],
                        state_digest=digest or state_digest(state[:N], state[N:]), state_weight=state_weight,
                        anchors=anchors or {})


def _anchored_case(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A state all members held one merge back, the majority's model one small outer step from it, and another
    member's model another step from it (it merged alone)."""
    gen = torch.Generator().manual_seed(seed)
    anchor = torch.cat([torch.randn(N, generator=gen), 1e-2 * torch.randn(N, generator=gen)])
    step = lambda: anchor * (1 + 1e-4 * torch.randn(2 * N, generator=gen))  # noqa: E731
    return anchor, step(), step()


@pytest.mark.integration
@pytest.mark.parametrize("shared_anchor", [False, True])
def test_a_member_outside_a_majority_fetches_its_model_exactly_and_the_majority_keeps_it(bootstrap_dht, net_loop,
                                                                                          shared_anchor):
    """3 of 4 members hold one global model, the fourth another (it merged in another group, or alone): the group's
    model is the majority's, bit for bit, the fourth fetches it (one copy, from one holder), and the holders send
    nothing else of the agreement, where averaging took two int8 exchanges of every member's model (~half an fp32
    exchange each, test above). With no anchor in common the copy costs at most fp32's bytes; with one (the model
    one merge back), its exact difference from it, well under fp32's."""
    cfg = merge_config(run_id=f"catchup{int(shared_anchor)}", merge_window_s=8, merge_timeout_s=10, codec="none",
                       sync=True)
    if shared_anchor:
        anchor, held, other = _anchored_case(5)
        anchors = {state_digest(anchor[:N], anchor[N:]): anchor}
    else:
        (held, other), anchors = _majority_case(5), {}
    with running_mergers(bootstrap_dht, net_loop, 4, cfg, N) as mergers:
        offers = [_offer(s, anchors=anchors) for s in (held, held, held, other)]
        results = [flat(f.result(timeout=60)) for f in [m.submit(c) for m, c in zip(mergers, offers, strict=True)]]
    for r in results:
        assert r.failure == "" and len(r.group) == 4 and r.state_caught_up and not r.state_anchored, r.failure
        assert torch.equal(r.global_state, held)  # the majority's model itself, not an int8 round trip of it
    *holders, fetcher = results
    copy = 0.75 * 8 * N if shared_anchor else 8 * N + 1000
    served = [r.state_bytes_sent for r in holders]
    assert sorted(served)[:2] == [0, 0] and 1000 < max(served) < copy, served  # one copy, from one holder
    assert fetcher.state_bytes_sent < 1000  # its request
    assert 1000 < fetcher.state_bytes_received < copy  # the copy, counted where it arrived
    assert sorted(r.state_bytes_received for r in holders)[-1] < 1000  # a holder receives only the request
    assert all(r.pseudo_grad_bytes_received > 0 for r in results)  # the Δ exchange's, counted apart
    assert [r.state_share for r in results] == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0])


@pytest.mark.integration
@pytest.mark.parametrize("liars", [1, 3])
def test_a_member_outside_the_majority_refuses_a_model_other_than_the_majoritys(bootstrap_dht, net_loop, liars):
    """Holders that claim the majority's digest but serve another model: the fetcher checks what it gets against
    the digest, refuses it, strikes the liar and merges alone, naming the refusal. It never adopts the liar's
    model; where the holder dealt to it is honest, it gets the majority's. The holders merge in the group either
    way: the fetcher still reduces its slice of their Δ."""
    from p2pdiloco.network.catch_up import dealt_holder

    cfg = merge_config(run_id=f"liars{liars}", merge_window_s=8, merge_timeout_s=6, codec="none", sync=True)
    held, other = _majority_case(6)
    lie = -held  # what a liar holds and serves, under the majority's digest
    digest = state_digest(held[:N], held[N:])
    offers = [_offer(lie, digest)] * liars + [_offer(held)] * (3 - liars) + [_offer(other)]
    with running_mergers(bootstrap_dht, net_loop, 4, cfg, N) as mergers:
        results = [flat(f.result(timeout=60)) for f in [m.submit(c) for m, c in zip(mergers, offers, strict=True)]]
        fetcher, book, liar_ids = results[3], mergers[3].book, {m.peer_id for m in mergers[:liars]}
        struck = {p: n for p, n in book.strikes.items() if n > 0}
    for r in results[:3]:  # the holders merge in the group of 4 whatever the fetcher does with their model
        assert r.failure == "" and len(r.group) == 4, r.failure
    group = results[0].group
    holder = group[dealt_holder(_group_of(group, results[0], offers, mergers), group.index(mergers[3].peer_id))]
    if holder in liar_ids:
        assert fetcher.alone and "served a model other than the majority's" in fetcher.failure, fetcher.failure
        assert fetcher.global_state is None
        assert struck == {holder: 1} and book.rejected[FORGED] == 1
    else:
        assert fetcher.failure == "" and torch.equal(fetcher.global_state, held) and not struck
    assert liars == 1 or holder in liar_ids  # with 3 liars the refusal is always exercised
    assert not any(r.global_state is not None and torch.equal(r.global_state, lie) for r in results[liars:])


def _group_of(members: list[str], result, offers: list[Contribution], mergers) -> Group:
    """The group as its members acted on it (members, digests, state weights), rebuilt for `dealt_holder`."""
    by_id = {m.peer_id: c for m, c in zip(mergers, offers, strict=True)}
    return Group(result.group_id, members, [1.0] * len(members), [by_id[p].state_weight for p in members], True,
                 {"s": 2 * N}, digests=[by_id[p].state_digest for p in members])


def test_the_majority_a_group_adopts_is_counted_as_the_robust_rule_counts_models():
    """`Group.majority`: a digest held by more than half the members, where models differ; fresh members (no tokens
    absorbed) left out where the others are a majority, as the robust rule leaves their models out."""
    def majority(digests: list[str], state_weights: list[float] | None = None) -> str:
        n = len(digests)
        return Group("g", [f"p{i}" for i in range(n)], [1.0] * n, state_weights or [1.0] * n,
                     len(set(digests)) > 1, {"s": 2}, digests=digests).majority

    assert majority(["a", "a", "b"]) == "a"
    assert majority(["a", "a", "b", "b"]) == "" and majority(["a", "b", "c"]) == ""  # no majority: averaged
    assert majority(["a", "a"]) == ""  # one model: nothing to agree on
    assert majority(["a", "a", "a", "b", "b"], [0, 0, 5, 5, 5]) == "b"  # the trained members' majority
    assert majority(["a", "a", "b"], [0, 0, 5]) == "a"  # trained members are no majority: every model votes


def test_a_holder_serves_only_the_fetchers_dealt_to_it_each_once_and_under_the_same_notice():
    """A member cannot make a holder send the model twice, nor get it from a holder not dealt to it (so that it could
    make every holder send it), nor under another notice, nor in another member's name: each is refused, and only
    the dealt fetcher's first ask is served. Fetchers and holders are paired round-robin in group order."""
    import asyncio

    from p2pdiloco.algorithm.guards import GuardBook
    from p2pdiloco.network.admission import Request
    from p2pdiloco.network.catch_up import CatchUp, dealt_holder
    from p2pdiloco.network.rpc import MergeFailed
    from p2pdiloco.network.session import MergeSession

    group = Group("g", ["h0", "h1", "f0", "f1", "h2"], [1.0] * 5, [1.0, 3.0, 1.0, 1.0, 1.0], True, {"s": 8},
                  digests=["D", "D", "X", "Y", "D"])
    assert group.majority == "D" and [dealt_holder(group, j) for j in (2, 3)] == [0, 1]
    replies = []

    class Replies:  # the rpc's reply, recorded: the handler's decision is what is tested
        peer_id = "h0"

        async def reply(self, reader, writer, op, requester, header, payload=b"", phase=None):
            replies.append((requester, header.get("ok"), header.get("error", ""), len(payload)))

    session = MergeSession(group, 0, 0)

    async def find_session(gid: str, sender: str = "", header: dict | None = None) -> MergeSession:
        if gid != "g":
            raise MergeFailed("unknown group")
        return session

    async def main() -> tuple[torch.Tensor, list[float]]:
        catch_up = CatchUp(Replies(), find_session, 2.0, GuardBook(0, "h0"))
        holding = asyncio.ensure_future(catch_up.agree(session, torch.arange(8.0)))

        async def ask(sender: str, index: int, terms: str = group.terms) -> None:
            await catch_up.on_state(Request("catchup", sender, {"group_id": "g", "index": index, "terms": terms}),
                                    None, None)

        await ask("f0", 2)  # dealt to h0: served
        await ask("f0", 2)  # a second time
        await ask("f1", 3)  # dealt to h1
        await ask("f0", 3)  # in another member's name
        await ask("f1", 3, terms="another notice")
        await ask("h1", 1)  # a holder
        return await asyncio.wait_for(holding, 10)  # done once its one fetcher was served, not at its deadline

    state, shares = asyncio.run(main())
    assert replies[0] == ("f0", True, "", 4 * 8)
    assert [r[:2] for r in replies[1:]] == [("f0", False), ("f1", False), ("f0", False), ("f1", False), ("h1", False)]
    assert "asked already" in replies[1][2] and "does not serve" in replies[2][2] and "does not serve" in replies[5][2]
    assert "not that member" in replies[3][2] and "another notice" in replies[4][2]
    assert torch.equal(state, torch.arange(8.0)) and shares == [0.25] * 5  # its weight among the holders: 1 of 1 + 2 + 1 (3 is capped at 2 × the median)
