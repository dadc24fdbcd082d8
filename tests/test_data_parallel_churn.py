"""The data-parallel baseline under churn (bench churn): real gloo ranks, a real SIGKILL, a restart from the
last checkpoint, and goodput from what the ranks recorded."""

import pytest

from p2pdiloco.bench.baselines.data_parallel_churn import goodput_from_progress, run_data_parallel_churn
from tests.conftest import run_children


def test_steps_after_the_checkpoint_a_restart_resumed_from_are_lost():
    progress = [
        {"kind": "start", "inc": 0, "step": 0},
        {"kind": "checkpoint", "inc": 0, "step": 10, "compute_s": 1.0},
        {"kind": "checkpoint", "inc": 0, "step": 20, "compute_s": 2.0},  # killed at ~25: 20→25 is redone
        {"kind": "start", "inc": 1, "step": 20},  # killed before its first checkpoint: nothing reached
        {"kind": "start", "inc": 2, "step": 20},
        {"kind": "checkpoint", "inc": 2, "step": 30, "compute_s": 1.5},
    ]
    got = goodput_from_progress(progress, spent_s=10.0)
    assert got == {"reached_s": 3.5, "spent_s": 10.0, "incarnations": 3}


@pytest.mark.parametrize("forked", [False, True], ids=["spawned", "forked"])
def test_a_killed_rank_stops_the_job_and_every_rank_restarts_from_the_checkpoint(tmp_path, forked):
    sets = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "data.batch_size=4",
            "data.max_bytes=200000", "run.total_steps=80", "emulate.min_step_s=0.05", "run.eval_batches=2",
            "inner.warmup_steps=2"]
    before = run_children()
    got = run_data_parallel_churn(sets, 2, tmp_path, kill_every=2.0, restart_delay=0.5, checkpoint_every=10,
                                  max_kills=1, timeout_s=150, forked=forked)
    assert got["kills"] == 1 and got["incarnations"] == 2 and got["steps"] == 80
    # every step of the final model was computed once at least (80 steps x 0.05 s on each of 2 ranks) ...
    assert got["reached_s"] >= 2 * 80 * 0.05 * 0.99
    # ... and the start-ups, the lost steps and the wait for the restart were spent too
    assert got["reached_s"] < got["spent_s"] and 0 < got["goodput"] < 1
    assert got["eval_loss"] > 0
    assert run_children() == before  # every rank reaped
    assert not list(tmp_path.glob("rendezvous.*"))


def test_without_kills_the_baseline_wastes_only_its_start_up(tmp_path):
    sets = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "data.batch_size=4",
            "data.max_bytes=200000", "run.total_steps=40", "emulate.min_step_s=0.05", "run.eval_batches=2"]
    got = run_data_parallel_churn(sets, 2, tmp_path, kill_every=0.0, checkpoint_every=10, timeout_s=120)
    assert got["kills"] == 0 and got["incarnations"] == 1
    assert got["reached_s"] >= 2 * 40 * 0.05 * 0.99 and got["goodput"] < 1
