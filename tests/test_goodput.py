"""Goodput as `bench churn` computes it (bench/goodput.py): compute that reached another peer's model or the final
one ÷ wall time spent, each case against numbers worked out by hand."""

import json

import pytest

from p2pdiloco.bench.goodput import goodput_from_metrics, run_goodput, startups


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"t": 99, "kind": "mer')  # a line cut by a kill


def _start(t, process_s):
    return {"t": t, "kind": "start", "process_s": process_s}


def _merge(t, compute, group, **fields):
    return {"t": t, "kind": "merge", "round_compute_s": compute, "group_size": group, **fields}


def _final(t):
    return {"t": t, "kind": "eval", "final": True}


def _goodput(tmp_path, rows, chaos=None):
    _write(tmp_path / "metrics.jsonl", rows)
    return goodput_from_metrics(tmp_path / "metrics.jsonl", chaos)


def test_group_merges_whose_result_was_taken_count_in_full(tmp_path):
    got = _goodput(tmp_path, [
        _start(10.0, 4.0),  # the process started at t=6
        _merge(12.0, 2.0, 3, own_kept=1.0),
        _merge(14.0, 2.0, 2),  # a line from before own_kept existed: all kept
        _final(15.0),
    ])
    assert got == {"spent_s": pytest.approx(15.0 - 6.0), "reached_s": pytest.approx(2.0 + 2.0), "incarnations": 1}


def test_a_round_whose_part_the_owners_left_out_does_not_count(tmp_path):
    got = _goodput(tmp_path, [
        _start(10.0, 4.0),
        _merge(12.0, 2.0, 3, own_kept=0.0),  # every owner's guards rejected this peer's part: nothing reached
        _merge(14.0, 2.0, 4, own_kept=0.25),  # one slice of four kept it: a quarter of 2 s
        _final(15.0),  # the final model is the group's, without those parts: they do not come back here
    ])
    assert got["reached_s"] == pytest.approx(0.5)
    assert got["spent_s"] == pytest.approx(9.0)


def test_the_share_of_stale_steps_a_rebase_gave_up_does_not_count(tmp_path):
    got = _goodput(tmp_path, [
        _start(10.0, 4.0),
        # 0.8 s of steps were taken while this merge was in flight; the rebase kept half of their progress
        _merge(12.0, 2.0, 3, rebase_dropped_s=0.4),
        _merge(14.0, 2.0, 3, rebase_dropped_s=0.0),  # those steps are in this round's 2 s: 1.6 s of it reached
        _final(15.0),
    ])
    assert got["reached_s"] == pytest.approx(2.0 + 1.6)


def test_rounds_merged_alone_reach_a_later_agreement_by_this_peers_share(tmp_path):
    got = _goodput(tmp_path, [
        _start(10.0, 4.0),
        _merge(12.0, 2.0, 1),  # alone: pending 2 s
        _merge(15.0, 3.0, 1, failure="TimeoutError"),  # the group merge failed, merged alone: pending 5 s
        # the group averaged global models and this peer took the result; its θg weighed 1 of 4 in the agreement
        _merge(17.0, 2.0, 3, adopted_state=True, state_share=0.25),
        _final(18.0),
    ])
    assert got["reached_s"] == pytest.approx(0.25 * (2.0 + 3.0) + 2.0)  # 3.25: the other 3.75 s were replaced


def test_a_refused_agreement_leaves_the_rounds_in_this_peers_model_only(tmp_path):
    got = _goodput(tmp_path, [
        _start(10.0, 4.0),
        _merge(12.0, 2.0, 1),  # alone: pending 2 s
        # the group's averaged θg was refused: this peer stepped its own θg by Δ̄, its own Δ in it: pending 4 s
        _merge(14.0, 2.0, 3, state_refused=True, adopted_state=False, state_share=0.3),
        _merge(15.0, 1.0, 2, adopted_state=True, state_share=0.5),  # half of the 4 pending s, and 1 s
        _final(16.0),
    ])
    assert got["reached_s"] == pytest.approx(0.5 * 4.0 + 1.0)


def test_rounds_merged_alone_count_in_full_when_a_later_group_already_holds_this_peers_model(tmp_path):
    # Digests agreed after this peer merged alone: no other peer's merges make its θg, so the others hold it because
    # a joiner downloaded it; those rounds are in their models whole (bench/goodput.py says why)
    got = _goodput(tmp_path, [
        _start(10.0, 4.0),
        _merge(12.0, 2.0, 1),
        _merge(14.0, 2.0, 1),
        _merge(16.0, 2.0, 2, adopted_state=False),
        _final(17.0),
    ])
    assert got["reached_s"] == pytest.approx(2.0 + 2.0 + 2.0)


def test_rounds_merged_alone_reach_the_final_model_at_a_normal_end(tmp_path):
    rows = [
        _start(10.0, 4.0),
        _merge(12.0, 2.0, 3),  # reached
        _merge(15.0, 3.0, 1),  # alone, the run's last round: in the final model
    ]
    assert _goodput(tmp_path, [*rows, _final(16.0)])["reached_s"] == pytest.approx(2.0 + 3.0)
    # without a final eval (stopped, crashed) the run did not end normally: the round alone is lost
    assert _goodput(tmp_path, rows)["reached_s"] == pytest.approx(2.0)


def test_rounds_merged_alone_are_lost_with_a_kill(tmp_path):
    kill = [{"t": 17.0, "event": "kill"}]
    got = _goodput(tmp_path, [
        _start(10.0, 4.0),
        _merge(12.0, 2.0, 3),  # reached
        _merge(15.0, 3.0, 1),  # alone, then killed: lost
        _final(16.0),  # even after a final eval: a killed process's model is gone
    ], kill)
    assert got["reached_s"] == pytest.approx(2.0)
    assert got["spent_s"] == pytest.approx(17.0 - 6.0)  # up to the kill, not the last line at t=16


def test_start_up_before_the_start_line_counts_as_spent(tmp_path):
    # The start line comes after imports, the DHT and the merger (process_s after the process began); a restart
    # pays that again, and a state download after its start line is in its wall time too
    got = _goodput(tmp_path, [
        _start(10.0, 4.0),  # first life: began at t=6
        _merge(12.0, 2.0, 2),
        _start(30.0, 3.5),  # second life: began at t=26.5
        {"t": 30.5, "kind": "join", "donor": "x"},
        _merge(33.0, 2.0, 2),
        _final(34.0),
    ])
    assert got["incarnations"] == 2
    assert got["spent_s"] == pytest.approx((12.0 - 6.0) + (34.0 - 26.5))  # 6 + 7.5; the 14.5 s between: not running


def test_killed_incarnations_are_charged_to_the_kill_in_a_run_folder(tmp_path):
    run = tmp_path / "run"
    _write(run / "peers" / "peer0" / "metrics.jsonl", [
        _start(4.0, 4.0),  # began at t=0
        _merge(6.0, 2.0, 3),  # reached: 2 s
        _merge(8.0, 2.0, 1),  # alone, then killed: lost
        {"t": 9.0, "kind": "train"},  # the last line; the kill came at 11.5, 2.5 s of steps later
        # restarted at 16.5, killed at 18 before its start line, restarted at 23
        _start(26.5, 3.5),  # began at t=23
        _merge(28.5, 2.0, 1),  # alone: pending 2 s
        _merge(30.5, 2.0, 2, adopted_state=True, state_share=0.5),  # 0.5 × 2 + 2 = 3 s
        _final(31.0),
    ])
    _write(run / "peers" / "peer1" / "metrics.jsonl", [_start(4.0, 4.0), _merge(6.0, 2.0, 3), _final(31.0)])
    (run / "chaos.jsonl").write_text("".join(json.dumps(e) + "\n" for e in [
        {"t": 11.5, "event": "kill", "peer": "peer0"}, {"t": 16.5, "event": "restart", "peer": "peer0"},
        {"t": 18.0, "event": "kill", "peer": "peer0"}, {"t": 23.0, "event": "restart", "peer": "peer0"},
    ]))
    got = run_goodput(run)
    # peer0: 0 → 11.5, 16.5 → 18 (a life that never wrote a line), 23 → 31; peer1: 0 → 31
    spent = (11.5 + 1.5 + 8.0) + 31.0
    reached = (2.0 + 3.0) + 2.0
    assert got == {"goodput": pytest.approx(reached / spent), "spent_s": pytest.approx(spent),
                   "reached_s": pytest.approx(reached), "incarnations": 3}
    assert run_goodput(tmp_path / "empty") is None


def test_start_ups_split_first_starts_from_restarts_and_skip_a_process_killed_before_its_first_step(tmp_path):
    def first_eval(t, process_s):
        return {"t": t, "kind": "eval", "process_s": process_s}

    _write(tmp_path / "peers" / "peer0" / "metrics.jsonl", [
        _start(10.0, 4.0), first_eval(11.0, 5.5), _merge(12.0, 1.0, 2), first_eval(13.0, 9.0),  # a later eval: not
        _start(30.0, 2.0),  # restarted, killed before its first step
        _start(50.0, 2.2), first_eval(51.0, 2.7), _final(60.0),
    ])
    _write(tmp_path / "peers" / "peer1" / "metrics.jsonl", [_start(10.0, 4.1), first_eval(11.0, 6.0)])
    assert startups(tmp_path) == {"first": [5.5, 6.0], "restart": [2.7]}
