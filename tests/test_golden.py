"""Golden numbers for the merge math: small seeded cases whose outputs are checked in (tests/fixtures/golden.pt).

A change to the outer step, the rebase, the dense slice guard or the sparse screens shows up here as a difference,
compared bit for bit (torch.equal), not approximately. The cases run through the learner, the slice guard and the
sparse exchange's reduction as the peers call them; the round is replayed on `outer_round` alone too.

Regenerate the fixture only for a change of the math that is meant: `python tests/test_golden.py --write`.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from p2pdiloco.algorithm.guards import NONFINITE, SHAPE, GuardBook
from p2pdiloco.algorithm.outer import eager_step, outer_round
from p2pdiloco.config import GuardConfig, load_config, parse_set
from p2pdiloco.network.allreduce import group_slice
from p2pdiloco.network.group import Group
from p2pdiloco.network.merger import Alone, Contribution, Merged, MergeOutcome, MergeStats
from p2pdiloco.network.rpc import MergeFailed
from p2pdiloco.network.slice_guard import SliceGuard
from p2pdiloco.network.sparse_exchange import reduce_parts
from p2pdiloco.testing.inmemory import InMemoryMerger
from p2pdiloco.training.flat import load_flat_
from p2pdiloco.training.learner import Learner
from p2pdiloco.training.reporting import MetricsLog

GOLDEN = Path(__file__).parent / "fixtures" / "golden.pt"
N = 16  # values of the toy model (a 3 -> 4 linear layer)


def _learner(tmp: Path, **sets: str) -> Learner:
    items = ["rounds.round_steps=5", "run.total_steps=20", *(f"{k}={v}" for k, v in sets.items())]
    cfg = load_config(None, [parse_set(items)])
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4)
    metrics = MetricsLog(tmp / "p0.jsonl")
    return Learner(cfg, model, lambda: (torch.zeros(1), torch.zeros(1)), [], InMemoryMerger("p0", {"group_size": 1}),
                   torch.device("cpu"), metrics)


def _merged(average: torch.Tensor, state: torch.Tensor | None = None, state_weight: float = 0.0) -> Merged:
    return Merged(average=average, weight=2.0, agreed_state=state, state_weight=state_weight,
                  stats=MergeStats(group=["p0", "p1"]))


def _alone(learner: Learner, own: torch.Tensor) -> tuple[Alone, Contribution]:
    """A merge alone, and the contribution it steps on (this peer's own Δ, weight 1)."""
    c = Contribution(pseudo_grad=own, weight=1.0, global_params=learner.g.params, momentum=learner.g.momentum,
                     state_digest=learner.g.digest(), state_weight=learner.c.global_tokens)
    return Alone(), c


def _land(learner: Learner, outcome: MergeOutcome, at_submit: torch.Tensor | None, moved: torch.Tensor,
          contribution: Contribution | None = None) -> dict:
    """Move the local model by `moved` (steps taken while the merge is in flight), land `outcome`, and record."""
    load_flat_(learner.model, (learner._local_params() if at_submit is None else at_submit) + moved)
    learner.c.compute_in_round = 0.8
    landed = learner.apply_merge(outcome, at_submit, contribution)
    return {"global": learner.g.params.clone(), "momentum": learner.g.momentum.clone(),
            "local": learner._local_params(), "global_tokens": float(learner.c.global_tokens),
            "refused": landed.state_refused, "state_kept": landed.adopted_state,
            "rebase_dropped_s": float(learner.c.rebase_dropped_s)}


def _eager(learner: Learner, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """End a round at a seeded local model: (own Δ, θ_at_submit after the eager step, the noise of the next steps)."""
    local_end = learner.g.params + 0.05 * torch.randn(N, generator=g)
    own = learner.g.params - local_end
    return own, learner._eager(own), 0.01 * torch.randn(N, generator=g)


def round_cases() -> dict:
    """A whole decoupled round and its variants, on one learner in sequence (its recent steps carry over)."""
    g = torch.Generator().manual_seed(1)
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        learner = _learner(Path(tmp), **{"outer.alone_lr": "0.4", "outer.rebase_keep": "0.3"})
        learner.g.adopt(torch.randn(N, generator=g), 0.1 * torch.randn(N, generator=g))
        learner.c.global_tokens = 100.0

        own, at_submit, moved = _eager(learner, g)
        out["eager"] = at_submit.clone()
        merged = (own + 0.03 * torch.randn(N, generator=g)) / 2
        out["group"] = _land(learner, _merged(merged), at_submit, moved)

        own, at_submit, moved = _eager(learner, g)
        n = 2 * N
        state = torch.cat([learner.g.params, learner.g.momentum]) + 0.01 * torch.randn(n, generator=g)
        result = _merged(own * 0.9, state, 150.0)
        out["agreed"] = _land(learner, result, at_submit, moved)

        own, at_submit, moved = _eager(learner, g)
        far = torch.cat([-10 * learner.g.params, learner.g.momentum])
        result = _merged(own * 1.1, far, 900.0)
        out["refused"] = _land(learner, result, at_submit, moved)

        own, at_submit, moved = _eager(learner, g)
        alone, contribution = _alone(learner, own)
        out["alone"] = _land(learner, alone, at_submit, moved, contribution)

        own, _, moved = _eager(learner, g)
        out["no_submit"] = _land(learner, _merged(own), None, moved)

        learner.c.global_tokens = 0.0  # a fresh peer adopts the group's state however far
        own, at_submit, moved = _eager(learner, g)
        far = torch.cat([-3 * learner.g.params, 2 * learner.g.momentum])
        result = _merged(own, far, 7.0)
        out["fresh"] = _land(learner, result, at_submit, moved)
    return out


def pure_round_cases() -> dict:
    """`round_cases` replayed on `outer.outer_round` and `outer.eager_step` alone, with no learner: the same seeded
    inputs in the same order, the state carried by hand. Checked against the fixture the learner wrote."""
    g = torch.Generator().manual_seed(1)
    cfg = load_config(None, [parse_set(["outer.alone_lr=0.4", "outer.rebase_keep=0.3"])]).outer
    params, momentum = torch.randn(N, generator=g), 0.1 * torch.randn(N, generator=g)
    local, steps, out = params, [], {}

    def eager() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        own = params - (params + 0.05 * torch.randn(N, generator=g))
        return own, eager_step(params, momentum, own, cfg), 0.01 * torch.randn(N, generator=g)

    def land(delta, at_submit, moved, **kw) -> dict:
        nonlocal params, momentum, local
        now = (local if at_submit is None else at_submit) + moved
        done = outer_round(params, momentum, delta, cfg, local_now=now, local_at_submit=at_submit,
                           longest_recent=max(steps[-16:], default=0.0), **kw)
        params, momentum, local = done.params, done.momentum, done.local
        steps.append(done.step)
        return {"global": params, "momentum": momentum, "local": local, "refused": not done.adopted,
                "state_kept": kw.get("agreed_state") is not None and done.adopted}

    own, at_submit, moved = eager()
    out["eager"] = at_submit
    out["group"] = land((own + 0.03 * torch.randn(N, generator=g)) / 2, at_submit, moved)
    own, at_submit, moved = eager()
    state = torch.cat([params, momentum]) + 0.01 * torch.randn(2 * N, generator=g)
    out["agreed"] = land(own * 0.9, at_submit, moved, agreed_state=state, own_weight=100.0)
    own, at_submit, moved = eager()
    out["refused"] = land(own * 1.1, at_submit, moved, agreed_state=torch.cat([-10 * params, momentum]),
                          own_weight=100.0)
    own, at_submit, moved = eager()
    out["alone"] = land(own, at_submit, moved, alone=True)
    own, _, moved = eager()
    out["no_submit"] = land(own, None, moved)
    own, at_submit, moved = eager()
    out["fresh"] = land(own, at_submit, moved, agreed_state=torch.cat([-3 * params, 2 * momentum]), own_weight=0.0)
    return out


def _book_state(book: GuardBook) -> dict:
    return {"rejected": dict(book.rejected), "trust": dict(book.trust), "strikes": dict(book.strikes),
            "banned": sorted(book.banned)}


REFERENCES: dict[str, torch.Tensor | None] = {}
"""The outer momentum each test group's owner judges trust by, by group id (a merge session holds it)."""


def _slice(guard: GuardConfig, book: GuardBook, group: Group, tag: str, me: int, parts, weights, flags) -> dict:
    try:
        average, shares = SliceGuard(guard, book).reduce(group, tag, me, parts, weights, flags,
                                                         REFERENCES.get(group.group_id))
    except MergeFailed as e:
        return {"failed": str(e), "book": _book_state(book)}
    return {"average": average, "shares": shares, "book": _book_state(book)}


def slice_cases() -> dict:
    """The dense slice guard (an owner's slice of every member's part): accepted, norm-rejected, non-finite and
    flagged, direction, low-trust (twice, so the book's history counts), state tags 's'/'a', all rejected."""
    g = torch.Generator().manual_seed(2)
    members = [f"peer{i}" for i in range(5)]
    length = 40
    momentum = torch.randn(length, generator=g)

    def group(gid: str, reference=momentum, n=5) -> Group:
        REFERENCES[gid] = reference
        return Group(gid, members[:n], [1.0] * n, [1.0] * n, False, {"d": length, "s": 2 * length, "a": 2 * length})

    def honest(lo: int, hi: int, n: int = 5) -> list[torch.Tensor]:
        return [momentum[lo:hi] + 0.3 * torch.randn(hi - lo, generator=g) for _ in range(n)]

    out: dict = {}
    for rule in ("centered_clip", "mean", "trimmed_mean"):
        guard, book, grp = GuardConfig(aggregate=rule), GuardBook(), group(f"g-{rule}")
        lo, hi = group_slice(grp, "d", 1)
        out[f"accepted_{rule}"] = _slice(guard, book, grp, "d", 1, honest(lo, hi), [1.0, 2.0, 3.0, 1.0, 0.5], {})
    guard = GuardConfig()
    book, grp = GuardBook(), group("g-norm")
    lo, hi = group_slice(grp, "d", 0)
    parts = honest(lo, hi)
    parts[3] = parts[3] * 100
    out["norm"] = _slice(guard, book, grp, "d", 0, parts, [1.0] * 5, {})
    book, grp = GuardBook(), group("g-nonfinite")
    lo, hi = group_slice(grp, "d", 2)
    parts = honest(lo, hi)
    parts[1] = torch.full((hi - lo,), float("nan"))
    out["nonfinite"] = _slice(guard, book, grp, "d", 2, parts, [1.0] * 5, {1: NONFINITE, 4: SHAPE})
    book, grp = GuardBook(), group("g-direction")
    lo, hi = group_slice(grp, "d", 0)
    parts = honest(lo, hi)
    parts[2] = -parts[2]
    out["direction"] = _slice(GuardConfig(min_cosine=0.0), book, grp, "d", 0, parts, [1.0] * 5, {})
    book = GuardBook()
    for k in range(2):
        grp = group(f"g-trust{k}")
        lo, hi = group_slice(grp, "d", 0)
        parts = honest(lo, hi)
        parts[3], parts[4] = -parts[3], 0.5 * torch.randn(hi - lo, generator=g)
        out[f"trust{k}"] = _slice(guard, book, grp, "d", 0, parts, [1.0, 1.0, 2.0, 1.0, 1.0], {})
    grp = group("g-owner-flipped")
    lo, hi = group_slice(grp, "d", 3)
    parts = honest(lo, hi)
    parts[3] = -parts[3]
    out["trust_owner"] = _slice(guard, book, grp, "d", 3, parts, [1.0] * 5, {})
    book, grp = GuardBook(), group("g-noref", reference=None)
    lo, hi = group_slice(grp, "d", 0)
    parts = honest(lo, hi)
    parts[3] = -parts[3]
    out["no_reference"] = _slice(guard, book, grp, "d", 0, parts, [1.0] * 5, {})
    out["trust_off"] = _slice(GuardConfig(trust_decay=-1), GuardBook(), group("g-off"), "d", 0, parts, [1.0] * 5, {})
    book, grp = GuardBook(), group("g-state")
    lo, hi = group_slice(grp, "s", 0)
    parts = [torch.randn(hi - lo, generator=g) * 0.01 + 1.0 for _ in range(5)]
    parts[2] = -50 * parts[2]
    out["state_far"] = _slice(guard, book, grp, "s", 0, parts, [0.0, 3.0, 1.0, 2.0, 0.0], {})
    out["state_fresh_minority"] = _slice(guard, GuardBook(), group("g-state2"), "s", 0, parts,
                                         [0.0, 0.0, 1.0, 2.0, 0.0], {})
    grp = group("g-anchor", n=4)
    lo, hi = group_slice(grp, "a", 1)
    base = torch.randn(hi - lo, generator=g)
    parts = [torch.zeros(hi - lo), base, base.clone(), torch.zeros(hi - lo)]
    out["anchor_tie"] = _slice(guard, GuardBook(), grp, "a", 1, parts, [1.0, 1.0, 1.0, 1.0], {})
    grp = group("g-pair", n=2)
    lo, hi = group_slice(grp, "d", 0)
    out["pair"] = _slice(guard, GuardBook(), grp, "d", 0, honest(lo, hi, 2), [1.0, 3.0], {})
    grp = group("g-none", n=3)
    lo, hi = group_slice(grp, "d", 0)
    nan = torch.full((hi - lo,), float("nan"))
    out["all_rejected"] = _slice(guard, GuardBook(), grp, "d", 0, [nan, nan, nan], [1.0] * 3, {})
    return out


def _sparse(parts, flags, weights, guard, reference=None, forked=False) -> dict:
    try:
        average, reasons, shares = reduce_parts(parts, flags, weights, guard, reference, forked)
    except MergeFailed as e:
        return {"failed": str(e)}
    return {"average": average, "reasons": reasons, "shares": shares}


def sparse_cases() -> dict:
    """The sparse screens on all-gathered parts: accepted, norm, non-finite and shape flags, low trust against the
    momentum, support among the parts (forked, or nothing scored), a momentum a majority points against, the
    chance floor, no guards, all rejected."""
    g = torch.Generator().manual_seed(3)
    n = 200
    momentum = torch.randn(n, generator=g)

    def sparse_like(direction: torch.Tensor, k: int = 40) -> torch.Tensor:
        v = direction + 0.5 * torch.randn(n, generator=g)
        keep = torch.zeros(n)
        keep[torch.randperm(n, generator=g)[:k]] = 1
        return v * keep

    honest = [sparse_like(momentum) for _ in range(5)]
    guard, w = GuardConfig(), [1.0, 2.0, 1.0, 3.0, 1.0]
    out: dict = {"accepted": _sparse(honest, [""] * 5, w, guard, momentum)}
    parts = list(honest)
    parts[2] = parts[2] * 50
    out["norm"] = _sparse(parts, [""] * 5, w, guard, momentum)
    parts = list(honest)
    parts[0] = torch.full((n,), float("nan"))
    out["flags"] = _sparse(parts, [NONFINITE, "", "", SHAPE, ""], w, guard, momentum)
    parts = list(honest)
    parts[1], parts[4] = -parts[1], sparse_like(torch.zeros(n))
    out["trust"] = _sparse(parts, [""] * 5, w, guard, momentum)
    out["trust_forked"] = _sparse(parts, [""] * 5, w, guard, momentum, forked=True)
    out["trust_no_momentum"] = _sparse(parts, [""] * 5, w, guard, None)
    out["trust_zero_momentum"] = _sparse(parts, [""] * 5, w, guard, torch.zeros(n))
    out["trust_off"] = _sparse(parts, [""] * 5, w, GuardConfig(trust_decay=-1), momentum)
    out["momentum_against"] = _sparse(honest, [""] * 5, w, guard, -momentum)
    # barely correlated: the median cosine is below chance (1/√n), so only parts pointing against it are left out
    weak = momentum + 8 * torch.randn(n, generator=torch.Generator().manual_seed(7))
    out["chance"] = _sparse(parts, [""] * 5, w, guard, weak)
    out["no_guard"] = _sparse(honest, [""] * 5, w, None)
    out["no_guard_flagged"] = _sparse(honest, ["", NONFINITE, "", "", ""], w, None)
    nan = torch.full((n,), float("nan"))
    out["all_rejected"] = _sparse([nan, nan], [NONFINITE, NONFINITE], [1.0, 1.0], guard, momentum)
    out["pair"] = _sparse(honest[:2], ["", ""], [1.0, 0.0], guard, momentum)
    return out


def golden() -> dict:
    return {"round": round_cases(), "slice": slice_cases(), "sparse": sparse_cases()}


def _assert_same(got, want, path: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want), path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (path, set(got) ^ set(want))
        for k in want:
            _assert_same(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _assert_same(a, b, f"{path}[{i}]")
    else:
        assert got == want and type(got) is type(want), (path, got, want)


def test_round_matches_golden():
    _assert_same(round_cases(), torch.load(GOLDEN)["round"], "round")


def test_outer_round_alone_replays_the_golden_round():
    want = torch.load(GOLDEN)["round"]
    got = pure_round_cases()
    _assert_same(got["eager"], want["eager"], "round/eager")
    for case, values in got.items():
        if case != "eager":
            _assert_same(values, {k: want[case][k] for k in values}, f"round/{case}")


def test_slice_guard_matches_golden():
    _assert_same(slice_cases(), torch.load(GOLDEN)["slice"], "slice")


def test_sparse_screens_match_golden():
    _assert_same(sparse_cases(), torch.load(GOLDEN)["sparse"], "sparse")


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    GOLDEN.parent.mkdir(exist_ok=True)
    torch.save(golden(), GOLDEN)
    print(f"wrote {GOLDEN}")
