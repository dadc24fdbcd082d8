"""`bench byzantine`'s bookkeeping with several seeds: which runs it makes and how it turns them into figures.

The swarms themselves are the real `run_local` in the bench (docs/benchmarks.md); here a fake stands in for it, so
that the ratios can be checked against numbers worked out by hand.
"""

from __future__ import annotations

import json
import statistics

import pytest
from rich.console import Console

from p2pdiloco.bench import byzantine

# honest peers' final eval loss per (kind, seed): per-seed ratios 1.1 and 1.0 for signflip, 1.05 and 1.0 ÷ honest only
LOSSES = {("clean", 1234): 2.0, ("clean", 1235): 2.5, ("signflip", 1234): 2.2, ("signflip", 1235): 2.5,
          ("honest_only", 1234): 2.2 / 1.05, ("honest_only", 1235): 2.5}


def _fake_run_local(calls):
    def run_local(n, cfg, out, _join, sets, console=None, reraise_interrupt=False, peer_sets=None):
        kind = next(s for s in sets if s.startswith("swarm.run_id=")).split("bench-byz-")[1].split("_")[0]
        kind = "honest_only" if kind == "honest" else kind
        calls.append((kind, cfg.model.init_seed, n, sorted(peer_sets or {}), str(out)))
        hostile = set(peer_sets or {})
        peers = [{"name": f"peer{i}", "peer_id": f"id{i}", "step": 100, "merges": 20,
                  "eval_loss_final": 9.9 if i in hostile else LOSSES[kind, cfg.model.init_seed],
                  "guard": {"rejected": 1, "banned": []}} for i in range(n)]
        return {"peers": peers, "peers_finished": n}

    return run_local


def test_seeds_interleave_and_each_figure_is_the_mean_of_the_per_seed_ratios(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(byzantine, "run_local", _fake_run_local(calls))
    results = byzantine.bench_byzantine(tmp_path, sizes=(5,), modes=("sync",), kinds=("honest_only", "signflip"),
                                        seeds=2, console=Console(file=None, quiet=True))
    # seed by seed, each seed's clean run first; 3 honest peers alone, 2 hostile (peers 0 and 1) among 5
    assert [(k, seed, n, hostile) for k, seed, n, hostile, _ in calls] == [
        ("clean", 1234, 5, []), ("honest_only", 1234, 3, []), ("signflip", 1234, 5, [0, 1]),
        ("clean", 1235, 5, []), ("honest_only", 1235, 3, []), ("signflip", 1235, 5, [0, 1])]
    assert len({out for *_, out in calls}) == 6  # every run in its own folder
    figure = results["figures"]["signflip_sync_5"]
    assert figure["ratio_per_seed"] == pytest.approx([1.1, 1.0])
    assert figure["ratio"] == pytest.approx(1.05)
    assert figure["ratio_stdev"] == pytest.approx(statistics.stdev([1.1, 1.0]))
    assert figure["ratio_honest_only_per_seed"] == pytest.approx([1.05, 1.0])
    assert results["runs"]["signflip_sync_5_seed1"]["eval_loss"] == 2.5  # the honest peers' loss, not the hostile
    written = json.loads((tmp_path / "byzantine.json").read_text())
    assert written["figures"]["signflip_sync_5"]["ratio"] == pytest.approx(1.05) and written["seeds"] == 2


def test_one_seed_keeps_the_run_names_and_the_config_seed(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(byzantine, "run_local", _fake_run_local(calls))
    results = byzantine.bench_byzantine(tmp_path, sizes=(5,), modes=("sync",), kinds=("signflip",),
                                        console=Console(file=None, quiet=True))
    assert sorted(results["runs"]) == ["clean_sync_5", "signflip_sync_5"]
    assert [seed for _, seed, *_ in calls] == [1234, 1234]
    assert results["figures"]["signflip_sync_5"]["ratio"] == pytest.approx(1.1)
    assert results["runs"]["signflip_sync_5"]["ratio"] == pytest.approx(1.1)


def test_no_seeds_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--seeds"):
        byzantine.bench_byzantine(tmp_path, seeds=0)
