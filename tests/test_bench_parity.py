"""`bench parity`'s data-parallel baseline: real gloo ranks on loopback, spawned and reaped."""

from __future__ import annotations

import math

import pytest
import torch

from p2pdiloco.bench.baselines.data_parallel import run_data_parallel
from p2pdiloco.config import load_config, parse_set
from p2pdiloco.training.batches import eval_batches
from p2pdiloco.training.data import load_text
from p2pdiloco.training.evaluation import evaluate_model
from p2pdiloco.training.model import build_model
from tests.conftest import run_children

pytestmark = pytest.mark.integration

TINY_SETS = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "data.batch_size=4",
             "run.eval_batches=2", "data.max_bytes=400000", "run.total_steps=12", "inner.warmup_steps=2"]


def test_two_gloo_ranks_train_in_step_evaluate_like_a_peer_and_are_reaped(tmp_path):
    before = run_children()
    result = run_data_parallel(TINY_SETS, 2, tmp_path, timeout_s=120, eval_every=6)
    assert run_children() == before  # both ranks (and anything they started) are gone
    steps = [s for s, _ in result["eval_curve"]]
    assert steps == [0, 6, 12]
    losses = [loss for _, loss in result["eval_curve"]]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    # ranks read different shards, so only averaged gradients keep their weights bit-identical
    assert len(result["rank_digests"]) == 2 and len(set(result["rank_digests"])) == 1
    assert result["tokens"] == 12 * 4 * 32
    # the baseline's eval is the learner's: same function, same validation batches, same initial model
    cfg = load_config(None, [parse_set(TINY_SETS)])
    val = eval_batches(load_text(cfg.data).val, cfg.model.seq_len, cfg.data.batch_size, cfg.run.eval_batches)
    assert losses[0] == evaluate_model(build_model(cfg.model), val, torch.device("cpu"))


def test_a_failing_rank_fails_the_run_and_is_reaped(tmp_path):
    # 150 training bytes hold two 65-byte windows, so of three shards the first holds none: rank 0 fails
    # at start while ranks 1 and 2 wait for it in the rendezvous
    sets = TINY_SETS + ["model.seq_len=64", "data.max_bytes=300", "data.val_fraction=0.5"]
    before = run_children()
    with pytest.raises(RuntimeError, match="data-parallel ranks failed") as failure:
        run_data_parallel(sets, 3, tmp_path, timeout_s=120)
    assert run_children() == before
    # the error says how far each rank got, from its log: rank 0 joined the group and failed before training
    assert "rank0.log:\n" in str(failure.value) and "joined the group of 3 ranks" in str(failure.value)
