"""`bench wancodec`'s arithmetic (no root): the swarm's eval curve, time to a target, the targets, the payloads, the
arms' settings, and its flags' refusals."""

from __future__ import annotations

import json
import os

import pytest

from p2pdiloco.bench import wancodec
from p2pdiloco.bench.wancodec import (
    arm_figures,
    eval_series,
    swarm_curve,
    targets,
    time_to_stay,
    time_to_target,
)
from p2pdiloco.cli import main
from p2pdiloco.config import load_config, parse_set


def test_eval_series_takes_evals_and_evaluated_merges_in_time_order():
    rows = [{"t": 5.0, "kind": "merge", "eval_loss": 3.0}, {"t": 1.0, "kind": "eval", "eval_loss": 5.0},
            {"t": 3.0, "kind": "merge", "eval_loss": None}, {"t": 4.0, "kind": "train", "loss": 2.0},
            {"t": 9.0, "kind": "eval", "eval_loss": 2.5, "final": True}]
    assert eval_series(rows) == [(1.0, 5.0), (5.0, 3.0), (9.0, 2.5)]


def test_swarm_curve_is_the_mean_of_each_peers_latest_eval_from_when_all_have_one():
    a = [(0.0, 6.0), (10.0, 4.0), (20.0, 2.0)]
    b = [(1.0, 6.0), (15.0, 3.0)]
    # at 0 only a has a point: the curve starts at 1, when both do
    assert swarm_curve([a, b]) == [(1.0, 6.0), (10.0, 5.0), (15.0, 3.5), (20.0, 2.5)]
    assert swarm_curve([a, []]) == []
    assert swarm_curve([]) == []


def test_time_to_target_is_the_first_point_at_or_below_it():
    curve = [(101.0, 6.0), (110.0, 5.0), (115.0, 3.5), (120.0, 2.5)]
    assert time_to_target(curve, 3.5, t0=100.0) == 15.0
    assert time_to_target(curve, 4.0, t0=100.0) == 15.0
    assert time_to_target(curve, 6.5, t0=100.0) == 1.0
    assert time_to_target(curve, 2.0, t0=100.0) is None


def test_targets_lead_to_the_worse_arms_final_loss_then_the_others_finals():
    assert targets(6.0, [2.0, 3.0], (0.5, 1.0)) == [4.5, 3.0, 2.0]
    assert targets(6.0, [2.0, 3.0, 2.5, 3.0], (1.0,)) == [3.0, 2.5, 2.0]


def test_time_to_stay_counts_a_target_reached_for_good():
    dips = [(101.0, 6.0), (110.0, 3.0), (115.0, 3.6), (120.0, 3.4), (125.0, 3.2)]
    assert time_to_target(dips, 3.5, t0=100.0) == 10.0  # first reached, then lost again
    assert time_to_stay(dips, 3.5, t0=100.0) == 20.0  # below from 120 on
    assert time_to_stay(dips, 3.1, t0=100.0) is None  # ends above it
    assert time_to_stay(dips, 7.0, t0=100.0) == 1.0  # below from the start
    assert time_to_stay([], 3.0, t0=0.0) is None


def test_arm_figures_from_a_run_folder(tmp_path):
    for i, (evals, merges) in enumerate([([(0.0, 6.0), (30.0, 3.0)], [(10.0, 2, 4.0, 2.0), (20.0, 1, None, 0.1)]),
                                         ([(1.0, 6.0), (31.0, 3.2)], [(11.0, 2, 4.2, 4.0)])]):
        d = tmp_path / "peers" / f"peer{i}"
        d.mkdir(parents=True)
        rows = [{"t": t, "kind": "eval", "eval_loss": x} for t, x in evals]
        rows += [{"t": t, "kind": "merge", "group_size": g, "eval_loss": x, "merge_s": s} for t, g, x, s in merges]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    peers = [{"bytes_sent": 12e6, "pseudo_grad_bytes_sent": 8e6, "merges": 2, "inner_steps": 30, "rounds": 3,
              "compute_s": 27.0, "train_s": 30.0},
             {"bytes_sent": 4e6, "pseudo_grad_bytes_sent": 2e6, "merges": 1, "inner_steps": 30, "rounds": 2,
              "compute_s": 24.0, "train_s": 30.0}]
    summary = {"peers": peers, "eval_loss_initial": 6.0, "eval_loss_final": 3.1, "wall_s": 40.0,
               "final_models": "apart"}
    f = arm_figures(tmp_path, summary)
    assert f["t0"] == 0.0
    assert f["curve"][0] == (1.0, 6.0) and f["curve"][-1] == (31.0, 3.1)
    assert f["group_rounds"] == 2 and f["rounds"] == 3
    assert f["group_merge_s_median"] == 3.0 and f["group_merge_s_max"] == 4.0  # the merge alone is left out
    assert f["bytes_per_round"] == pytest.approx(3e6) and f["delta_bytes_per_merge"] == 3e6
    assert f["inner_steps"] == 30 and f["steps_per_round"] == pytest.approx(12.5)
    assert f["utilization"] == pytest.approx(0.85)


def test_payload_arithmetic_of_int4_and_sparseloco():
    n = 1_000_000
    int4 = wancodec.payload_bytes(load_config(None, [parse_set(["codec.name=int4"])]), n, peers=4)
    assert int4["part_bytes"] == n // 2 + 4 * (n // 128 + 1)  # codes, and an fp32 scale per block of 128
    assert int4["sent_bytes"] == pytest.approx(1.5 * int4["part_bytes"])  # all-reduce: 2·(n−1)/n of it
    cfg = load_config(None, [parse_set(wancodec.arm_sets("sparseloco"))])
    sparse = wancodec.payload_bytes(cfg, n, peers=4)
    assert 0 < sparse["part_bytes"] < n * 48 / 4096 * 2  # under 16 bits a kept value
    assert sparse["sent_bytes"] == 3 * sparse["part_bytes"]  # all-gather: one copy to each other member


def test_the_default_arm_is_the_default_codec_and_sparseloco_is_its_recipe():
    from p2pdiloco.config.recipes import RECIPES

    assert load_config(None, []).codec.name == wancodec.ARMS[0] == "int4"
    assert wancodec.arm_sets("sparseloco") == RECIPES["sparseloco"]
    assert wancodec.arm_sets("int8@lan") == ["codec.name=int8"]
    assert wancodec.parse_arm("int4") == ("int4", "home") and wancodec.parse_arm("int4@lan") == ("int4", "lan")


def test_crossover_takes_the_links_part_from_the_same_codec_on_lan():
    arms = {"int4": {"group_merge_s_median": 8.0}, "sparseloco": {"group_merge_s_median": 2.0},
            "int4@lan": {"group_merge_s_median": 3.0}}
    c = wancodec.crossover(arms, round_s=10.0, n_params=20_000_000, sent_bytes=10e6)
    assert c["merge_s"] == 8.0 and c["lan_merge_s"] == 3.0 and c["link_s"] == 5.0
    assert c["link_mbit"] == pytest.approx(16.0)  # 10 MB in 5 s
    assert c["params_merge_fills_round"] == pytest.approx(25e6)  # 20M · 10 s ÷ 8 s
    assert c["params_link_fills_round"] == pytest.approx(40e6)  # 20M · 10 s ÷ 5 s
    alone = wancodec.crossover({"int4": arms["int4"], "sparseloco": arms["sparseloco"]}, 10.0, 20_000_000, 10e6)
    assert alone["lan_merge_s"] is None and alone["params_link_fills_round"] is None
    assert wancodec.crossover({"int4": {"group_merge_s_median": None}}, 10.0, 1, 1.0) is None


def test_the_bench_model_has_an_int4_merge_of_at_least_10_mb():
    cfg = load_config(None, [parse_set(wancodec.MODEL_SETS)])
    n = 12 * cfg.model.d_model**2 * cfg.model.n_layer  # the blocks alone
    assert wancodec.payload_bytes(cfg, n, peers=4)["part_bytes"] >= 10e6


@pytest.mark.parametrize("argv, message", [
    (["--codecs", "int4,zstd"], "--codecs takes distinct arms NAME[@PROFILE]"),
    (["--codecs", "int4,int4@home"], "--codecs takes distinct arms NAME[@PROFILE]"),
    (["--codecs", "int4,int4@moon"], "--codecs takes distinct arms NAME[@PROFILE]"),
    (["--peers", "4,8"], "--peers takes one positive integer"),
    (["--peers", "4", "--nat", "4"], "bench wancodec needs --peers >= 2, 0 <= --nat < --peers"),
])
def test_wrong_flags_are_refused_with_one_line(tmp_path, capsys, argv, message):
    assert main(["bench", "wancodec", "--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "out").exists()


def test_without_root_bench_wancodec_exits_with_one_clear_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["bench", "wancodec", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("p2pdiloco bench: error: bench wancodec must run as root")
    assert not (tmp_path / "out").exists()
