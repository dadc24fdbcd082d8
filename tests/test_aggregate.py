"""`outer_round` and `aggregate` as pure functions: small hand-checked cases, inputs left as they are.

The whole-round and whole-guard numbers are pinned bit for bit by test_golden.py; these check the contracts."""

from types import SimpleNamespace

import torch

from p2pdiloco.algorithm.aggregate import (
    ANCHORED,
    PSEUDO_GRAD,
    STATE,
    UNGUARDED,
    aggregate,
    gathered_policy,
    slice_policy,
)
from p2pdiloco.algorithm.guards import FAR, NORM, TRUST
from p2pdiloco.algorithm.outer import eager_step, outer_round, outer_step, rebase

CFG = SimpleNamespace(lr=0.7, alone_lr=0.4, momentum=0.9, nesterov=True, rebase_keep=0.5)


def test_outer_round_steps_with_lr_or_alone_lr_and_rebases_with_the_stale_share():
    g, m, d = torch.tensor([1.0, 2.0]), torch.tensor([0.1, -0.1]), torch.tensor([0.5, 0.25])
    copies = [t.clone() for t in (g, m, d)]
    done = outer_round(g, m, d, CFG)
    assert [torch.equal(a, b) for a, b in zip((g, m, d), copies, strict=True)] == [True] * 3  # inputs unchanged
    want_g, want_m = outer_step(g, m, d, 0.7, 0.9)
    assert torch.equal(done.params, want_g) and torch.equal(done.momentum, want_m) and done.adopted
    assert done.local is None and done.keep == 0.0
    assert done.step == float(torch.linalg.vector_norm(want_g - g))
    assert torch.equal(outer_round(g, m, d, CFG, alone=True).params, outer_step(g, m, d, 0.4, 0.9)[0])
    at_submit, now = g - 1.0, g - 0.5
    done = outer_round(g, m, d, CFG, local_now=now, local_at_submit=at_submit)
    assert done.keep == 0.5 and torch.equal(done.local, rebase(want_g, now, at_submit, 0.5))
    restart = outer_round(g, m, d, CFG, local_now=now)
    assert restart.keep == 0.0 and torch.equal(restart.local, want_g)
    eager = eager_step(g, m, d, CFG)  # merged alone after an eager update: the steps since are not stale
    assert outer_round(g, m, d, CFG, alone=True, local_now=eager + 0.1, local_at_submit=eager).keep == 1.0


def test_outer_round_adopts_an_agreed_state_within_reach_and_refuses_one_beyond_it():
    g, m, d = torch.ones(4), torch.zeros(4), torch.full((4,), 0.01)
    near = torch.cat([g + 0.01, m + 0.5])
    done = outer_round(g, m, d, CFG, agreed_state=near, own_weight=10.0)
    assert done.adopted and torch.equal(done.params, outer_step(g + 0.01, m + 0.5, d, 0.7, 0.9)[0])
    far = torch.cat([-g, m])
    refused = outer_round(g, m, d, CFG, agreed_state=far, own_weight=10.0)
    assert not refused.adopted and torch.equal(refused.params, outer_step(g, m, d, 0.7, 0.9)[0])
    assert outer_round(g, m, d, CFG, agreed_state=far, own_weight=10.0, longest_recent=1.0).adopted
    assert outer_round(g, m, d, CFG, agreed_state=far, own_weight=0.0).adopted  # a fresh peer takes it


def test_aggregate_of_a_slice_weighs_by_history_and_returns_the_scores_without_keeping_them():
    ref = torch.tensor([1.0, 1.0, 0.0, 0.0])
    parts = [ref + 0.1 * i for i in range(4)] + [-ref]
    history = [0.9, None, 0.5, 0.9, None]
    policy = slice_policy(PSEUDO_GRAD, 0, "mean", 4.0, -1.0, 0.9, 3, 0.2)
    out = aggregate(parts, [1.0] * 5, [""] * 5, ref, policy, history)
    assert history == [0.9, None, 0.5, 0.9, None]
    assert out.reasons == ["", "", "", "", TRUST] and out.shares == [0.25, 0.25, 0.25, 0.25, 0.0]
    assert out.trust[1] == out.cosines[1] and out.trust[4] < 0 and out.factors[4] == 0.0
    torch.testing.assert_close(out.average, sum(parts[:4]) / 4)


def test_aggregate_of_states_leaves_far_models_out_and_of_anchored_differences_skips_the_screens():
    models = [torch.ones(3), torch.ones(3), torch.ones(3) * 1.01, torch.ones(3) * 1.02, -100 * torch.ones(3)]
    policy = slice_policy(STATE, 0, "centered_clip", 0.0, -1.0, 0.9, 3, 0.2)
    out = aggregate(models, [1.0] * 5, [""] * 5, None, policy)
    assert out.reasons == ["", "", "", "", FAR] and out.shares[4] == 0.0
    assert float((out.average - 1).abs().max()) <= 0.02
    anchored = slice_policy(ANCHORED, 0, "centered_clip", 4.0, 0.5, 0.9, 3, 0.2)
    assert anchored.norm_bound == 0 and anchored.min_cosine == -1 and anchored.tie and not anchored.trust


def test_aggregate_of_gathered_parts_screens_alike_and_reports_nothing_left_as_no_average():
    parts = [torch.tensor([1.0, 0.0]), torch.tensor([0.9, 0.1]), torch.tensor([50.0, 0.0])]
    out = aggregate(parts, [1.0, 3.0, 1.0], [""] * 3, None, gathered_policy(4.0, -1.0, 0.9, False))
    assert out.reasons == ["", "", NORM] and out.shares == [0.25, 0.75, 0.0]
    assert aggregate(parts, [1.0] * 3, ["x", "y", "z"], None, UNGUARDED).average is None
