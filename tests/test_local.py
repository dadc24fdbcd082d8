"""`p2pdiloco local` end to end: a bootstrap node and three peer processes on loopback."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections import defaultdict

import psutil
import pytest
import torch

from tests.conftest import kill_quietly, wait_for
from tests.test_cli import TINY

pytestmark = pytest.mark.integration


def test_three_peer_swarm_merges_agrees_and_learns(tmp_path):
    # synchronous DiLoCo, so that the number of rounds is known: one merge every 15 steps
    out = subprocess.run(
        [sys.executable, "-m", "p2pdiloco", "local", "--peers", "3", "--steps", "60", "--run-dir", str(tmp_path),
         "--set", "rounds.round_steps=15", "--set", "codec.name=none", "--sync", *TINY],
        capture_output=True, text=True, timeout=170, stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    # what the peers did while they started, from their logs' progress lines, until they trained
    # the first state shown depends on how far the forked peers got before `local` first read their logs
    assert re.search(r"peers starting: [1-3]/3 [a-zA-Z]", out.stdout), out.stdout[-2000:]
    assert re.search(r"peers started: [1-3]/3 training", out.stdout), out.stdout[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["peers_finished"] == 3
    assert summary["eval_loss_final"] < summary["eval_loss_initial"] - 0.3
    assert summary["global_models_identical"] is True
    assert summary["consensus_distance"] == 0.0
    for peer in summary["peers"]:
        for key in ("peer_id", "inner_steps", "tokens", "rounds", "merges", "bytes_sent", "bytes_received",
                    "wall_s", "compute_s"):
            assert key in peer
        assert peer["inner_steps"] == 60 and peer["rounds"] == 4 and peer["merges"] >= 1
        assert peer["bytes_sent"] > 0 and peer["bytes_received"] > 0
        traffic = peer["traffic"]
        # nobody downloaded a state: besides merges, a peer sent only its dial-back check's request (counted with
        # the state transfers: both are start-up traffic)
        assert traffic["merge"]["sent"] + traffic["state"]["sent"] == peer["bytes_sent"] and traffic["dht"]["sent"] > 0
        assert 0 < traffic["state"]["sent"] < 200
        # fp32 merges every 15 steps: about 15x less than a ring all-reduce of every step's gradients
        assert peer["ddp_bytes_per_step"] == pytest.approx(2 * 2 / 3 * peer["n_params"] * 4)
        assert 5 < peer["bandwidth_ratio_vs_ddp"] < 15
        assert peer["bandwidth_ratio_vs_ddp_with_dht"] < peer["bandwidth_ratio_vs_ddp"]
    assert 5 < summary["bandwidth_ratio_vs_ddp"] < 15
    assert summary["config"]["rounds"]["round_steps"] == 15
    # every member of a merge group ends it holding the same global model, bit for bit
    digests = defaultdict(set)
    for i in range(3):
        for line in (tmp_path / "peers" / f"peer{i}" / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            if row["kind"] == "merge" and row["group_size"] > 1:
                digests[row["group_id"]].add(row["global_digest"])
    assert digests and all(len(d) == 1 for d in digests.values())
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_ctrl_c_on_local_leaves_no_process(tmp_path):
    # started as a shell starts a background job (nohup, `cmd &`, CI runners): SIGINT inherited *ignored*, in
    # which case Python installs no KeyboardInterrupt handler of its own; `local` must still stop on it
    proc = subprocess.Popen(
        [sys.executable, "-m", "p2pdiloco", "local", "--peers", "2", "--steps", "100000", "--run-dir", str(tmp_path),
         *TINY], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    descendants = []
    try:
        metrics = [tmp_path / "peers" / f"peer{i}" / "metrics.jsonl" for i in range(2)]
        wait_for(lambda: all(m.exists() and '"train"' in m.read_text() for m in metrics), 90, what="both peers training")
        descendants = psutil.Process(proc.pid).children(recursive=True)
        assert len(descendants) >= 4  # peers, their DHT processes and p2p daemons
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=45) is not None
        _, alive = psutil.wait_procs(descendants, timeout=10)
        assert not alive, f"left running: {[p.name() for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_quietly(descendants)  # a failed run must not leave its peers training, orphaned, for the next tests


def test_consensus_distance_is_the_largest_relative_gap(tmp_path):
    from safetensors.torch import save_file

    from p2pdiloco.app.summary import consensus_distance

    for name, values in (("a", [3.0, 4.0]), ("b", [3.0, 4.0]), ("c", [0.0, 4.0])):
        (tmp_path / name).mkdir()
        save_file({"w": torch.tensor(values)}, str(tmp_path / name / "model.safetensors"))
    # ‖a − c‖ = 3, mean norm (5 + 4) / 2 = 4.5
    assert abs(consensus_distance([tmp_path / n for n in "abc"]) - 3 / 4.5) < 1e-9
    assert consensus_distance([tmp_path / "a", tmp_path / "b"]) == 0.0
    assert consensus_distance([tmp_path / "a"]) is None


def test_final_models_say_identical_within_tolerance_or_apart():
    from p2pdiloco.app.summary import final_models

    def peer(digest, loss):
        return {"global_digest": digest, "eval_loss_final": loss}

    assert final_models([peer("d", 1.6), peer("d", 1.6)]) == ("identical", 0.0)
    which, spread = final_models([peer("d", 1.60), peer("e", 1.61)])  # 0.625 % apart
    assert which == "within tolerance" and abs(spread - 0.01 / 1.6) < 1e-12
    which, spread = final_models([peer("d", 1.60), peer("e", 1.62), peer("f", 1.65)])  # 3.1 %
    assert which == "apart" and abs(spread - 0.05 / 1.6) < 1e-12
    assert final_models([]) == ("none", None)


def test_a_peer_restarted_after_the_swarm_finished_is_not_the_runs_result(tmp_path):
    # `local --chaos` restarted a killed peer after the other three had finished: it found the run over, kept the
    # model it had, and the run's summary said "apart"
    from safetensors.torch import save_file

    from p2pdiloco.app.summary import summarize

    for name, values, digest, loss, late in (("a", [3.0, 4.0], "d", 1.6, False), ("b", [3.0, 4.0], "d", 1.6, False),
                                             ("c", [0.0, 4.0], "init", 5.4, True)):
        (tmp_path / name).mkdir()
        save_file({"w": torch.tensor(values)}, str(tmp_path / name / "model.safetensors"))
        (tmp_path / name / "peer_summary.json").write_text(json.dumps(
            {"global_digest": digest, "eval_loss_initial": 5.4, "eval_loss_final": loss, "arrived_after_end": late}))
    summary = summarize(tmp_path, [tmp_path / n for n in "abc"], {}, 1.0)
    assert summary["final_models"] == "identical" and summary["global_models_identical"] is True
    assert summary["consensus_distance"] == 0.0 and summary["eval_loss_final"] == 1.6
    assert summary["arrived_after_end"] == 1 and summary["peers_finished"] == 3
    # without the flag the same three peers are apart: the flag, not the files, makes the difference
    summary_c = json.loads((tmp_path / "c" / "peer_summary.json").read_text())
    (tmp_path / "c" / "peer_summary.json").write_text(json.dumps({**summary_c, "arrived_after_end": False}))
    summary = summarize(tmp_path, [tmp_path / n for n in "abc"], {}, 1.0)
    assert summary["final_models"] == "apart" and summary["arrived_after_end"] == 0
    assert summary["consensus_distance"] > 0.5


def test_ctrl_c_on_a_benchmark_stops_it_and_writes_no_figures(tmp_path):
    # before: the interrupted swarm was stopped, the bench went on to its next run and then wrote churn.json
    # with the cut-short run's figures in it
    proc = subprocess.Popen([sys.executable, "-m", "p2pdiloco", "bench", "churn", "--minutes", "5", "--out",
                             str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL)
    descendants = []
    try:
        metrics = [tmp_path / "decoupled_churn" / "peers" / f"peer{i}" / "metrics.jsonl" for i in range(4)]
        wait_for(lambda: all(m.exists() and '"train"' in m.read_text() for m in metrics), 120,
                 what="the first run's peers training")
        descendants = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        _, alive = psutil.wait_procs(descendants, timeout=10)
        assert not alive, f"left running: {[p.name() for p in alive]}"
        assert not (tmp_path / "churn.json").exists() and not (tmp_path / "sync_churn").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_quietly(descendants)
