"""Golden numbers for robust aggregation and the contribution guards (pure functions, no network)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from p2pdiloco.algorithm.guards import (
    DIRECTION,
    NONFINITE,
    NORM,
    GuardBook,
    check_average,
    screen_parts,
    stale_members,
)
from p2pdiloco.algorithm.robust import (
    aggregate,
    centered_clip,
    coordinate_median_low,
    radial_directional_average,
    trimmed_mean,
)
from p2pdiloco.config import GuardConfig
from p2pdiloco.testing.hostile import corrupt

T = torch.tensor


def test_trimmed_mean_golden():
    parts = [T([1.0, 10.0]), T([2.0, 20.0]), T([3.0, 30.0]), T([100.0, -100.0]), T([4.0, 40.0])]
    # n=5, trim 0.2 -> k=1: coordinate 0 keeps [2,3,4], coordinate 1 keeps [10,20,30]
    assert_close(trimmed_mean(parts, 0.2), T([3.0, 20.0]))
    assert_close(trimmed_mean(parts[:2], 0.2), T([1.5, 15.0]))  # too few to trim: plain mean


def test_coordinate_median_low_golden():
    assert_close(coordinate_median_low([T([1.0, 5.0]), T([3.0, -1.0]), T([2.0, 0.0])]), T([2.0, 0.0]))


def test_centered_clip_golden_and_bounded_by_an_outlier():
    honest = [T([1.0, 0.0]), T([0.0, 1.0]), T([1.0, 1.0]), T([0.5, 0.5])]
    parts = [*honest, T([1000.0, 1000.0])]
    # by hand: start at the coordinate-wise median (1, 1); distances 1, 1, 0, 0.7071, 1412.8 -> tau = 1;
    # one step: v += [(0,-1) + (-1,0) + 0 + (-.5,-.5) + (999,999)/1412.8] / 5 = v - (1.5 - 1/sqrt(2)) / 5
    one = 1 - (1.5 - 2 ** -0.5) / 5
    assert_close(centered_clip(parts, [1.0] * 5, iters=1), T([one, one]))
    out = centered_clip(parts, [1.0] * 5)
    plain = torch.stack([*honest, T([1000.0, 1000.0])]).mean(0)
    assert float(plain[0]) > 200 and float(out.norm()) < 1.5
    # agreeing members: the answer is their value
    assert_close(centered_clip([T([2.0, 3.0])] * 3, [1, 2, 3]), T([2.0, 3.0]))


def test_rda_keeps_the_mean_norm():
    a, b = T([3.0, 0.0]), T([0.0, 1.0])
    out = radial_directional_average([a, b], [1.0, 1.0])
    # direction (1, 1)/2 normalized, norm (3 + 1)/2 = 2
    assert_close(out, T([2.0, 2.0]) / 2 ** 0.5)
    plain = (a + b) / 2
    assert float(out.norm()) == pytest.approx(2.0) and float(plain.norm()) < 2.0


def test_aggregate_uses_mean_below_the_robust_group_size():
    parts, w = [T([0.0]), T([3.0])], [1.0, 2.0]
    assert_close(aggregate("centered_clip", parts, w), T([2.0]))
    assert_close(aggregate("trimmed_mean", [T([0.0]), T([1.0]), T([9.0])], [1, 1, 1]), T([1.0]))
    with pytest.raises(ValueError):
        aggregate("median-of-means", parts, w)


G = GuardConfig()  # the defaults: what a swarm runs with
COS = 0.1  # the direction check is off by default; this is the bound it had when it was on


def _honest(n: int, dim: int = 4000, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(dim, generator=g)
    return [common + 0.5 * torch.randn(dim, generator=g) for _ in range(n)]


@pytest.mark.parametrize("kind,reason", [("nan", NONFINITE), ("scale", NORM), ("noise", DIRECTION),
                                         ("signflip", DIRECTION)])
def test_each_hostile_kind_is_rejected_and_only_it(kind, reason):
    parts = _honest(5)
    parts[2] = corrupt(parts[2], kind, torch.Generator().manual_seed(1))
    reasons = screen_parts(parts, own=0, norm_bound=G.norm_bound, min_cosine=COS)
    assert reasons == ["", "", reason, "", ""]


def test_the_direction_check_is_off_by_default():
    # honest decoupled peers fell below a cosine of 0.1 within a minute of bench churn and banned each other
    parts = _honest(5)
    parts[2] = -parts[2]
    assert G.min_cosine == -1 and screen_parts(parts, own=0, norm_bound=G.norm_bound, min_cosine=G.min_cosine) == [""] * 5


def test_two_members_judge_norms_against_their_own_part_but_not_directions():
    mine, theirs = _honest(2)
    assert screen_parts([mine, theirs * 1000], own=0, norm_bound=G.norm_bound, min_cosine=COS) == ["", NORM]
    assert screen_parts([mine, theirs], own=0, norm_bound=G.norm_bound, min_cosine=COS) == ["", ""]
    # with two members either could be the odd one out: an honest peer on other data may point elsewhere
    assert screen_parts([mine, -theirs], own=0, norm_bound=G.norm_bound, min_cosine=COS) == ["", ""]
    assert screen_parts([mine, -theirs, theirs], own=0, norm_bound=G.norm_bound, min_cosine=COS)[1] == DIRECTION


def test_staleness_and_returned_average():
    assert stale_members([10, 11, 3, 10], max_lag=5) == [False, False, True, False]
    assert stale_members([10, 3], max_lag=0) == [False, False]
    own = T([1.0, 1.0])
    assert check_average(T([0.5, 1.5]), own, 4.0) == ""
    assert check_average(T([float("nan"), 0.0]), own, 4.0) == NONFINITE
    assert check_average(own * 1000, own, 4.0) == NORM


def test_guard_book_bans_after_repeated_bad_merges():
    book = GuardBook(ban_after=2, tag="me")
    book.reject("peerA", NORM, "g1")
    book.reject("peerA", NONFINITE, "g1")  # same merge: one strike
    assert "peerA" not in book.banned
    book.reject("me", NORM, "g2", strike=False)
    book.accept("peerA", "g2")  # a good merge ends its run of strikes
    book.reject("peerA", NORM, "g3")
    assert "peerA" not in book.banned
    book.reject("peerA", NORM, "g4")
    assert book.banned == {"peerA"}
    assert book.report() == {"rejected": 5, "rejected_by_reason": {NORM: 4, NONFINITE: 1}, "banned": ["peerA"]}
