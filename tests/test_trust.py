"""The trust screen: members' pseudo-gradient parts judged against the owner's outer momentum (pure math, and
the slice owner's reduce with a fake group; no network)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from p2pdiloco.algorithm.guards import TRUST, GuardBook, momentum_cosines, trust_factors
from p2pdiloco.algorithm.outer import weighted_average
from p2pdiloco.config import ConfigError, GuardConfig
from p2pdiloco.network.matchmaking import Group
from p2pdiloco.network.slice_guard import SliceGuard
from p2pdiloco.testing.hostile import corrupt

T = torch.tensor
MEMBERS = ["peerA", "peerB", "peerC", "peerD", "peerE"]


def test_momentum_cosines_golden():
    ref = T([1.0, 0.0])
    assert momentum_cosines([T([2.0, 0.0]), T([0.0, 3.0]), T([-1.0, -1.0]), T([0.0, 0.0])], ref) == pytest.approx(
        [1.0, 0.0, -math.sqrt(0.5), None])
    assert momentum_cosines([T([1.0, 1.0])], T([0.0, 0.0])) == [None]  # no momentum yet: nothing to judge by


def test_trust_factors_golden():
    # upper median of (-0.2, 0, 0.1, 0.2, 0.3) is 0.1: members at 0.05 or more count fully, below it pro rata
    assert trust_factors([0.3, 0.2, 0.1, -0.2, 0.0], 10_000) == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert trust_factors([0.3, 0.025, 0.1, None], 10_000) == pytest.approx([1.0, 0.5, 1.0, 1.0])
    # a median below the cosine of noise (1/sqrt(100) = 0.1) is no scale: the noise level is
    assert trust_factors([0.02, 0.05, 0.2], 100) == pytest.approx([0.2, 0.5, 1.0])
    assert trust_factors([None, None], 100) == [1.0, 1.0]


def test_trust_is_a_moving_average_of_cosines_from_the_first_seen():
    book = GuardBook()
    assert book.observe("a", 0.5, 0.7) == 0.5
    assert book.observe("a", -0.5, 0.7) == pytest.approx(0.7 * 0.5 - 0.3 * 0.5)
    assert book.observe("b", -0.1, 0.0) == -0.1


def test_trust_decay_is_checked():
    assert GuardConfig().trust_decay == 0.7
    GuardConfig(trust_decay=-1)
    with pytest.raises(ConfigError):
        GuardConfig(trust_decay=1.0)


def _group(n_values: int, reference: torch.Tensor | None, gid: str = "g1") -> Group:
    group = Group(gid, list(MEMBERS), [1.0] * 5, [1.0] * 5, False, {"d": n_values, "s": 2 * n_values})
    group.reference = reference
    return group


def _swarm(dim: int = 5 * 800, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A momentum and five honest pseudo-gradients that share its direction only weakly (cosine ~0.2), as late in
    a run."""
    g = torch.Generator().manual_seed(seed)
    momentum = torch.randn(dim, generator=g)
    return momentum, [0.2 * momentum + torch.randn(dim, generator=g) for _ in range(5)]


def _slice(x: torch.Tensor, me: int = 0) -> torch.Tensor:
    return torch.tensor_split(x, 5)[me].clone()


@pytest.mark.parametrize("kind", ["signflip", "noise"])
def test_flipped_and_noise_parts_count_nothing_honest_ones_fully(kind):
    momentum, deltas = _swarm(dim=5 * 20_000)  # noise's cosine ~1/sqrt(20,000), a bench slice's
    gen = torch.Generator().manual_seed(3)
    deltas[1], deltas[3] = corrupt(deltas[1], kind, gen), corrupt(deltas[3], kind, gen)
    book = GuardBook(ban_after=3)
    parts = [_slice(d) for d in deltas]
    avg, shares = SliceGuard(GuardConfig(), book).reduce(_group(100_000, momentum), "d", 0, parts, [1.0] * 5, {})
    honest = [0, 2, 4]
    if kind == "signflip":  # rejected outright, without a strike: a ban is for ever
        assert book.rejected[TRUST] == 2 and not any(book.strikes.values()) and not book.banned
        assert [s > 0 for s in shares] == [True, False, True, False, True]
    assert sum(shares[i] for i in honest) == pytest.approx(1.0, abs=0.05)
    # 2 of 5 parts corrupted move the result no further from the honest mean than an honest part's share of noise
    target = weighted_average([parts[i] for i in honest], [1.0] * 3)
    plain = weighted_average(parts, [1.0] * 5)
    assert float((avg - target).norm()) < 0.25 * float((plain - target).norm())


def test_honest_parts_all_kept_and_the_bits_are_the_same_on_every_run():
    momentum, deltas = _swarm(seed=1)
    parts = [_slice(d, 2) for d in deltas]
    results = []
    for _ in range(2):
        book = GuardBook()
        avg, shares = SliceGuard(GuardConfig(), book).reduce(_group(4000, momentum), "d", 2, parts, [1.0] * 5, {})
        assert not book.rejected and shares == pytest.approx([0.2] * 5)
        results.append(avg)
    assert torch.equal(results[0], results[1])


def test_trust_is_earned_over_merges():
    """An honest member that points against the momentum in one merge keeps counting on its history; a member that
    always does is left out from its first merge on."""
    book, guard = GuardBook(), GuardConfig()
    momentum, _ = _swarm(seed=2)
    for merge in range(6):
        g = torch.Generator().manual_seed(10 + merge)
        deltas = [0.2 * momentum + torch.randn(4000, generator=g) for _ in range(5)]
        deltas[0] = -deltas[0]  # always flipped
        if merge == 4:
            deltas[4] = -deltas[4]  # an honest peer's odd round
        parts = [_slice(d) for d in deltas]
        _, shares = SliceGuard(guard, book).reduce(_group(4000, momentum, f"g{merge}"), "d", 0, parts, [1.0] * 5, {})
        assert shares[0] == 0.0
        assert shares[4] > 0.0, f"merge {merge}"
    assert book.trust["peerA"] < 0 < book.trust["peerE"]


def test_no_momentum_and_the_agreement_phase_are_not_judged_by_trust():
    momentum, deltas = _swarm(seed=4)
    deltas[1] = -deltas[1]
    parts = [_slice(d) for d in deltas]
    for group, tag in [(_group(4000, torch.zeros(4000)), "d"), (_group(4000, None), "d"), (_group(2000, momentum), "s")]:
        book = GuardBook()
        _, shares = SliceGuard(GuardConfig(), book).reduce(group, tag, 0, parts, [1.0] * 5, {})
        assert not book.rejected and not book.trust
    book = GuardBook()
    SliceGuard(GuardConfig(trust_decay=-1), book).reduce(_group(4000, momentum), "d", 0, parts, [1.0] * 5, {})
    assert not book.rejected


def test_a_pair_is_judged_by_the_momentum_too():
    """Two members cannot outvote each other, but the owner's momentum is a third opinion that neither chose."""
    momentum, deltas = _swarm(seed=5)
    group = Group("g", MEMBERS[:2], [1.0, 1.0], [1.0, 1.0], False, {"d": 4000, "s": 8000})
    group.reference = momentum
    parts = [torch.tensor_split(d, 2)[0].clone() for d in (deltas[0], -deltas[1])]
    book = GuardBook()
    avg, shares = SliceGuard(GuardConfig(), book).reduce(group, "d", 0, parts, [1.0, 1.0], {})
    assert shares == [1.0, 0.0] and book.rejected[TRUST] == 1
    assert_close(avg, parts[0])
