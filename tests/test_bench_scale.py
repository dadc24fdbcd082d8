"""`bench scale`: its figures from hand-written metrics, the process-tree readings, and one tiny real run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest

from p2pdiloco.bench.proctree import (
    PeerSampler,
    local_peers,
    process_cpu_s,
    process_memory,
    tree_memory,
    tree_pids,
)
from p2pdiloco.bench.scale import add_ratios, bench_scale, memory_at, percentile, run_figures
from tests.conftest import run_children, wait_for

MB = 1_000_000


def _peer(name, dht, merge, wall_s, rounds, compute_cpu_s, eval_loss, phases=(0, 0, 0, 0), agreements=(0, 0, 0)):
    """A peer's summary; `phases`: its (Δ sent, Δ received, agreement sent, agreement received) merge bytes;
    `agreements`: its (state merges, of them caught up, anchored)."""
    return {"name": name, "wall_s": wall_s, "rounds": rounds, "compute_cpu_s": compute_cpu_s,
            "eval_loss_final": eval_loss, "merge_failures": 0,
            "pseudo_grad_bytes_sent": phases[0], "pseudo_grad_bytes_received": phases[1],
            "state_bytes_sent": phases[2], "state_bytes_received": phases[3], "state_merges": agreements[0],
            "state_merges_caught_up": agreements[1], "state_merges_anchored": agreements[2],
            "traffic": {"dht": {"sent": dht[0], "received": dht[1]}, "merge": {"sent": merge[0], "received": merge[1]},
                        "state": {"sent": 0, "received": 0}},
            # most of the DHT's bytes: the rest were pings and keys of no kind here
            "dht_by_kind": {"census": dht[0] // 2, "peer records": dht[1] // 2, "config": 0, "other": 0}}


def _rows(process_s, t_eval, merges, t_final, dht_per_s=0):
    """A peer's metrics lines: start, initial eval, merges as (group_size, merge_s[, match_s]) one second apart, each
    with the DHT bytes so far (`dht_per_s` a second after 500 at the first, half sent, half received), final eval."""
    def dht(i):
        return {"sent": (500 + i * dht_per_s) // 2, "received": (500 + i * dht_per_s) // 2}

    return ([{"kind": "start", "t": t_eval - 1, "process_s": process_s}, {"kind": "eval", "t": t_eval}]
            + [{"kind": "merge", "group_size": m[0], "merge_s": m[1], "elapsed_s": 3.0 + i, "traffic": {"dht": dht(i)},
                **({"match_s": m[2]} if len(m) > 2 else {})} for i, m in enumerate(merges)]
            + [{"kind": "eval", "t": t_final, "final": True}])


SUMMARY = {"peers_finished": 2, "consensus_distance": 0.0, "global_models_identical": True, "peers": [
    _peer("peer0", dht=(600, 400), merge=(3000, 1000), wall_s=10, rounds=4, compute_cpu_s=1.0, eval_loss=2.0,
          phases=(1000, 1000, 1800, 0), agreements=(1, 0, 0)),
    _peer("peer1", dht=(1500, 1500), merge=(6000, 2000), wall_s=10, rounds=4, compute_cpu_s=2.0, eval_loss=3.0,
          phases=(1200, 1200, 4000, 1600), agreements=(3, 1, 1)),
]}
ROWS = {
    "peer0": _rows(4.0, 101.0, [(2, 0.5, 0.25), (1, 0.1, 0.1), (2, 1.5, 0.5), (2, 1.0, 0.2)], 111.0, dht_per_s=40),
    # no match_s in peer1's merge lines (a peer of an older version): left out of the time's split only
    "peer1": _rows(6.0, 102.0, [(2, 0.5), (1, 0.2), (2, 1.5), (3, 2.0)], 112.0, dht_per_s=80),
}
# CPU readings: peer0's inside its training (101..111) are 2.0 at 101.5 and 7.0 at 110.5, peer1's (102..112)
# 1.0 at 102.2 and 11.0 at 111.9: 5 and 10 CPU seconds while training
CPU = {"peer0": [(100.0, 1.0), (101.5, 2.0), (110.5, 7.0), (112.0, 9.0)],
       "peer1": [(101.0, 0.5), (102.2, 1.0), (111.9, 11.0), (113.0, 20.0)]}
# every peer trains from t = 102 to 111, so 60 % of the way is t = 107.4: the sample at 107 is taken, not the one
# at 110 (peer1 is missing from it) nor those outside
MEMORY = [(100.0, {"peer0": {"pss": 1, "uss": 1}, "peer1": {"pss": 1, "uss": 1}}),
          (105.0, {"peer0": {"pss": 2, "uss": 2}, "peer1": {"pss": 2, "uss": 2}}),
          (107.0, {"peer0": {"pss": 100, "uss": 60}, "peer1": {"pss": 300, "uss": 80}}),
          (110.0, {"peer0": {"pss": 3, "uss": 3}})]


def test_percentile_interpolates_between_order_statistics():
    assert percentile([5, 1, 4, 2, 3], 0.95) == pytest.approx(4.8)  # position 3.8 of 0..4
    assert percentile([5, 1, 4, 2, 3], 0.5) == 3
    assert percentile([7.0], 0.95) == 7.0 and percentile([], 0.5) is None


def test_run_figures_from_summary_and_metrics_rows():
    f = run_figures(SUMMARY, ROWS, CPU, MEMORY)
    assert f["dht_bytes_per_s_mean"] == 200 and f["dht_bytes_per_s_max"] == 300  # 1000/10 and 3000/10
    assert f["dht_merging_bytes_per_s"] == 60  # (40 + 80) / 2: the start-up's bytes before the first merge left out
    assert f["dht_census_bytes_per_s"] == 52.5 and f["dht_records_bytes_per_s"] == 47.5  # (30 + 75)/2, (20 + 75)/2
    assert f["merge_bytes_per_round"] == 1500  # (4000/4 + 8000/4) / 2
    # its split: Δ (2000/4 + 2400/4) / 2, agreement (1800/4 + 5600/4) / 2, agreement ÷ all merge bytes 7400/12000
    assert f["delta_bytes_per_round"] == 550 and f["agreement_bytes_per_round"] == 925
    assert f["agreement_share"] == pytest.approx(7400 / 12000)
    assert f["agreements"] == {"all": 4, "caught_up": 1, "anchored": 1, "averaged": 2}
    # group merges' times, sorted: 0.5 0.5 1.0 1.5 1.5 2.0
    assert f["merge_s_median"] == pytest.approx(1.25) and f["merge_s_p95"] == pytest.approx(1.875)
    # peer0's group merges split: matchmaking 0.2 0.25 0.5, exchange (the rest) 0.25 0.8 1.0
    assert f["match_s_median"] == pytest.approx(0.25) and f["match_s_p95"] == pytest.approx(0.475)
    assert f["exchange_s_median"] == pytest.approx(0.8) and f["exchange_s_p95"] == pytest.approx(0.98)
    assert f["group_share"] == 6 / 8 and f["group_sizes"] == {"1": 2, "2": 5, "3": 1}
    assert f["consensus_distance"] == 0.0 and f["global_models_identical"] is True
    assert (f["eval_loss_mean"], f["eval_loss_min"], f["eval_loss_max"]) == (2.5, 2.0, 3.0)
    assert f["startup_s_median"] == 5.0 and f["startup_s_max"] == 6.0
    assert f["memory_at"] == pytest.approx(5 / 9)
    assert (f["pss_median"], f["pss_max"], f["uss_median"], f["uss_max"]) == (200, 300, 70, 80)
    # CPU outside inner steps per round: (5 - 1) / 4 and (10 - 2) / 4
    assert f["cpu_per_round_mean"] == 1.5 and f["cpu_per_round_max"] == 2.0
    assert f["rounds_mean"] == 4 and f["peers_finished"] == 2


def test_merge_bytes_are_not_split_where_a_summary_does_not_split_them():
    older = {**SUMMARY, "peers": [SUMMARY["peers"][0], {k: v for k, v in SUMMARY["peers"][1].items()
                                                         if k != "state_bytes_received"}]}
    f = run_figures(older, ROWS, CPU, MEMORY)
    assert f["merge_bytes_per_round"] == 1500
    assert f["delta_bytes_per_round"] is None and f["agreement_share"] is None and f["agreements"] is None


def test_memory_and_cpu_figures_are_none_without_readings_while_training():
    assert memory_at(MEMORY[:1] + MEMORY[3:], ROWS) is None  # before training, and one peer missing
    assert memory_at(MEMORY, {**ROWS, "peer1": ROWS["peer1"][:-1]}) is None  # peer1 never finished training
    f = run_figures(SUMMARY, ROWS, {"peer0": CPU["peer0"][:2]}, [])  # one reading inside peer0's training
    assert f["pss_median"] is None and f["memory_at"] is None and f["cpu_per_round_mean"] is None


def test_ratios_are_against_the_smallest_swarm():
    small = run_figures(SUMMARY, ROWS, CPU, MEMORY)
    big = {**small, "dht_bytes_per_s_mean": 500, "eval_loss_mean": 2.25, "consensus_distance": 0.1}
    runs = {"8": big, "4": small}
    add_ratios(runs)
    assert runs["4"]["ratios"]["dht_bytes_per_s_mean"] == 1.0
    assert runs["8"]["ratios"]["dht_bytes_per_s_mean"] == 2.5 and runs["8"]["ratios"]["eval_loss_mean"] == 0.9
    assert runs["8"]["ratios"]["consensus_distance"] is None  # ÷ 0


CHILD = "import sys; held = b'x' * 50_000_000; sum(range(5_000_000)); print('ready', flush=True); sys.stdin.read()"


def test_process_tree_memory_and_cpu_of_a_child_that_holds_50_mb():
    child = subprocess.Popen([sys.executable, "-c", CHILD, "--in-local", "--name", "peer7"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert child.pid in tree_pids(os.getpid()) and tree_pids(child.pid) == [child.pid]
        mine, theirs = tree_memory(os.getpid()), process_memory(child.pid)
        assert theirs["uss"] >= 50 * MB and theirs["pss"] >= theirs["uss"]  # its own pages and a share of libc
        assert mine["pss"] >= process_memory(os.getpid())["pss"] + 50 * MB  # the child counts in its parent's tree
        assert process_cpu_s(child.pid) > 0.05
        assert local_peers(os.getpid()) == {"peer7": child.pid}
        with PeerSampler(cpu_every_s=0.1, memory_every_s=0.1) as sampler:
            wait_for(lambda: len(sampler.memory) >= 2, timeout=10, what="two memory samples")
        assert sampler.cpu["peer7"][-1][1] > 0.05 and sampler.memory[-1][1]["peer7"]["uss"] >= 50 * MB
    finally:
        child.stdin.close()
        child.wait(timeout=10)
    assert process_memory(child.pid) == {"pss": 0, "uss": 0} and process_cpu_s(child.pid) is None  # gone


FORKED = ("import os, sys, time; from setproctitle import setproctitle; "
          "setproctitle('python -m p2pdiloco peer --in-local --name peer8 --steps 5'); "
          "pid = os.fork()\nif pid == 0:\n    time.sleep(60); os._exit(0)\n"
          "print(pid, flush=True); sys.stdin.read(); os.kill(pid, 9); os.waitpid(pid, 0)")


def test_a_forked_peer_is_found_by_its_title_and_its_forked_dht_process_is_not_a_peer():
    # a peer forked by `local`'s fork server (title: its command line, one string) -> the DHT process it forks
    peer = subprocess.Popen([sys.executable, "-c", FORKED], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        dht = int(peer.stdout.readline())
        assert psutil.Process(dht).parent().pid == peer.pid
        assert local_peers(os.getpid()) == {"peer8": peer.pid}
    finally:
        peer.stdin.close()
        peer.wait(timeout=10)


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_a_tiny_real_run_of_two_peers(tmp_path):
    before = run_children()
    results = bench_scale(tmp_path, peers=(2,), steps=20, extra_sets=("emulate.min_step_s=0.2",))
    assert run_children() == before
    assert results["step_s"] == 0.2 and results["round_s"] == 3.0  # --set over the bench's own settings
    run = results["runs"]["2"]
    assert run["peers_finished"] == 2 and run["rounds_mean"] >= 1 and run["group_share"] > 0
    assert run["dht_bytes_per_s_mean"] > 0 and run["merge_bytes_per_round"] > 0
    assert run["dht_census_bytes_per_s"] > 0 and run["dht_records_bytes_per_s"] > 0  # told apart by key
    # the merge bytes split by phase, as the peers counted them: the Δ exchange is most of them; the rest is
    # matchmaking and, where the two peers' global models differed, agreements
    assert 0 < run["delta_bytes_per_round"] < run["merge_bytes_per_round"]
    assert run["agreement_bytes_per_round"] is not None and 0 <= run["agreement_share"] < 1
    # a group merge's time splits into waiting for the group and the exchange, both measured by the peers
    assert 0 < run["match_s_median"] <= run["merge_s_median"] and run["exchange_s_median"] > 0
    # CPU outside inner steps: process CPU read once a second minus the thread's exact inner-step CPU, so a
    # 20-step run can come out a few ms either side of its true value; here only that it was measured
    assert run["cpu_per_round_mean"] is not None and run["startup_s_median"] > 0
    assert all(r == 1.0 for r in run["ratios"].values() if r is not None)
    assert json.loads((tmp_path / "scale.json").read_text())["runs"]["2"]["peers_finished"] == 2
    assert (tmp_path / "scale.png").stat().st_size > 0


def test_peers_takes_a_list_of_positive_integers_and_errors_name_the_flag():
    from p2pdiloco.bench.cli import _one_int, _positive_ints
    from p2pdiloco.cli import build_parser
    from p2pdiloco.config import ConfigError

    args = build_parser().parse_args(["bench", "scale", "--peers", "4,8", "--group-size", "4", "--steps", "50",
                                      "--set", "rounds.round_seconds=10"])
    assert _positive_ints(args.peers, "--peers") == (4, 8) and args.group_size == 4 and args.steps == 50
    assert args.sets == ["rounds.round_seconds=10"]
    with pytest.raises(ConfigError, match="--peers takes positive integers"):
        _positive_ints("4,0", "--peers")
    with pytest.raises(ConfigError, match="takes one --peers"):
        _one_int("2,3", "--peers")
