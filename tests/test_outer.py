"""The DiLoCo math against hand-computed numbers (golden values checked in)."""

import math

import pytest
import torch

from p2pdiloco.algorithm.outer import (
    cosine_lr,
    outer_step,
    pseudo_gradient,
    rebase,
    stale_share_kept,
    state_digest,
    weight_shares,
    weighted_average,
)


def test_pseudo_gradient_is_global_minus_local():
    g = torch.tensor([1.0, 2.0, -3.0])
    local = torch.tensor([0.5, 2.5, -3.0])
    assert torch.equal(pseudo_gradient(g, local), torch.tensor([0.5, -0.5, 0.0]))


def test_outer_step_golden_two_steps():
    # lr 0.7, mu 0.9, Nesterov; by hand:
    # step 1: m = 0.9*0 + 1 = 1;         update = 1 + 0.9*1 = 1.9;       θ = 1 - 0.7*1.9 = -0.33
    # step 2: m = 0.9*1 + 0.5 = 1.4;     update = 0.5 + 0.9*1.4 = 1.76;  θ = -0.33 - 0.7*1.76 = -1.562
    theta, m = torch.tensor([1.0]), torch.zeros(1)
    theta, m = outer_step(theta, m, torch.tensor([1.0]), lr=0.7, mu=0.9)
    assert theta.item() == pytest.approx(-0.33, abs=1e-6) and m.item() == pytest.approx(1.0)
    theta, m = outer_step(theta, m, torch.tensor([0.5]), lr=0.7, mu=0.9)
    assert theta.item() == pytest.approx(-1.562, abs=1e-6) and m.item() == pytest.approx(1.4)


def test_outer_step_matches_torch_sgd_nesterov():
    torch.manual_seed(0)
    theta0 = torch.randn(50)
    deltas = [torch.randn(50) for _ in range(4)]
    p = torch.nn.Parameter(theta0.clone())
    opt = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    theta, m = theta0.clone(), torch.zeros(50)
    for d in deltas:
        p.grad = d.clone()
        opt.step()
        theta, m = outer_step(theta, m, d, 0.7, 0.9, nesterov=True)
    torch.testing.assert_close(theta, p.detach(), rtol=1e-6, atol=1e-6)


def test_outer_step_plain_momentum_and_inputs_untouched():
    theta, m, d = torch.tensor([2.0]), torch.tensor([1.0]), torch.tensor([1.0])
    new_theta, new_m = outer_step(theta, m, d, lr=0.5, mu=0.5, nesterov=False)
    # m = 0.5*1 + 1 = 1.5; θ = 2 - 0.5*1.5 = 1.25
    assert new_m.item() == 1.5 and new_theta.item() == 1.25
    assert theta.item() == 2.0 and m.item() == 1.0


def test_outer_lr_one_no_momentum_is_plain_averaging():
    # with lr=1, mu=0 the outer step lands exactly on the averaged local model (FedAvg)
    g = torch.tensor([1.0, 1.0])
    locals_ = [torch.tensor([0.0, 2.0]), torch.tensor([2.0, 4.0])]
    avg_delta = weighted_average([pseudo_gradient(g, x) for x in locals_], [1, 1])
    theta, _ = outer_step(g, torch.zeros(2), avg_delta, lr=1.0, mu=0.0)
    assert torch.equal(theta, torch.tensor([1.0, 3.0]))


def test_rebase_keeps_steps_taken_since_submit():
    new_global = torch.tensor([10.0, 10.0])
    at_submit = torch.tensor([1.0, 2.0])
    now = torch.tensor([1.5, 1.0])
    assert torch.equal(rebase(new_global, now, at_submit), torch.tensor([10.5, 9.0]))


def test_rebase_keeps_a_share_of_stale_steps_and_all_of_steps_taken_from_where_the_merge_landed():
    new_global = torch.tensor([10.0, 10.0])
    at_submit = torch.tensor([1.0, 2.0])
    now = torch.tensor([1.5, 1.0])  # moved by (+0.5, −1) since the submit, from a model the merge did not land on
    assert torch.equal(rebase(new_global, now, at_submit, keep=0.5), torch.tensor([10.25, 9.5]))
    assert torch.equal(rebase(new_global, now, at_submit, keep=0.0), new_global)
    # a merge alone after an eager update lands on θ_at_submit itself: those steps were not stale
    assert stale_share_kept(new_global, at_submit, 0.5) == 0.5
    assert stale_share_kept(at_submit.clone(), at_submit, 0.5) == 1.0


def test_weight_shares_as_the_average_counts_them():
    assert weight_shares([100, 300]) == [0.25, 0.75]
    # the middle member's part was left out: the others share the whole, 100 / (100 + 300) and 300 / 400
    assert weight_shares([100, 50, 300], [True, False, True]) == [0.25, 0.0, 0.75]
    assert weight_shares([0, 0, 0], [True, True, False]) == [0.5, 0.5, 0.0]  # all zero: the kept count equally
    assert weight_shares([5, 5], [False, False]) == [0.0, 0.0]


def test_weighted_average_by_tokens():
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([4.0, 3.0])
    # weights 1:2 -> (1*1 + 2*4)/3 = 3, (0 + 6)/3 = 2
    assert torch.allclose(weighted_average([a, b], [100, 200]), torch.tensor([3.0, 2.0]))
    assert torch.allclose(weighted_average([a, b], [0, 0]), torch.tensor([2.5, 1.5]))  # all zero: equal
    with pytest.raises(ValueError):
        weighted_average([a, b], [1.0])
    with pytest.raises(ValueError):
        weighted_average([a, b], [1.0, -1.0])


def test_cosine_lr_schedule_points():
    assert cosine_lr(0, 1.0, 10, 110, 0.1) == pytest.approx(0.1)
    assert cosine_lr(9, 1.0, 10, 110, 0.1) == pytest.approx(1.0)
    assert cosine_lr(10, 1.0, 10, 110, 0.1) == pytest.approx(1.0)
    assert cosine_lr(60, 1.0, 10, 110, 0.1) == pytest.approx(0.1 + 0.5 * 0.9 * (1 + math.cos(math.pi * 0.5)))
    assert cosine_lr(110, 1.0, 10, 110, 0.1) == pytest.approx(0.1)
    assert cosine_lr(500, 1.0, 10, 110, 0.1) == pytest.approx(0.1)


def test_state_digest_sees_one_ulp():
    x = torch.tensor([1.0, 2.0])
    y = x.clone()
    y[1] = torch.nextafter(y[1], torch.tensor(3.0))
    assert state_digest(x) == state_digest(x.clone())
    assert state_digest(x) != state_digest(y)
