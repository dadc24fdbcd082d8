"""Goodput as `bench churn` computes it from peers' metrics files: what reached a global model ÷ wall time spent."""

import json

import pytest

from p2pdiloco.bench.churn import goodput_from_metrics


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"t": 99, "kind": "mer')  # a line cut by a kill


def test_goodput_counts_start_up_and_lost_rounds_as_spent(tmp_path):
    rows = [
        # first incarnation: process started at t=0 (start line at t=4 after 4 s of start-up)
        {"t": 4.0, "kind": "start", "process_s": 4.0},
        {"t": 6.0, "kind": "merge", "group_size": 3, "round_compute_s": 2.0},  # reached
        {"t": 8.0, "kind": "merge", "group_size": 1, "round_compute_s": 2.0},  # alone, then killed: lost
        {"t": 9.0, "kind": "train"},  # killed at t≈9: 1 s of steps after the last merge, lost
        # restarted at t=14 (the 5 s down is not spent); its start line comes before its state download
        {"t": 17.0, "kind": "start", "process_s": 3.0},
        {"t": 17.5, "kind": "join", "donor": "x"},
        {"t": 19.5, "kind": "merge", "group_size": 1, "round_compute_s": 2.0},  # alone, but reaches the end
        {"t": 21.5, "kind": "merge", "group_size": 2, "round_compute_s": 2.0},  # and carried by this one
        {"t": 22.0, "kind": "eval", "final": True},
    ]
    path = tmp_path / "metrics.jsonl"
    _write(path, rows)
    got = goodput_from_metrics(path)
    assert got["incarnations"] == 2
    assert got["spent_s"] == pytest.approx(9.0 + 8.0)  # 0→9 and 14→22
    assert got["reached_s"] == pytest.approx(2.0 + 4.0)
