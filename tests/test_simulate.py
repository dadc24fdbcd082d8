"""`p2pdiloco simulate`: closed-form cases, determinism, the scenario and calibration parsers, the command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from p2pdiloco.cli import main
from p2pdiloco.config import ConfigError
from p2pdiloco.sim.calibrate import calibrate
from p2pdiloco.sim.presets import preset
from p2pdiloco.sim.scenario import ALGORITHMS, Scenario, load_scenario
from p2pdiloco.sim.simulate import run_algorithm, simulate


def ideal(learners: int = 4, duration: float = 60.0) -> Scenario:
    """Equal speeds, no failures, and nothing that costs time but training: start-up, merges, links."""
    s = Scenario()
    s.run.learners, s.run.duration_s, s.run.algorithms = learners, duration, list(ALGORITHMS)
    s.failures.first_start_s = 0.0
    s.network.matchmaking_s = s.network.latency_s = 0.0
    s.network.bandwidth_gbps = 1e12
    s.protocol.round_seconds, s.protocol.round_steps = 2.0, 10
    return s.validate()


def test_no_failures_and_equal_speeds_give_goodput_one_for_every_algorithm():
    results, timing = simulate(ideal())
    assert set(results["algorithms"]) == set(ALGORITHMS)
    for name, r in results["algorithms"].items():
        assert r["goodput"] == pytest.approx(1.0, abs=1e-9), name
    assert results["algorithms"]["decoupled"]["group_size_hist"] == {"4": 30}  # every 2 s round, everyone
    assert all(t["events"] > 0 for t in timing.values())


@pytest.mark.parametrize("k", [2, 4])
def test_one_learner_k_times_slower_gives_the_synchronous_ratio_one_over_k(k):
    def fast_steps_per_s(with_slow: bool, mode: str) -> float:
        s = ideal(4 if with_slow else 3, duration=40.0)
        s.compute.speeds = [1.0, 1.0, 1.0] + ([float(k)] if with_slow else [])
        r = run_algorithm(s.validate(), mode)
        return sum(r["steps_per_s"][:3]) / 3

    assert fast_steps_per_s(True, "sync") / fast_steps_per_s(False, "sync") == pytest.approx(1 / k)
    assert fast_steps_per_s(True, "decoupled") / fast_steps_per_s(False, "decoupled") == pytest.approx(1.0)


def test_a_single_failure_costs_data_parallel_the_work_since_the_checkpoint_plus_the_restart():
    s = ideal(4, duration=400.0)  # 4000 steps of 0.1 s, a checkpoint every 100
    s.failures.kill_every_s = 255.0  # one kill, at 255 s (step 2550): the next one would come after the end
    s.failures.down_s, s.failures.dp_restart_s, s.failures.dp_detect_s = 5.0, 6.0, 0.0
    r = run_algorithm(s.validate(), "data_parallel")
    assert r["kills"] == 1
    lost_since_checkpoint = 4 * (2550 - 2500) * 0.1  # every rank's steps since step 2500
    restart = 3 * 5.0 + 4 * 6.0  # the survivors wait for the lost rank, then every rank starts again
    assert r["spent_s"] - r["reached_s"] == pytest.approx(lost_since_checkpoint + restart)
    assert r["reached_s"] == pytest.approx(4 * 4000 * 0.1)


def test_the_same_seed_gives_the_same_json_and_another_seed_another():
    def run(seed: int) -> str:
        s = Scenario()
        s.run.learners, s.run.duration_s, s.run.seed, s.run.algorithms = 50, 600.0, seed, list(ALGORITHMS)
        s.compute.speeds, s.compute.jitter, s.failures.mtbf_s = [1.0, 2.0], 0.2, 900.0
        s.run.token_budget = 1e6
        return json.dumps(simulate(s.validate())[0], sort_keys=True)

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_group_size_bounds_merge_groups_but_the_closing_merge():
    s = ideal(7)
    s.protocol.group_size = 3
    r = run_algorithm(s.validate(), "decoupled")
    sizes = {int(g): c for g, c in r["group_size_hist"].items()}
    assert max(sizes) == 7  # a run's last merges take everyone (`find_group`'s closing searches)
    assert set(sizes) - {7} == {2, 3}  # 7 learners dealt into 3 groups of at most 3 every epoch
    assert r["goodput"] == pytest.approx(1.0)


def test_churn_preset_lands_near_bench_churn():
    """bench churn at 13c3dce measured 0.926 decoupled, 0.806 --sync, 0.686 data-parallel (docs/benchmarks.md), with
    the protocol of that commit: no `outer.land_wait` and every step in flight kept (`outer.rebase_keep` = 1)."""
    s = preset("churn")
    s.protocol.land_wait, s.protocol.rebase_keep = 0.0, 1.0
    got = {a: run_algorithm(s, a)["goodput"] for a in ("decoupled", "sync", "data_parallel")}
    for name, measured in {"decoupled": 0.926, "sync": 0.806, "data_parallel": 0.686}.items():
        assert abs(got[name] - measured) <= 0.03, (name, got[name])
    assert got["decoupled"] > got["sync"] > got["data_parallel"]


def test_bad_scenarios_fail_in_one_line(tmp_path):
    bad = {"unknown.toml": "[run]\nlerners = 4\n", "broken.toml": "[run\n", "type.toml": "[run]\nlearners = 'x'\n",
           "table.toml": "[nope]\na = 1\n", "value.toml": "[network]\ncodec = 'zip'\n"}
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError) as e:
            load_scenario(tmp_path / name)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError):
        preset("nope")
    (tmp_path / "ok.toml").write_text("[run]\nlearners = 12\n[failures]\nmtbf_s = 3600\n")
    s = load_scenario(tmp_path / "ok.toml")
    assert (s.run.learners, s.failures.mtbf_s) == (12, 3600.0)


def test_the_command_writes_results_and_refuses_bad_input(tmp_path, capsys):
    cfg = tmp_path / "swarm.toml"
    cfg.write_text("[run]\nlearners = 6\nduration_s = 120.0\n[failures]\nmtbf_s = 600.0\n")
    assert main(["simulate", "--config", str(cfg), "--set", "compute.speeds=[1.0, 3.0]", "--out", str(tmp_path / "o"),
                 "--no-sweep"]) == 0
    data = json.loads((tmp_path / "o" / "simulate.json").read_text())
    assert data["scenario"]["compute"]["speeds"] == [1.0, 3.0] and data["scenario"]["run"]["learners"] == 6
    assert "events/s" in capsys.readouterr().out
    for argv in (["--preset", "nope"], ["--set", "run.nope=1"], ["--set", "oops"], ["--calibrate", str(tmp_path / "none")]):
        assert main(["simulate", *argv, "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("p2pdiloco simulate: error:") and "\n" not in err


def _metrics(path: Path, incarnations: list[list[tuple[float, float, int]]], final: bool) -> None:
    """A peer's metrics.jsonl: per incarnation a start line, merges (time, round compute, group size), and at the
    end of the last one the final eval."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows, t = [], 1000.0
    for merges in incarnations:
        rows.append({"t": t, "kind": "start", "elapsed_s": 0.0, "process_s": 5.0, "step": 0, "round": 0})
        for dt, compute, g in merges:
            rows.append({"t": t + dt, "kind": "merge", "round_compute_s": compute, "group_size": g})
        t += merges[-1][0] + 10.0
    if final:
        rows.append({"t": t - 9.0, "kind": "eval", "final": True, "eval_loss": 1.5})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{\"t\": 12")  # and a line cut by a kill


def test_calibrate_reads_a_bench_churn_folder(tmp_path):
    runs = {}
    for name in ("decoupled_churn", "sync_churn", "decoupled_no_churn"):
        for i in range(4):
            killed = name != "decoupled_no_churn" and i == 1
            incs = [[(2.0, 2.0, 4), (4.0, 2.0, 1)], [(3.0, 2.0, 3)]] if killed else [[(2.0, 2.0, 4), (4.0, 2.0, 4)]]
            _metrics(tmp_path / name / "peers" / f"peer{i}" / "metrics.jsonl", incs, final=True)
        if name != "decoupled_no_churn":  # peer1's first life (last line at t=1004) was killed at 1005
            (tmp_path / name / "chaos.jsonl").write_text(
                '{"t": 1005.0, "event": "kill", "peer": "peer1"}\n{"t": 1009.0, "event": "restart", "peer": "peer1"}\n')
        runs[name] = {"goodput": 0.5, "kills": 1 if name != "decoupled_no_churn" else 0}
    runs["data_parallel_churn"] = {"goodput": 0.6, "kills": 3}
    (tmp_path / "churn.json").write_text(json.dumps({"runs": runs, "peers": 4, "kill_every_s": 60.0,
                                                     "restart_delay_s": 5.0, "steps": 600}))
    cal = calibrate(tmp_path)
    assert cal["kind"] == "churn" and cal["inputs"]["first_start_s"] == 5.0
    # The others: 4 s reached of 5 + 4 + 1 s (start-up, merges, final eval). peer1 of a churn run: in its first
    # life 2 s reached (its round merged alone is lost with it) of 5 + 5 s (start-up, up to the kill), in its
    # second 2 s of 5 + 3 + 1 s.
    assert cal["goodput"]["decoupled_churn"]["measured"] == pytest.approx((3 * 4 + 2 + 2) / (3 * 10 + 10 + 9))
    assert cal["goodput"]["data_parallel_churn"]["measured"] == 0.6  # from churn.json: no metrics to recompute
    assert all(0 < v["simulated"] <= 1 for v in cal["goodput"].values())
    assert cal["goodput"]["sync_churn"]["kills_measured"] == 1


# A real `p2pdiloco bench straggler` folder, checked in with each metrics file cut to the lines calibration reads
# (tests/fixtures/bench-straggler/README.md says how it was made).
STRAGGLER_RUN = Path(__file__).parent / "fixtures" / "bench-straggler"


def test_calibration_against_a_real_bench_straggler_run_is_within_three_hundredths():
    cal = calibrate(STRAGGLER_RUN)
    bench = json.loads((STRAGGLER_RUN / "straggler.json").read_text())
    assert cal["inputs"]["peers"] == bench["peers"] == 4 and cal["inputs"]["slow_factor"] == 4.0
    assert cal["ratio"]["sync"]["measured"] == bench["sync_ratio"]  # read from the bench's own figure
    assert all(1.0 < s < 10.0 for s in cal["inputs"]["first_start_s"].values())  # read from the peers' start lines
    covered = [*cal["ratio"].values(), cal["goodput"]["sync_with_slow"], cal["goodput"]["sync_without_slow"]]
    for v in covered:
        assert abs(v["simulated"] - v["measured"]) <= 0.03, v


def test_decoupled_goodput_calibration_against_a_real_bench_straggler_run():
    """With `outer.land_wait`'s waits and the stale steps `outer.rebase_keep` gives up modelled (both on by default,
    as in this run), decoupled goodput lands within ±0.03 of the measured 0.834 and 0.926."""
    cal = calibrate(STRAGGLER_RUN)
    for name in ("decoupled_with_slow", "decoupled_without_slow"):
        v = cal["goodput"][name]
        assert abs(v["simulated"] - v["measured"]) <= 0.03, (name, v)
