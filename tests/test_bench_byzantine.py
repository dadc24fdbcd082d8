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


def _joiner_run_local(calls, join_after_s):
    """A fake `run_local` whose last peer starts, is restarted and joins `join_after_s[kind]` after its restart's
    process start; its donors report what they served."""
    def run_local(n, cfg, out, _join, sets, console=None, reraise_interrupt=False, peer_sets=None, chaos=None):
        kind = "pinner" if "pinner" in out.name else "clean_join" if "clean_join" in out.name else "clean"
        calls.append((kind, sorted(peer_sets or {}), type(chaos).__name__))
        joiner = out / "peers" / f"peer{n - 1}"
        joiner.mkdir(parents=True)
        lines = [{"t": 100.0, "kind": "start", "process_s": 3.0}, {"t": 110.0, "kind": "merge"},
                 {"t": 130.0, "kind": "start", "process_s": 4.0}]
        if kind in join_after_s:  # the restart's join, with the time its process started 4 s before its start line
            lines.append({"t": 130.0 - 4.0 + join_after_s[kind], "kind": "join", "donor": "id1", "step": 40,
                          "download_s": 1.5})
        (joiner / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        serving = {"served": 1, "cut": 2 if kind == "pinner" else 0, "refused": {"busy": 0, "one at a time": 9,
                                                                                   "backed off": 30}}
        peers = [{"name": f"peer{i}", "peer_id": f"id{i}", "step": 100, "merges": 20, "n_params": 64_000,
                  "eval_loss_final": 2.0, "guard": {"rejected": 0, "banned": []}, "state_serving": serving}
                 for i in range(n)]
        return {"peers": peers, "peers_finished": n}

    return run_local


def test_the_pinner_runs_with_a_joiner_whose_time_to_the_state_is_set_beside_clean_join_s(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(byzantine, "run_local", _joiner_run_local(calls, {"clean_join": 8.0, "pinner": 10.0}))
    results = byzantine.bench_byzantine(tmp_path, sizes=(4,), modes=("decoupled",), kinds=("pinner",),
                                        hostile_count=1, console=Console(file=None, quiet=True))
    assert calls == [("clean", [], "NoneType"), ("clean_join", [], "JoinerRestart"),
                     ("pinner", [0], "JoinerRestart")]
    run = results["runs"]["pinner_decoupled_4"]
    # the restart's start line and join line: 4 s of start-up before the start line, then 6 s more
    assert run["joiner"] == {"joined": "honest", "join_step": 40, "refused_states": 0, "donor": "peer1",
                             "join_s": pytest.approx(10.0), "download_s": 1.5}
    # the honest donors only: not the pinner (peer0), not the joiner (peer3)
    assert sorted(run["donors"]) == ["peer1", "peer2"] and run["donors"]["peer1"]["cut"] == 2
    slot = 5.0 + 2 * 64_000 * 4 / 64_000  # wire.send_deadline of θg and momentum in fp32
    assert run["slot_s"] == pytest.approx(slot)
    assert run["join"] == {"join_s": pytest.approx(10.0), "clean_join_s": pytest.approx(8.0),
                           "ratio": pytest.approx(1.25), "extra_s": pytest.approx(2.0), "slot_s": pytest.approx(slot),
                           "within_slot": True}
    assert results["figures"]["pinner_decoupled_4"]["join_per_seed"] == [run["join"]]


def test_a_joiner_later_than_one_slot_s_time_is_reported_not_within_and_one_never_served_has_no_figure(
        tmp_path, monkeypatch):
    monkeypatch.setattr(byzantine, "run_local", _joiner_run_local([], {"clean_join": 8.0, "pinner": 8.0 + 14.0}))
    results = byzantine.bench_byzantine(tmp_path / "late", sizes=(4,), modes=("decoupled",), kinds=("pinner",),
                                        hostile_count=1, console=Console(file=None, quiet=True))
    join = results["runs"]["pinner_decoupled_4"]["join"]
    assert join["extra_s"] == pytest.approx(14.0) and join["slot_s"] == pytest.approx(13.0)
    assert join["within_slot"] is False
    monkeypatch.setattr(byzantine, "run_local", _joiner_run_local([], {"clean_join": 8.0}))
    results = byzantine.bench_byzantine(tmp_path / "never", sizes=(4,), modes=("decoupled",), kinds=("pinner",),
                                        hostile_count=1, console=Console(file=None, quiet=True))
    run = results["runs"]["pinner_decoupled_4"]
    assert run["joiner"]["joined"] == "no attempt" and run["join"] == {}
