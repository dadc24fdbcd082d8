"""`bench wan`'s figures read from a run's files (no root): tests/fixtures/bench-wan holds a run of three peers,
written by hand in the format peers write: peer0 merges in the whole swarm (one merge over 2x the median, a slow
final merge) and says nobody can dial it; peer1 merges alone and in a pair and logs failed dials; peer2 joined
mid-run (a `join` line, then group merges). Process start: 10:00:00.5 UTC."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from rich.console import Console

from p2pdiloco.bench import wanbench, wanfigures
from p2pdiloco.bench.wanfigures import (
    alone_reasons,
    clean,
    failed_dials,
    group_figures,
    joiner_figures,
    seconds_until,
    utilization,
)
from p2pdiloco.bench.wanreport import eval_ratio, print_swarm_figures
from p2pdiloco.config import ConfigError

RUN = Path(__file__).parent / "fixtures" / "bench-wan"


@pytest.fixture(autouse=True)
def utc(monkeypatch):
    """The fixture's log times are UTC times of day."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_utilization_is_compute_over_the_training_loop_s_wall_time():
    u = utilization([{"compute_s": 57.0, "train_s": 60.0}, {"compute_s": 59.4, "train_s": 60.0}, {"train_s": 0}])
    assert u["per_peer"] == pytest.approx([0.95, 0.99])
    assert u["mean"] == pytest.approx(0.97) and u["min"] == pytest.approx(0.95)
    assert utilization([]) == {"mean": None, "min": None, "per_peer": []}


def test_failed_dials_count_log_records_by_kind_and_not_traceback_lines():
    assert failed_dials(RUN / "peers" / "peer1" / "peer1.log") == {
        "dial backoff": 1, "merge failed": 2, "leader silent": 1}
    assert failed_dials(RUN / "peers" / "peer0" / "peer0.log") == {}
    assert failed_dials(RUN / "nowhere.log") == {}


def test_group_figures_find_the_slow_merge_the_splits_and_the_failed_dials():
    g = group_figures(RUN, ["peer0", "peer1"], swarm=3)
    assert g["merges"] == 7 and g["group_merges"] == 6  # peer1's cut line is skipped
    assert g["median_s"] == pytest.approx(1.1)  # of 1.0, 1.2, 3.0, 1.1, 1.0: the final merge (9 s) left out
    assert g["max_s"] == 3.0 and g["max_over_median"] == pytest.approx(3.0 / 1.1)
    assert g["final_max_s"] == 9.0
    assert g["later_max_over_median"] == pytest.approx(3.0 / 1.1)  # peer0's 3 s merge is its third
    assert g["split_merges"] == 2 and g["smallest_group"] == 1
    assert g["failed_dial_records"] == 4
    assert not clean(g)
    whole = group_figures(RUN, ["peer0"], swarm=3)
    assert whole["split_merges"] == 0 and whole["failed_dial_records"] == 0
    assert not clean(whole)  # 3.0 s is over 2x the median of 1.0, 1.2, 3.0
    assert clean(whole, max_ratio=2.5)
    firsts = group_figures(RUN, ["peer2"], swarm=3)  # the joiner: alone first, then one group merge of 1.3 s
    assert firsts["later_max_over_median"] == pytest.approx(1.0) and firsts["split_merges"] == 1
    assert not clean(group_figures(RUN, [], swarm=3))  # no group merge is not a clean run


def test_seconds_until_a_log_line_count_from_the_process_start():
    start = time.mktime((2026, 11, 28, 10, 0, 0, 0, 0, -1)) + 0.5
    log = RUN / "peers" / "peer0" / "peer0.log"
    assert seconds_until(log, wanfigures.UNREACHABLE, start) == pytest.approx(11.5)
    assert seconds_until(log, wanfigures.NOBODY_LEADS, start) == pytest.approx(39.5)  # the first of two
    assert seconds_until(log, "no such line", start) is None
    # a process started at 23:59:30.5 the day before: 10:00:12 is on the next day
    assert seconds_until(log, wanfigures.UNREACHABLE, start - 10 * 3600 - 30) == pytest.approx(10 * 3600 + 41.5)


def test_alone_reasons_time_both_warnings_and_count_the_rounds():
    r = alone_reasons(RUN / "peers" / "peer0", "peer0")
    assert r == {"unreachable_s": pytest.approx(11.5), "nobody_leads_s": pytest.approx(39.5), "group_rounds": 4,
                 "alone_rounds": 0}
    assert alone_reasons(RUN / "peers" / "peer1", "peer1")["nobody_leads_s"] is None


def test_joiner_figures_time_the_state_and_the_first_group_merge_against_the_bound():
    j = joiner_figures(RUN / "peers" / "peer2" / "metrics.jsonl", state_bytes=964_608, down_mbit=100)
    assert j["state_s"] == pytest.approx(20.0) and j["first_group_merge_s"] == pytest.approx(26.0)
    assert j["download_s"] == 1.5 and j["donor"] == "12D3KooWdonorXYZ"
    assert j["bound_s"] == pytest.approx(964_608 * 8 / 100e6 + 30)
    assert j["within_bound"] and j["state_bytes_received"] == 964_700 and not j["arrived_after_end"]
    assert joiner_figures(RUN / "peers" / "peer2" / "metrics.jsonl", 964_608, None)["bound_s"] == 30.0
    never = joiner_figures(RUN / "peers" / "peer0" / "metrics.jsonl", 964_608, 100)  # no join line
    assert never["state_s"] is None and not never["within_bound"]


def test_the_report_prints_every_run_and_counts_the_clean_ones():
    groups = group_figures(RUN, ["peer0"], swarm=3)
    run = {"groups": groups, "utilization": utilization([{"compute_s": 58.5, "train_s": 60.0}]),
           "eval_loss_final": 2.9, "sync": False, "peers": [], "status": {}}
    lan = {**run, "eval_loss_final": 2.9 / 1.01}
    results = {"peers": 3, "nat": 0, "profile": "wan50", "joiner": False,
               "runs": {"lan": lan, "wan50 1": run, "wan50 2": {
                   **run, "groups": {**groups, "max_over_median": 1.5, "later_max_over_median": 1.2}}}}
    assert eval_ratio(run, lan) == pytest.approx(1.01)
    assert eval_ratio(run, None) is None
    console = Console(record=True, width=1000)
    print_swarm_figures(results, console)
    text = console.export_text()
    assert "1 of 2 runs of wan50 clean" in text and "1 of 2 without each peer's first merge" in text
    assert "1.0100" in text and "0.975" in text and "clean: yes" in text and "clean: no" in text


def test_bench_wan_runs_lan_once_then_each_repeat_then_sync(monkeypatch, tmp_path):
    calls = []

    def fake_run(profile, peers, nat, steps, out, sets, console, name=None, joiner=False, tcp=""):
        calls.append((profile, name, sets, joiner))
        assert tcp == ""  # the lab's default unless --tcp says otherwise
        g = group_figures(RUN, ["peer0"], swarm=3)
        return {"groups": g, "utilization": utilization([]), "eval_loss_final": None, "peers": [], "status": {},
                "sync": bool(sets), "wall_s": 1.0, "final_models": "identical", "global_models_identical": True,
                "delay_daemons_alive_at_end": {}}

    monkeypatch.setattr(wanbench, "check_can_run", lambda what, links: None)
    monkeypatch.setattr(wanbench, "run_profile", fake_run)
    results = wanbench.bench_wan(tmp_path, profile="wan50", peers=3, nat=0, repeat=3, sync=True, joiner=True,
                                 console=Console(quiet=True))
    assert list(results["runs"]) == ["lan", "wan50 1", "wan50 2", "wan50 3", "wan50 --sync"]
    assert [c[1] for c in calls] == ["lan", "wan50-1", "wan50-2", "wan50-3", "wan50-sync"]
    assert [c[2] for c in calls][:4] == [[]] * 4 and calls[4][2] == wanbench.SYNC_SETS
    assert all(c[3] for c in calls)
    assert (tmp_path / "wan.json").exists()
    with pytest.raises(ConfigError, match="--repeat >= 1"):
        wanbench.bench_wan(tmp_path, repeat=0)
