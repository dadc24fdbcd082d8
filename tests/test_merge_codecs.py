"""Every codec through the real merger (hivemind DHTs, p2p daemons, loopback): it really averages, members
agree bit for bit, error feedback keeps what was not sent, and the byte counters match the payload sizes."""

from __future__ import annotations

import msgpack
import pytest
import torch

from p2pdiloco.algorithm.codecs import get_codec
from p2pdiloco.algorithm.feedback import ErrorFeedback
from p2pdiloco.algorithm.outer import weighted_average
from p2pdiloco.config import CODECS, GuardConfig
from p2pdiloco.network.allreduce import owned_slice, slice_bounds
from p2pdiloco.network.merger import Contribution
from tests.conftest import flat, merge_config, running_mergers

pytestmark = pytest.mark.integration

N = 30_001


@pytest.fixture
def mergers(request, bootstrap_dht, net_loop):
    codec = request.param
    cfg = merge_config(run_id=f"c{codec}", merge_window_s=8, merge_timeout_s=10, codec=codec)
    # distinct but unrelated vectors: the plain mean, so that the codec's error is all there is to bound
    with running_mergers(bootstrap_dht, net_loop, 3, cfg, N, guard=GuardConfig(aggregate="mean", min_cosine=-1)) as ms:
        yield ms


def _contribution(vec: torch.Tensor, weight: float) -> Contribution:
    return Contribution(pseudo_grad=vec, weight=weight, global_params=torch.zeros_like(vec),
                        momentum=torch.zeros_like(vec), state_digest="same", state_weight=1.0)


def _feedback(merger, vec: torch.Tensor, result) -> ErrorFeedback:
    """A learner's error feedback, none before, after a merge of `vec` that gave `result` (`Learner._apply_in_flight`)."""
    ef = ErrorFeedback(merger.codec.lossy)
    if not result.alone:
        ef.commit(vec, vec if result.sent is None else result.sent)
    return ef


@pytest.mark.parametrize("mergers", [c for c in CODECS if c != "sparseloco"], indirect=True)
def test_each_codec_really_averages_and_members_agree(mergers):
    """Sliced codecs; sparseloco all-gathers whole parts instead (tests/test_sparse_merge.py)."""
    codec = mergers[0].codec
    g = torch.Generator().manual_seed(3)
    vecs = [torch.randn(N, generator=g) * 1e-2 + i * 1e-2 for i in range(3)]  # distinct means: averaging shows
    weights = [1.0, 2.0, 3.0]
    futures = [m.submit(_contribution(v, w)) for m, v, w in zip(mergers, vecs, weights, strict=True)]
    results = [flat(f.result(timeout=60)) for f in futures]
    for r in results:
        assert r.failure == "" and len(r.group) == 3, r.failure
        assert torch.equal(r.pseudo_grad, results[0].pseudo_grad)  # one averaged slice, decoded alike everywhere
    by_id = {m.peer_id: (v, w, m) for m, v, w in zip(mergers, vecs, weights, strict=True)}
    order = results[0].group
    expected = weighted_average([by_id[p][0] for p in order], [by_id[p][1] for p in order])
    total = sum(weights)
    # each member's slice is quantized once on the way in, the average once on the way out
    tol = sum(by_id[p][1] / total * codec.error_bound(by_id[p][0]) for p in order) + codec.error_bound(expected) + 1e-7
    err = (results[0].pseudo_grad - expected).abs()
    assert (err <= tol).all(), f"{codec.name}: error {float((err - tol).max()):.3g} beyond the bound"
    for v in vecs:  # a codec that averages nothing would leave a member with its own vector
        assert float((v - expected).abs().mean()) > 3 * float(err.mean())
    # error feedback: what the codec dropped from this round's sends is kept for the next round, and so is what
    # the rounding of the average an owner sent back took from the group (codecs.as_held)
    bounds, ws = slice_bounds(N, 3), [by_id[p][1] for p in order]
    by_result = {m.peer_id: r for m, r in zip(mergers, results, strict=True)}
    for p in order:
        feedback = _feedback(by_id[p][2], by_id[p][0], by_result[p])
        if not codec.lossy:
            assert feedback.residual is None
            continue
        me, residual = order.index(p), feedback.residual
        assert residual is not None and feedback.norm() > 0
        for j in range(3):
            lo, hi = bounds[owned_slice(results[0].group_id, j, 3)]
            decoded = [by_id[q][0][lo:hi] if q == order[j] else codec.decode(codec.encode(by_id[q][0][lo:hi]), hi - lo)
                       for q in order]
            if j != me:  # a slice it sent: what the codec dropped of its part
                torch.testing.assert_close(residual[lo:hi], by_id[p][0][lo:hi] - decoded[me], rtol=0, atol=1e-7)
                continue
            # its own slice never left it; its average did, rounded, and the group holds that rounding less
            exact, held = weighted_average(decoded, ws), results[0].pseudo_grad[lo:hi]
            assert float((exact - held).abs().max()) > 0  # the codec did round the average
            share = ws[me] / total  # the plain mean: shares are the weights'; at least 1/3 is charged
            torch.testing.assert_close(residual[lo:hi], (exact - held) / max(share, 1 / 3), rtol=0, atol=1e-7)


def _frame(header: dict, payload_len: int) -> int:
    return 12 + len(msgpack.packb(header, use_bin_type=True)) + payload_len


@pytest.mark.parametrize("mergers", ["none", "int8", "int4"], indirect=True)
def test_byte_counters_match_payload_sizes(mergers):
    """Counted bytes = the exact frames of the slices and averages each member exchanged, computed here from
    the codec's sizes, plus the small matchmaking messages (bounded separately)."""
    codec = mergers[0].codec
    vecs = [torch.full((N,), float(i + 1)) for i in range(3)]
    futures = [m.submit(_contribution(v, 1.0)) for m, v in zip(mergers, vecs, strict=True)]
    results = [flat(f.result(timeout=60)) for f in futures]
    order = results[0].group
    bounds = slice_bounds(N, 3)
    for r, m in zip(results, mergers, strict=True):
        assert r.failure == ""
        me = order.index(m.peer_id)
        gid = r.group_id
        # it sends each member the slice that member owns, and sends its own averaged slice back to each of the others
        own = [bounds[owned_slice(gid, j, 3)] for j in range(3)]
        sent = sum(_frame({"group_id": gid, "tag": "d", "index": me, "codec": codec.name},
                          codec.encoded_size(hi - lo)) for j, (lo, hi) in enumerate(own) if j != me)
        sent += 2 * _frame({"ok": True}, codec.encoded_size(own[me][1] - own[me][0]))
        received = sum(_frame({"ok": True}, codec.encoded_size(hi - lo)) for j, (lo, hi) in enumerate(own) if j != me)
        received += sum(_frame({"group_id": gid, "tag": "d", "index": j, "codec": codec.name},
                               codec.encoded_size(own[me][1] - own[me][0])) for j in range(3) if j != me)
        # matchmaking: invites, replies, group notices; a few hundred bytes at most per member
        assert 0 <= r.bytes_sent - sent <= 1500, (r.bytes_sent, sent)
        assert 0 <= r.bytes_received - received <= 1500, (r.bytes_received, received)
    assert get_codec("none").encoded_size(N) / codec.encoded_size(N) >= {"none": 1, "int8": 3.9, "int4": 7.4}[codec.name]


@pytest.mark.parametrize("codec", ["int4", "sparseloco"])
def test_a_rejected_part_is_dropped_not_carried_into_the_next_round(bootstrap_dht, net_loop, codec):
    """Error feedback keeps what the codec dropped, not a part the guards left out. Carried whole, a rejected part
    came back the next round on top of the next Δ, larger, and was left out again, round after round (three of
    16 peers in `bench scale`, whose accumulated part later made the global model worse than its start)."""
    cfg = merge_config(run_id=f"rej{codec}", merge_window_s=8, merge_timeout_s=10, codec=codec)
    with running_mergers(bootstrap_dht, net_loop, 4, cfg, N, guard=GuardConfig(min_cosine=-1, ban_after=0)) as ms:
        g = torch.Generator().manual_seed(5)
        common = torch.randn(N, generator=g)
        results = {}
        for rnd, scale in [(1, 20.0), (2, 1.0)]:  # round 1: the last member's part is 20× too large
            vecs = [common + 0.3 * torch.randn(N, generator=g) for _ in ms]
            vecs[-1] = vecs[-1] * scale
            futures = []
            for m, v in zip(ms, vecs, strict=True):
                c = _contribution(v, 1.0)
                c.round = rnd
                futures.append(m.submit(c))
            results[rnd] = [flat(f.result(timeout=60)) for f in futures]
            for r in results[rnd]:
                assert r.failure == "" and len(r.group) == 4, r.failure
            if rnd == 1:
                residual = _feedback(ms[-1], vecs[-1], results[1][-1]).residual
                # every member left the 20× part out; its residual is not that part (it held none before)
                assert results[1][-1].own_kept == 0.0
                assert residual is None or float(residual.abs().max()) == 0.0, float(residual.norm())
                honest = _feedback(ms[0], vecs[0], results[1][0]).residual
                assert honest is not None and 0 < float(honest.norm()) < float(vecs[0].norm())  # still compressed
        # the next round's honest part is judged on its own and counts
        assert results[2][-1].own_kept == 1.0, results[2][-1].own_kept
        assert results[2][0].rejected == 0
