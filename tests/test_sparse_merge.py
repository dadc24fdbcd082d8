"""The sparseloco codec through the real merger (hivemind DHTs, p2p daemons, loopback): the group all-gathers the
sparse parts, members end bit-identical, the average is the mean of what each member sent, error feedback keeps
what was dropped, and the bytes counted are about the parts' sizes."""

from __future__ import annotations

import pytest
import torch

from p2pdiloco.algorithm.feedback import ErrorFeedback
from p2pdiloco.algorithm.outer import weighted_average
from p2pdiloco.config import GuardConfig
from p2pdiloco.network.merger import Contribution
from tests.conftest import flat, merge_config, running_mergers

pytestmark = pytest.mark.integration

N = 50_001


def _contribution(vec: torch.Tensor, weight: float) -> Contribution:
    return Contribution(pseudo_grad=vec, weight=weight, global_params=torch.zeros_like(vec),
                        momentum=torch.zeros_like(vec), state_digest="same", state_weight=1.0)


@pytest.mark.parametrize("guarded", [True, False])
def test_sparse_merge_members_bit_identical_and_average_what_was_sent(bootstrap_dht, net_loop, guarded):
    cfg = merge_config(run_id=f"sp{int(guarded)}", merge_window_s=8, merge_timeout_s=10, codec="sparseloco")
    guard = GuardConfig(enabled=guarded)
    with running_mergers(bootstrap_dht, net_loop, 3, cfg, N, guard=guard) as mergers:
        codec = mergers[0].codec
        g = torch.Generator().manual_seed(5)
        vecs = [torch.randn(N, generator=g) * 1e-2 for _ in range(3)]
        weights = [1.0, 2.0, 3.0]
        futures = [m.submit(_contribution(v, w)) for m, v, w in zip(mergers, vecs, weights, strict=True)]
        results = [flat(f.result(timeout=60)) for f in futures]
        for r in results:
            assert r.failure == "" and len(r.group) == 3, r.failure
            assert torch.equal(r.pseudo_grad, results[0].pseudo_grad)  # every member computed the same bits
            assert r.own_kept == 1.0
        by_id = {m.peer_id: (v, w, m) for m, v, w in zip(mergers, vecs, weights, strict=True)}
        order = results[0].group
        sent = [codec.decode(codec.encode(by_id[p][0]), N) for p in order]
        expected = weighted_average(sent, [by_id[p][1] for p in order])
        torch.testing.assert_close(results[0].pseudo_grad, expected, rtol=1e-6, atol=1e-9)
        density = float((results[0].pseudo_grad != 0).float().mean())
        assert 0.03 < density <= 3 * sum(codec.counts(N)) / N  # the union of three sparse parts, not a dense average
        for r, v in zip(results, vecs, strict=True):
            # the residual is what was dropped: the target minus what the others decoded
            ef = ErrorFeedback()
            ef.commit(v, r.sent)
            torch.testing.assert_close(ef.residual, v - codec.decode(codec.encode(v), N))
        for r in results:
            # each member sent its part to two others: about two parts' bytes, plus framing and matchmaking
            part = len(codec.encode(vecs[0]))
            assert 2 * part * 0.9 < r.bytes_sent < 2 * part * 1.1 + 20_000, (r.bytes_sent, part)
            assert r.bytes_sent < 4 * N / 50  # ≥ 50× fewer than one fp32 copy of the vector


def test_a_member_frozen_before_sending_fails_the_sparse_merge_for_everyone(bootstrap_dht, net_loop):
    """Nobody applies an average that misses a member's part; error feedback keeps what was not delivered."""
    from p2pdiloco.testing.faults import Faults

    cfg = merge_config(run_id="spf", merge_window_s=8, merge_timeout_s=4, codec="sparseloco")
    stall = Faults({("exchange", 7): "stall"})
    with (running_mergers(bootstrap_dht, net_loop, 2, cfg, 9001) as others,
          running_mergers(bootstrap_dht, net_loop, 1, cfg, 9001, faults=stall) as (frozen,)):
        vecs = [torch.randn(9001, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        futures = []
        for m, v in zip([*others, frozen], vecs, strict=True):
            c = _contribution(v, 1.0)
            c.round = 7
            futures.append(m.submit(c))
        for f in futures[:2]:
            r = flat(f.result(timeout=60))
            # alone: the learner steps on its own Δ, and error feedback counts nothing as sent (`Alone` has no `sent`)
            assert r.failure and r.alone and r.sent is None
        futures[2].cancel()


def test_sign_flipped_sparse_parts_are_left_out_by_every_member_alike(bootstrap_dht, net_loop):
    """The trust screen for all-gathered parts (algorithm/trust.trusted): 2 of 5 members send −Δ; every member
    judges the parts against the same momentum, leaves the same two out, and ends with the same bits: the mean
    of the three honest parts. The flippers learn that their parts counted nothing (own_kept 0), no strike."""
    cfg = merge_config(run_id="spt", merge_window_s=8, merge_timeout_s=10, codec="sparseloco")
    with running_mergers(bootstrap_dht, net_loop, 5, cfg, N) as mergers:
        codec = mergers[0].codec
        g = torch.Generator().manual_seed(9)
        momentum = torch.randn(N, generator=g)  # the shared global state's momentum: the screen's reference
        honest = [0.3 * momentum + torch.randn(N, generator=g) for _ in range(3)]
        vecs = [-honest[0], *honest, -honest[1]]  # members 0 and 4 flip signs
        futures = []
        for m, v in zip(mergers, vecs, strict=True):
            c = _contribution(v, 1.0)
            c.momentum = momentum.clone()
            futures.append(m.submit(c))
        results = [flat(f.result(timeout=60)) for f in futures]
        for r in results:
            assert r.failure == "" and len(r.group) == 5, r.failure
            assert torch.equal(r.pseudo_grad, results[0].pseudo_grad)
        assert [r.own_kept for r in results] == [0.0, 1.0, 1.0, 1.0, 0.0]
        expected = sum(codec.decode(codec.encode(h), N) for h in honest) / 3
        torch.testing.assert_close(results[0].pseudo_grad, expected, rtol=1e-5, atol=1e-8)
        flippers = {mergers[0].peer_id, mergers[4].peer_id}
        for m in mergers[1:4]:
            assert m.book.rejected["trust"] == 2 and sum(m.book.strikes.values()) == 0  # each flipped part, once
            assert not flippers & set(m.book.banned)


@pytest.mark.parametrize("undialable", [1, 2, 3])
def test_members_nobody_can_dial_take_part_in_a_sparse_merge_and_nobody_opens_a_stream_to_them(
        bootstrap_dht, net_loop, undialable):
    """With members behind NAT (here: marked so), every sparse part still reaches every member bit for bit: those
    nobody can dial send their parts to the members others can dial, which answer with their own, and their
    relayers with the others' that nobody can dial; no member opens a stream to one of them."""
    cfg = merge_config(run_id=f"spnat{undialable}", merge_window_s=8, merge_timeout_s=10, codec="sparseloco")
    # unguarded: random parts point every way, and the trust screen would leave some out of the expected mean
    with running_mergers(bootstrap_dht, net_loop, 4, cfg, N, guard=GuardConfig(enabled=False)) as mergers:
        for m in mergers[:undialable]:
            m.set_dialable(False)
        hidden = {m.peer_id for m in mergers[:undialable]}
        opened: list[tuple[str, str]] = []
        for m in mergers:
            call = m.rpc.call

            async def spy(peer, op, *args, _call=call, **kwargs):
                opened.append((peer, op))
                return await _call(peer, op, *args, **kwargs)

            m.rpc.call = spy
        g = torch.Generator().manual_seed(7)
        vecs = [torch.randn(N, generator=g) * 1e-2 for _ in mergers]
        futures = [m.submit(_contribution(v, 1.0 + i)) for i, (m, v) in enumerate(zip(mergers, vecs, strict=True))]
        results = [flat(f.result(timeout=60)) for f in futures]
    for r in results:
        assert r.failure == "" and len(r.group) == 4, r.failure
        assert torch.equal(r.pseudo_grad, results[0].pseudo_grad)
    codec, by_id = mergers[0].codec, {m.peer_id: (v, 1.0 + i) for i, (m, v) in enumerate(zip(mergers, vecs, strict=True))}
    order = results[0].group
    expected = weighted_average([codec.decode(codec.encode(by_id[p][0]), N) for p in order], [by_id[p][1] for p in order])
    torch.testing.assert_close(results[0].pseudo_grad, expected, rtol=1e-6, atol=1e-9)
    sparse_to = [peer for peer, op in opened if op == "sparse"]
    assert sparse_to and not hidden & set(sparse_to), sparse_to  # every part stream went to a member others can dial


def test_a_relayed_part_other_than_the_one_its_digest_names_is_refused():
    """A relayer answering a member nobody can dial with another member's part changed: the member refuses it."""
    import asyncio

    from p2pdiloco.network.group import Group, part_digest
    from p2pdiloco.network.rpc import MergeFailed
    from p2pdiloco.network.sparse_exchange import SparseExchange, _Gathered, relayer_of

    parts = [bytes([i]) * 10 for i in range(4)]
    group = Group("g", [f"p{i}" for i in range(4)], [1.0] * 4, [1.0] * 4, False, {"d": N}, digests=["x"] * 4,
                  owners=[0, 1], part_digests=[part_digest(p) for p in parts])
    assert relayer_of(group, 2) == 0 and relayer_of(group, 3) == 1  # the members others can dial, in turn

    async def take(payload_of_3: bytes) -> list:
        gathered = _Gathered([None, None, parts[2], None], asyncio.get_running_loop().create_future())
        reply = {"ok": True, "parts": [[1, 10], [3, len(payload_of_3)]]}
        SparseExchange._take_relayed(group, 1, gathered, reply, parts[1] + payload_of_3)
        return gathered.parts

    assert asyncio.run(take(parts[3])) == [None, *parts[1:]]  # as the notice's digests name them
    with pytest.raises(MergeFailed, match="not the one its digest in the notice names"):
        asyncio.run(take(b"\x07" * 10))
