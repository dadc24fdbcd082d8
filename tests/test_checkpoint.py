"""Checkpoints: atomic writes, damaged files skipped, and a kill mid-write followed by --resume."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from p2pdiloco.training import checkpoint
from p2pdiloco.training.checkpoint import CheckpointWriter, load_latest, save_checkpoint
from tests.test_cli import TINY


def _tensors(x: float) -> dict[str, torch.Tensor]:
    return {"global_params": torch.full((10,), x), "momentum": torch.full((10,), -x)}


def test_newest_good_checkpoint_wins_and_old_ones_are_pruned(tmp_path):
    for r in (1, 2, 3):
        save_checkpoint(tmp_path, r, _tensors(float(r)), {"round": r}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000002.safetensors", "ckpt-00000003.safetensors"]
    tensors, meta, path = load_latest(tmp_path)
    assert meta == {"round": 3} and torch.equal(tensors["global_params"], torch.full((10,), 3.0))


def test_the_background_writer_writes_in_order_one_at_a_time_and_raises_a_failed_write(tmp_path, monkeypatch):
    gate, writing, real_save = threading.Event(), [], checkpoint.save_checkpoint

    def slow_save(folder, round_, *args, **kwargs):
        writing.append(round_)
        assert gate.wait(timeout=10)
        return real_save(folder, round_, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_checkpoint", slow_save)
    writer = CheckpointWriter()
    try:
        writer.submit(tmp_path, 1, _tensors(1.0), {"round": 1})  # returns while round 1 is still being written
        assert writing == [1] and load_latest(tmp_path) is None
        second = threading.Thread(target=writer.submit, args=(tmp_path, 2, _tensors(2.0), {"round": 2}))
        second.start()
        second.join(timeout=0.5)
        assert second.is_alive() and writing == [1]  # the next one waits for the first to be on disk
        gate.set()
        second.join(timeout=10)
        assert writer.wait().name == "ckpt-00000002.safetensors" and writing == [1, 2]
        assert load_latest(tmp_path)[1] == {"round": 2}
        writer.submit(tmp_path / "ckpt-00000002.safetensors", 3, _tensors(3.0), {"round": 3})  # a file, not a folder
        with pytest.raises(OSError):
            writer.wait()
    finally:
        gate.set()
        writer.close()


def test_truncated_or_corrupted_checkpoint_is_skipped(tmp_path):
    save_checkpoint(tmp_path, 1, _tensors(1.0), {"round": 1}, keep=5)
    newest = save_checkpoint(tmp_path, 2, _tensors(2.0), {"round": 2}, keep=5)
    blob = newest.read_bytes()
    newest.write_bytes(blob[: len(blob) // 2])
    assert load_latest(tmp_path)[1] == {"round": 1}
    flipped = bytearray(blob)
    flipped[-1] ^= 0xFF  # same size, one tensor byte changed: only the checksum can tell
    newest.write_bytes(bytes(flipped))
    assert load_latest(tmp_path)[1] == {"round": 1}
    (tmp_path / "ckpt-00000009.safetensors.tmp").write_bytes(b"half")  # a kill mid-write leaves this
    assert load_latest(tmp_path)[1] == {"round": 1}


def test_sigkill_during_checkpoint_write_then_resume_loads_previous_good(tmp_path):
    base = [sys.executable, "-m", "p2pdiloco", "peer", "--host", "127.0.0.1", "--run-dir", str(tmp_path),
            "--sync", "--set", "rounds.round_steps=5", "--set", "run.checkpoint_every=2", *TINY]
    env = {**os.environ, "P2PDILOCO_FAULTS": "@checkpoint:4:kill"}  # "" is the name of an unnamed peer
    out = subprocess.run([*base, "--steps", "40"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == -9, out.stdout[-1000:] + out.stderr[-1000:]
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "ckpt-00000004.safetensors.tmp").exists()  # the half-written one
    assert (ckpts / "ckpt-00000002.safetensors").exists()
    out = subprocess.run([*base, "--steps", "15", "--resume"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "resumed from ckpt-00000002.safetensors: round 2, step 10" in out.stdout
    summary = (tmp_path / "peer_summary.json").read_text()
    assert '"step": 15' in summary and '"inner_steps": 5' in summary  # continued at step 10, ran 5 more


def test_adam_state_round_trips_through_a_checkpoint(tmp_path):
    from p2pdiloco.training.checkpoint import adam_state_flat, load_adam_state_flat

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert adam_state_flat(opt, list(model.parameters())) == {}
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
    save_checkpoint(tmp_path, 1, adam_state_flat(opt, list(model.parameters())), {"round": 1})
    tensors, _, _ = load_latest(tmp_path)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    load_adam_state_flat(fresh, list(model.parameters()), tensors)
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(fresh.state[p][key], opt.state[p][key])
        assert float(fresh.state[p]["step"]) == 3.0
