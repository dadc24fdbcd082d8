"""Peers on different hardware in one swarm: one trains in fp32, one under bf16 autocast (on CPU here),
and one with bitsandbytes' 8-bit AdamW; what they merge is fp32 on CPU, so they end with one global model."""

import logging
import threading

import torch

from p2pdiloco.config import load_config, parse_set
from p2pdiloco.testing.inmemory import InMemoryMerger
from p2pdiloco.training.checkpoint import (
    load_latest,
    load_optimizer_state,
    optimizer_state_tensors,
    save_checkpoint,
)
from p2pdiloco.training.learner import Learner
from p2pdiloco.training.model import build_model
from p2pdiloco.training.reporting import MetricsLog


def _cfg(*extra):
    items = ["model.n_layer=1", "model.d_model=64", "model.n_head=2", "model.seq_len=16", "data.batch_size=4",
             "rounds.round_steps=5", "run.total_steps=30", "run.log_every=5", "inner.warmup_steps=2", "inner.lr=3e-3"]
    return load_config(None, [parse_set(items + list(extra))])


def _batches(seed):
    g = torch.Generator().manual_seed(seed)

    def next_batch():  # a learnable pattern: repeating ramps, offset per peer
        start = torch.randint(0, 200, (4, 1), generator=g)
        seq = (start + torch.arange(17)) % 256
        return seq[:, :-1].long(), seq[:, 1:].long()

    return next_batch


class RecordingMerger(InMemoryMerger):
    """The in-memory merger, keeping what this peer submitted."""

    def __init__(self, peer_id, hub):
        super().__init__(peer_id, hub)
        self.submitted = []

    def submit(self, contribution):
        self.submitted.append(contribution)
        return super().submit(contribution)


def _learner(cfg, merger, tmp_path, seed):
    val = [_batches(99)() for _ in range(2)]
    return Learner(cfg, build_model(cfg.model), _batches(seed), val, merger, torch.device("cpu"),
                   MetricsLog(tmp_path / f"{merger.peer_id}.jsonl"))


def _run_together(learners):
    summaries = [None] * len(learners)

    def run(i):
        summaries[i] = learners[i].run()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(learners))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(s is not None for s in summaries), "a learner did not finish"
    return summaries


def test_fp32_bf16_and_8bit_peers_merge_to_one_global_model(tmp_path):
    hub = {"group_size": 3}
    # sync rounds: the in-memory merger needs every peer's round r before any peer's round r lands
    configs = [_cfg("run.precision=fp32", "rounds.sync=true"), _cfg("run.precision=bf16", "rounds.sync=true"),
               _cfg("inner.optimizer=adamw8bit", "rounds.sync=true")]
    mergers = [RecordingMerger(f"p{i}", hub) for i in range(3)]
    learners = [_learner(c, m, tmp_path, i) for i, (c, m) in enumerate(zip(configs, mergers, strict=True))]
    seen = []  # the bf16 peer's forward really runs in bf16: the output dtype of its first linear layer
    learners[1].model.blocks[0].attn.c_attn.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    summaries = _run_together(learners)
    assert torch.bfloat16 in seen
    assert [s["precision"] for s in summaries] == ["float32", "bfloat16", "float32"]
    assert [s["optimizer"] for s in summaries] == ["adamw", "adamw", "adamw8bit"]
    for s in summaries:
        assert s["rounds"] == 6 and s["merges"] == 6
        assert s["eval_loss_final"] < s["eval_loss_initial"] - 0.5
        assert s["tokens_per_s"] > 0 and s["model_flops_per_s"] > 0 and s["mfu"] is None  # CPU: peak unknown
        assert s["peak_host_bytes"] > 0 and s["peak_device_bytes"] is None
    for learner in learners[1:]:
        assert torch.equal(learner.global_params, learners[0].global_params)
        assert torch.equal(learner.momentum, learners[0].momentum)
    for learner in learners:  # outer state and everything merged: fp32, on CPU
        assert learner.global_params.dtype == learner.momentum.dtype == torch.float32
        assert learner.global_params.device.type == learner.momentum.device.type == "cpu"
    for merger in mergers:
        for c in merger.submitted:
            assert c.pseudo_grad.dtype == torch.float32 and c.pseudo_grad.device.type == "cpu"


def test_8bit_adamw_state_checkpoints_and_resumes_bit_for_bit(tmp_path):
    cfg = _cfg("inner.optimizer=adamw8bit", "model.d_model=128")  # 128x384 weights get 8-bit state
    a = _learner(cfg, InMemoryMerger("a", {"group_size": 1}), tmp_path, 0)
    for _ in range(3):
        a.inner_step()
    params = list(a.model.parameters())
    save_checkpoint(tmp_path / "ckpt", 1, optimizer_state_tensors(a.opt, params), {"round": 1})
    tensors, _, _ = load_latest(tmp_path / "ckpt")
    assert any(v.dtype == torch.uint8 for v in tensors.values()), "no 8-bit state was saved"
    b = _learner(cfg, InMemoryMerger("b", {"group_size": 1}), tmp_path, 0)
    with torch.no_grad():
        for pb, pa in zip(b.model.parameters(), params, strict=True):
            pb.copy_(pa)
    load_optimizer_state(b.opt, list(b.model.parameters()), tensors)
    b.c.step = a.c.step
    b.next_batch = a.next_batch = _batches(5)  # one batch stream, consumed in turn: same batch for each
    state = torch.get_rng_state()
    a.inner_step()
    torch.set_rng_state(state)
    b.next_batch = _batches(5)
    b.inner_step()
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_optimizer_change_between_runs_starts_fresh_with_a_warning(tmp_path, caplog):
    adam = _learner(_cfg(), InMemoryMerger("a", {"group_size": 1}), tmp_path, 0)
    adam.inner_step()
    saved = optimizer_state_tensors(adam.opt, list(adam.model.parameters()))
    eight = _learner(_cfg("inner.optimizer=adamw8bit"), InMemoryMerger("b", {"group_size": 1}), tmp_path, 0)
    with caplog.at_level(logging.WARNING):
        load_optimizer_state(eight.opt, list(eight.model.parameters()), saved)
    assert "starts fresh" in caplog.text and len(eight.opt.state) == 0
