"""The merge contract, one set of scenarios run against both mergers: the in-memory fake the learner's tests use
(testing/inmemory.py) and the real one (`P2PMerger` on hivemind DHTs, loopback), so that the fake cannot drift
from production.

`Merger.submit` resolves to `Merged(average, weight, agreed_state, state_weight, final, sent)` or `Alone(reason)`:
the average is the weighted mean of what the members sent (`Contribution.compensated`), exact in the fake and within
the codec's error in the real merger; the weight is the members' total, claims capped as a group caps them; members whose global models differ get the
state-weighted average of their (θg, momentum), standing for the lower median of their state weights; `final` reaches
every member; what error feedback counts as sent averages to the merge; nobody else there: `Alone`.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

from p2pdiloco.algorithm.guards import bounded_weights
from p2pdiloco.algorithm.outer import weighted_average
from p2pdiloco.config import GuardConfig
from p2pdiloco.network.merger import Alone, Contribution, Merged
from p2pdiloco.testing.inmemory import InMemoryMerger
from tests.conftest import merge_config, running_mergers

pytestmark = pytest.mark.integration

N = 4001
KINDS = ["inmemory", "p2p"]
_runs = itertools.count()


@contextlib.contextmanager
def _mergers(kind: str, n: int, request: pytest.FixtureRequest):
    """`n` mergers of `kind` that merge with each other (a window of a few seconds: one peer alone merges alone)."""
    if kind == "inmemory":
        hub = {"group_size": n, "window_s": 2.0}
        yield [InMemoryMerger(f"peer{i}", hub) for i in range(n)]
        return
    cfg = merge_config(run_id=f"contract{next(_runs)}", merge_window_s=4, merge_timeout_s=10, sync=True)
    # the contract is the plain weighted mean (the robust rule of the guards is their own business, guards.py)
    guard = GuardConfig(aggregate="mean")
    bootstrap, loop = request.getfixturevalue("bootstrap_dht"), request.getfixturevalue("net_loop")
    with running_mergers(bootstrap, loop, n, cfg, N, guard=guard) as mergers:
        yield mergers


def _offer(delta: torch.Tensor, weight: float, theta: torch.Tensor | None = None, state_weight: float = 1.0,
           digest: str = "same", final: bool = False, residual: torch.Tensor | None = None) -> Contribution:
    theta = torch.zeros(N) if theta is None else theta
    return Contribution(pseudo_grad=delta, weight=weight, global_params=theta, momentum=torch.zeros(N),
                        state_digest=digest, state_weight=state_weight, final=final,
                        compensated=None if residual is None else delta + residual)


def _merge(mergers, offers: list[Contribution]) -> list:
    futures = [m.submit(c) for m, c in zip(mergers, offers, strict=True)]
    return [f.result(timeout=60) for f in futures]


def _tolerance(merger, parts: list[torch.Tensor], weights: list[float], expected: torch.Tensor) -> torch.Tensor:
    """How far the average may be from the exact weighted mean: each part is coded once on the way in, the average
    once on the way out (the fake codes nothing)."""
    codec = getattr(merger, "codec", None)
    if codec is None:
        return torch.full_like(expected, 1e-6)
    total = sum(weights)
    return sum(w / total * codec.error_bound(p) for p, w in zip(parts, weights, strict=True)) \
        + codec.error_bound(expected) + 1e-6


@pytest.mark.parametrize("kind", KINDS)
def test_two_contributions_merge_to_their_weighted_average_and_total_weight(kind, request):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(N, generator=g) * 1e-2
    deltas = [base + 1e-3 * torch.randn(N, generator=g) for _ in range(2)]
    claims = [1.0, 3.0]
    with _mergers(kind, 2, request) as mergers:
        outcomes = _merge(mergers, [_offer(d, w) for d, w in zip(deltas, claims, strict=True)])
    weights = bounded_weights(claims)  # as a group counts claims: 3 is capped at twice the median claim
    assert weights == [1.0, 2.0]
    for o in outcomes:
        assert isinstance(o, Merged), o
        assert o.weight == 3.0 and o.agreed_state is None and o.state_weight == 0.0 and not o.final
        assert torch.equal(o.average, outcomes[0].average)  # every member holds the same bits
        assert sorted(o.stats.group) == sorted(m.peer_id for m in mergers)
    expected = weighted_average(deltas, weights)
    err = (outcomes[0].average - expected).abs()
    assert (err <= _tolerance(mergers[0], deltas, weights, expected)).all(), float(err.max())


@pytest.mark.parametrize("kind", KINDS)
def test_what_is_sent_is_the_compensated_delta_and_averages_to_the_merge(kind, request):
    """A merge sends Δ plus the residual (`Contribution.compensated`), and `Merged.sent` is what each member's error
    feedback counts as sent: the members' sent vectors average to the merge (the codec's rounding of the average
    is charged to each slice's owner, `codecs.as_held`)."""
    g = torch.Generator().manual_seed(2)
    deltas = [torch.randn(N, generator=g) * 1e-2 for _ in range(2)]
    residuals = [torch.randn(N, generator=g) * 1e-3 for _ in range(2)]
    with _mergers(kind, 2, request) as mergers:
        outcomes = _merge(mergers, [_offer(d, 2.0, residual=r) for d, r in zip(deltas, residuals, strict=True)])
    targets = [d + r for d, r in zip(deltas, residuals, strict=True)]
    expected = weighted_average(targets, [2.0, 2.0])
    assert all(isinstance(o, Merged) for o in outcomes), outcomes
    assert (outcomes[0].average - expected).abs().max() <= _tolerance(mergers[0], targets, [2.0, 2.0], expected).max()
    sent = [o.sent for o in outcomes]
    torch.testing.assert_close((sent[0] + sent[1]) / 2, outcomes[0].average, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_differing_global_models_agree_on_their_weighted_average_standing_for_the_lower_median(kind, request):
    g = torch.Generator().manual_seed(3)
    base = torch.randn(N, generator=g)
    thetas = [base + 0.01 * torch.randn(N, generator=g) for _ in range(3)]
    state_weights = [1.0, 5.0, 9.0]
    delta = torch.full((N,), 1e-3)
    offers = [_offer(delta, 1.0, t, sw, digest=f"model-{i}")
              for i, (t, sw) in enumerate(zip(thetas, state_weights, strict=True))]
    with _mergers(kind, 3, request) as mergers:
        outcomes = _merge(mergers, offers)
    expected = weighted_average([torch.cat([t, torch.zeros(N)]) for t in thetas], state_weights)
    for o in outcomes:
        assert isinstance(o, Merged) and o.agreed_state is not None, o
        assert o.state_weight == 5.0  # the lower median of the claims: no member's claim inflates everyone's
        assert torch.equal(o.agreed_state, outcomes[0].agreed_state)
        torch.testing.assert_close(o.agreed_state, expected, rtol=0, atol=1e-3)  # int8 differences in the real one
    shares = sorted(o.stats.state_share for o in outcomes)
    assert shares == pytest.approx([w / 15.0 for w in state_weights], abs=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_a_members_final_reaches_every_member(kind, request):
    deltas = [torch.full((N,), 1e-3), torch.full((N,), 3e-3)]
    with _mergers(kind, 2, request) as mergers:
        outcomes = _merge(mergers, [_offer(deltas[0], 1.0, final=True), _offer(deltas[1], 1.0)])
    assert all(isinstance(o, Merged) and o.final for o in outcomes), outcomes


@pytest.mark.parametrize("kind", KINDS)
def test_nobody_else_there_is_alone(kind, request):
    with _mergers(kind, 2, request) as mergers:
        outcome = mergers[0].submit(_offer(torch.full((N,), 1e-3), 1.0)).result(timeout=60)  # its mate never submits
    assert isinstance(outcome, Alone) and outcome.reason == "", outcome
    assert outcome.stats.group == [mergers[0].peer_id]
