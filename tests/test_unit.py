"""`p2pdiloco peer --nproc 2`: a learner unit of two CPU processes (gloo), data-parallel inner steps, rank 0
alone in the swarm (a real DHT on loopback), the merged model broadcast to rank 1."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from p2pdiloco.training.distributed import rank_shard, strip_nproc
from tests.conftest import interrupt_and_reap, wait_for
from tests.test_cli import TINY

UNIT = [sys.executable, "-m", "p2pdiloco", "peer", "--nproc", "2", "--host", "127.0.0.1",
        "--set", "rounds.round_steps=10", "--set", "run.log_every=5", *TINY]


def _lines(path: Path, kind: str) -> list[dict]:
    if not path.exists():
        return []
    return [r for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip()) if r["kind"] == kind]


def _start(run_dir: Path, steps: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "P2PDILOCO_UNIT_DIGESTS": "1"}
    return subprocess.Popen([*UNIT, "--run-dir", str(run_dir), "--steps", str(steps), *extra], env=env,
                            stdout=(run_dir.parent / "out.txt").open("w"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)


def _descendants(launcher: subprocess.Popen) -> list[psutil.Process]:
    """The launcher's rank processes (once both exist) and everything they started."""
    ranks = wait_for(lambda: len(kids := psutil.Process(launcher.pid).children()) == 2 and kids, 30, what="2 ranks")
    return ranks + [c for r in ranks for c in r.children(recursive=True)]


def _still_running(procs: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _check_ranks_agree(run_dir: Path) -> None:
    r0, r1 = run_dir / "metrics.jsonl", run_dir / "ranks" / "rank1" / "metrics.jsonl"
    sync0 = {r["step"]: r["digest"] for r in _lines(r0, "unit_sync")}
    sync1 = {r["step"]: r["digest"] for r in _lines(r1, "unit_sync")}
    assert len(sync0) >= 5 and sync0 == sync1  # identical parameters before every 5th inner step
    assert [r["digest"] for r in _lines(r0, "unit_end")] == [r["digest"] for r in _lines(r1, "unit_end")]
    # ...although each rank trains on its own slice of the data: DDP averaged their gradients
    loss0 = {r["step"]: r["loss"] for r in _lines(r0, "train")}
    loss1 = {r["step"]: r["loss"] for r in _lines(r1, "train")}
    assert loss0.keys() == loss1.keys() and loss0 != loss1


def test_two_rank_unit_trains_in_step_and_merges(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # sync: each round's merge lands before the next inner step, so 30 steps are exactly 3 rounds; decoupled, a
    # first merge that lands after step 20 (CI under load) leaves 2 rounds of 10 + 20 steps
    launcher = _start(run_dir, 30, "--set", "rounds.sync=true")
    try:
        descendants = _descendants(launcher)
        assert launcher.wait(timeout=150) == 0, (tmp_path / "out.txt").read_text()[-3000:]
    finally:
        interrupt_and_reap(launcher)
    _check_ranks_agree(run_dir)
    summary = json.loads((run_dir / "peer_summary.json").read_text())
    assert summary["processes"] == 2 and summary["rounds"] == 3 and summary["inner_steps"] == 30
    assert summary["tokens"] == 30 * 4 * 32 * 2  # both ranks' batches count
    assert summary["eval_loss_final"] < summary["eval_loss_initial"] - 0.5
    assert len(_lines(run_dir / "metrics.jsonl", "merge")) == 3  # merges (alone) were applied and broadcast
    assert not _still_running(descendants)


def test_ctrl_c_stops_every_rank_with_identical_parameters(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    launcher = _start(run_dir, 100000)
    try:
        descendants = _descendants(launcher)
        wait_for(lambda: len(_lines(run_dir / "metrics.jsonl", "merge")) >= 2, 90, what="two merges")
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=60) == 0, (tmp_path / "out.txt").read_text()[-3000:]
    finally:
        interrupt_and_reap(launcher)
    _check_ranks_agree(run_dir)
    assert not _still_running(descendants)


def test_each_rank_reads_its_own_slice_of_the_peers_shard():
    assert rank_shard("", 1, 2) == "1/2" and rank_shard("2/3", 1, 2) == "5/6" and rank_shard("2/3", 0, 1) == "2/3"
    assert strip_nproc(["peer", "--nproc", "2", "--steps", "5", "--nproc=3"]) == ["peer", "--steps", "5"]


def test_each_rank_takes_its_own_gpu_and_nccl(monkeypatch):
    """The CUDA path of `init_unit`, as far as a machine without a GPU can check it."""
    import torch

    from p2pdiloco.training import distributed
    from p2pdiloco.training.distributed import UnitContext, init_unit

    calls = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("device", d))
    monkeypatch.setattr(distributed.dist, "init_process_group",
                        lambda backend, **kw: calls.update(backend=backend, **kw))
    assert init_unit(UnitContext(rank=3, world_size=4, local_rank=1), torch.device("cuda")) == torch.device("cuda", 1)
    assert calls["device"] == torch.device("cuda", 1) and calls["backend"] == "nccl" and calls["rank"] == 3
    calls.clear()
    assert init_unit(UnitContext(rank=1, world_size=2, local_rank=1), torch.device("cpu")) == torch.device("cpu")
    assert calls["backend"] == "gloo" and calls["world_size"] == 2
    calls.clear()
    assert init_unit(UnitContext(), torch.device("cpu")) == torch.device("cpu") and not calls  # one process
