"""A merge's timeline (`MergeStats.marks`): the steps it passed, in order, so that a link's round trip can be read
off each of them (docs/architecture.md, Round trips)."""

from __future__ import annotations

import torch

from p2pdiloco.network.merger import Contribution, Merged
from tests.conftest import merge_config, running_mergers

N = 1000


def _offer(seed: int, digest: str = "same") -> Contribution:
    g = torch.Generator().manual_seed(seed)
    return Contribution(pseudo_grad=1e-2 * torch.randn(N, generator=g), weight=1.0, global_params=torch.zeros(N),
                        momentum=torch.zeros(N), state_digest=digest, state_weight=1.0)


def test_a_merges_timeline_names_every_step_in_order_for_its_leader_and_its_members(bootstrap_dht, net_loop):
    cfg = merge_config(run_id="marks", merge_window_s=4, merge_timeout_s=10, sync=True)
    with running_mergers(bootstrap_dht, net_loop, 3, cfg, N) as mergers:
        # differing global models: the merge agrees on them too, so its timeline has both phases
        futures = [m.submit(_offer(i, digest=f"model-{i}")) for i, m in enumerate(mergers)]
        outcomes = [f.result(timeout=60) for f in futures]
    assert all(isinstance(o, Merged) for o in outcomes), outcomes
    leaders = [o for o in outcomes if "invited" in o.stats.marks]
    assert len(leaders) == 1  # only the leader waits for answers to invites
    for o in outcomes:
        marks = o.stats.marks
        steps = ["census", "ready", "invited", "grouped"] if o is leaders[0] else ["census", "ready", "grouped"]
        assert [s for s in marks if s not in ("exchanged", "agreed")] == steps, marks  # in the order passed
        assert {"exchanged", "agreed"} <= set(marks), marks  # "agreed" only where there was an agreement
        times = list(marks.values())
        assert times == sorted(times) and 0 <= times[0] and times[-1] <= o.stats.duration_s, marks
        assert marks["grouped"] <= o.stats.match_s + 1e-3 < marks["exchanged"], (marks, o.stats.match_s)


def test_without_an_agreement_the_timeline_has_no_agreed_step(bootstrap_dht, net_loop):
    cfg = merge_config(run_id="marks-same", merge_window_s=4, merge_timeout_s=10, sync=True)
    with running_mergers(bootstrap_dht, net_loop, 2, cfg, N) as mergers:
        outcomes = [f.result(timeout=60) for f in [m.submit(_offer(i)) for i, m in enumerate(mergers)]]
    assert all(isinstance(o, Merged) for o in outcomes), outcomes
    for o in outcomes:
        assert "exchanged" in o.stats.marks and "agreed" not in o.stats.marks, o.stats.marks
