"""The trust screen: a slice owner weighs members' pseudo-gradient parts by how they have agreed with its outer
momentum over merges (pure math, and the owner's reduce with a fake group; no network)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from p2pdiloco.algorithm.guards import TRUST, GuardBook, cosines_to, trust_factors
from p2pdiloco.algorithm.outer import weighted_average
from p2pdiloco.config import ConfigError, GuardConfig
from p2pdiloco.network.allreduce import group_slice, owned_slice
from p2pdiloco.network.group import Group
from p2pdiloco.network.slice_guard import SliceGuard
from p2pdiloco.testing.hostile import corrupt

T = torch.tensor
MEMBERS = ["peerA", "peerB", "peerC", "peerD", "peerE"]


def test_cosines_golden():
    ref = T([1.0, 0.0])
    assert cosines_to([T([2.0, 0.0]), T([0.0, 3.0]), T([-1.0, -1.0]), T([0.0, 0.0])], ref) == pytest.approx(
        [1.0, 0.0, -math.sqrt(0.5), None])
    assert cosines_to([T([1.0, 1.0])], T([0.0, 0.0])) == [None]  # a zero reference: nothing to judge by


def test_trust_factors_golden():
    # upper median of (-0.2, 0, 0.1, 0.2, 0.3) is 0.1: members at 0.05 or more count fully, below it pro rata;
    # None (no score yet) counts fully and is not part of the median
    assert trust_factors([0.3, 0.2, 0.1, -0.2, 0.0], 10_000) == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert trust_factors([0.3, 0.025, 0.1, None], 10_000) == pytest.approx([1.0, 0.5, 1.0, 1.0])
    # a median below the cosine of noise (1/sqrt(100) = 0.1) is no scale: the noise level is
    assert trust_factors([0.02, 0.05, 0.2], 100) == pytest.approx([0.2, 0.5, 1.0])
    assert trust_factors([None, None], 100) == [1.0, 1.0]
    # a majority against the reference: the reference is what is wrong, and no part is judged by it
    assert trust_factors([0.3, 0.2, -0.1, -0.2, -0.3], 10_000) == [1.0] * 5


def test_trust_is_a_moving_average_of_cosines_from_the_first_seen():
    book = GuardBook()
    assert book.observe("a", 0.5, 0.7) == 0.5
    assert book.observe("a", -0.5, 0.7) == pytest.approx(0.7 * 0.5 - 0.3 * 0.5)
    assert book.observe("b", -0.1, 0.0) == -0.1


def test_trust_saved_in_a_checkpoint_comes_back_and_garbage_does_not(tmp_path):
    """A restarted peer remembers what its guards learned of the others (else every member is a stranger again
    after a restart, and a first part pointing away from the momentum is left out for a dozen rounds)."""
    from p2pdiloco.config import load_config
    from p2pdiloco.training.checkpoint import GlobalState, learner_checkpoint, load_latest, save_checkpoint

    book = GuardBook()
    book.observe("a", 0.25, 0.9)
    book.observe("b", -0.5, 0.9)
    model = torch.nn.Linear(2, 2)
    state = GlobalState(torch.zeros(6), torch.zeros(6), 3, 30, 100.0)
    tensors, meta = learner_checkpoint(state, 10, torch.optim.AdamW(model.parameters()), list(model.parameters()),
                                       load_config().to_dict(), extra={"guard_trust": dict(book.trust)})
    save_checkpoint(tmp_path, state.round, tensors, meta)
    _, meta, _ = load_latest(tmp_path)
    assert meta["round"] == 3  # the learner's own keys are not overwritten by the extra ones
    restarted = GuardBook()
    restarted.remember(meta["guard_trust"])
    assert restarted.trust == {"a": 0.25, "b": -0.5}
    restarted.remember({"c": float("nan"), "d": 7.0, 5: 0.1, "e": "0.3", "f": True, "g": 0.5})
    assert restarted.trust == {"a": 0.25, "b": -0.5, "g": 0.5}
    restarted.remember(["a", 1.0])  # not a table: nothing taken
    assert restarted.trust == {"a": 0.25, "b": -0.5, "g": 0.5}


def test_trust_decay_is_checked():
    assert GuardConfig().trust_decay == 0.9
    GuardConfig(trust_decay=-1)
    with pytest.raises(ConfigError):
        GuardConfig(trust_decay=1.0)


def _group(n_values: int, gid: str = "g1", members: list[str] = MEMBERS) -> Group:
    return Group(gid, list(members), [1.0] * len(members), [1.0] * len(members), False,
                 {"d": n_values, "s": 2 * n_values})


def _swarm(dim: int = 5 * 800, seed: int = 0, n: int = 5) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A momentum and n honest pseudo-gradients that share its direction only weakly (cosine ~0.2), as late in a
    run."""
    g = torch.Generator().manual_seed(seed)
    momentum = torch.randn(dim, generator=g)
    return momentum, [0.2 * momentum + torch.randn(dim, generator=g) for _ in range(n)]


def _slice(x: torch.Tensor, gid: str = "g1", me: int = 0, n: int = 5) -> torch.Tensor:
    """Member `me`'s slice of `x` in a group of n with id `gid` (ownership rotates with the group id)."""
    lo, hi = group_slice(_group(x.numel(), gid, MEMBERS[:n]), "d", me)
    return x[lo:hi].clone()


@pytest.mark.parametrize("kind", ["signflip", "noise"])
def test_flipped_and_noise_parts_count_nothing_honest_ones_fully(kind):
    momentum, deltas = _swarm(dim=5 * 20_000)  # noise's cosine ~1/sqrt(20,000), a bench slice's
    gen = torch.Generator().manual_seed(3)
    deltas[1], deltas[3] = corrupt(deltas[1], kind, gen), corrupt(deltas[3], kind, gen)
    book = GuardBook(ban_after=3)
    parts = [_slice(d) for d in deltas]
    avg, shares = SliceGuard(GuardConfig(), book).reduce(_group(100_000), "d", 0, parts, [1.0] * 5, {}, momentum)
    honest = [0, 2, 4]
    if kind == "signflip":  # rejected outright, without a strike: a ban is for ever
        assert book.rejected[TRUST] == 2 and not any(book.strikes.values()) and not book.banned
        assert [s > 0 for s in shares] == [True, False, True, False, True]
    assert sum(shares[i] for i in honest) == pytest.approx(1.0, abs=0.05)
    # 2 of 5 parts corrupted move the result far less from the honest mean than they move the plain mean
    target = weighted_average([parts[i] for i in honest], [1.0] * 3)
    plain = weighted_average(parts, [1.0] * 5)
    assert float((avg - target).norm()) < 0.25 * float((plain - target).norm())


def test_honest_parts_all_kept_and_the_bits_are_the_same_on_every_run():
    momentum, deltas = _swarm(seed=1)
    parts = [_slice(d, me=2) for d in deltas]
    results = []
    for _ in range(2):
        book = GuardBook()
        avg, shares = SliceGuard(GuardConfig(), book).reduce(_group(4000), "d", 2, parts, [1.0] * 5, {}, momentum)
        assert not book.rejected and shares == pytest.approx([0.2] * 5)
        results.append(avg)
    assert torch.equal(results[0], results[1])


def test_trust_is_earned_over_merges_and_over_slices():
    """A member that points against the momentum on one slice, or in one merge, keeps counting on its record over
    the whole vector (ownership rotates); a member that always does is left out from its first merge on."""
    book, guard = GuardBook(), GuardConfig()
    momentum, _ = _swarm(seed=2)
    for merge in range(10):
        gid = f"g{merge}"
        g = torch.Generator().manual_seed(10 + merge)
        deltas = [0.2 * momentum + torch.randn(4000, generator=g) for _ in range(5)]
        deltas[1] = -deltas[1]  # always flipped
        lo, hi = group_slice(_group(4000, gid), "d", 0)
        if lo == 0:
            deltas[4][lo:hi] = -deltas[4][lo:hi]  # an honest peer whose data pull the first slice the other way
        if merge == 6:
            deltas[3] = -deltas[3]  # an honest peer's odd round
        parts = [_slice(d, gid) for d in deltas]
        _, shares = SliceGuard(guard, book).reduce(_group(4000, gid), "d", 0, parts, [1.0] * 5, {}, momentum)
        assert shares[1] == 0.0
        assert shares[3] > 0.0 and shares[4] > 0.0, f"merge {merge}"
    assert book.trust["peerB"] < 0 < min(book.trust["peerD"], book.trust["peerE"])
    assert not book.banned


def test_no_momentum_and_the_agreement_phase_are_not_judged_by_trust():
    momentum, deltas = _swarm(seed=4)
    deltas[1] = -deltas[1]
    parts = [_slice(d) for d in deltas]
    for guard, n, reference, tag in [(GuardConfig(), 4000, torch.zeros(4000), "d"), (GuardConfig(), 4000, None, "d"),
                                     (GuardConfig(), 2000, momentum, "s"), (GuardConfig(trust_decay=-1), 4000, momentum, "d")]:
        book = GuardBook()
        SliceGuard(guard, book).reduce(_group(n), tag, 0, parts, [1.0] * 5, {}, reference)
        assert not book.rejected


def test_a_pair_is_judged_by_the_momentum_too():
    """Two members cannot outvote each other, but the owner's momentum is a third opinion that neither chose."""
    momentum, deltas = _swarm(seed=5, n=2)
    for flipped, expected in [(False, [0.5, 0.5]), (True, [1.0, 0.0])]:
        parts = [_slice(d, "g", n=2) for d in (deltas[0], -deltas[1] if flipped else deltas[1])]
        book = GuardBook()
        avg, shares = SliceGuard(GuardConfig(), book).reduce(_group(4000, "g", MEMBERS[:2]), "d", 0,
                                                             parts, [1.0, 1.0], {}, momentum)
        assert shares == expected and book.rejected[TRUST] == int(flipped)
        if flipped:
            assert_close(avg, parts[0])


def test_slice_ownership_rotates_with_the_group_id_and_covers_every_slice():
    for gid in ("a", "b", "c", "0f3e9"):
        assert sorted(owned_slice(gid, j, 5) for j in range(5)) == list(range(5))
    assert len({owned_slice(f"g{i}", 0, 5) for i in range(40)}) == 5
    assert owned_slice("g1", 3, 5) == owned_slice("g1", 3, 5)


def test_an_owner_counts_its_own_part_whatever_its_cosine_and_judges_the_others():
    """Its own part is the one an honest owner has no reason to doubt: early in a run, with a momentum of one or two
    merges, an owner's own honest part pointed against it and the owner left itself out."""
    momentum, deltas = _swarm(seed=6)
    deltas[0], deltas[1] = -deltas[0], -deltas[1]  # the owner's own part and member 1's point against the momentum
    parts = [_slice(d) for d in deltas]
    book = GuardBook()
    _, shares = SliceGuard(GuardConfig(), book).reduce(_group(4000), "d", 0, parts, [1.0] * 5, {}, momentum)
    assert shares[0] > 0 and shares[1] == 0.0 and book.rejected[TRUST] == 1
