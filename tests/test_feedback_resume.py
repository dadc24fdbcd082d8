"""Error feedback is the learner's state: a checkpoint holds the residual, and a peer killed after a checkpoint and
resumed from it sends the same next pseudo-gradient, bit for bit, as one that was not killed.

The merger here is a test double that sends each contribution through the real default codec (int4, lossy) and
returns what came out as the group's average, so that every round leaves a residual, as a real group merge does.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from p2pdiloco.algorithm.codecs import get_codec
from p2pdiloco.config import load_config, parse_set
from p2pdiloco.network.merger import Alone, Contribution, Merged, MergeOutcome, MergeStats
from p2pdiloco.training.checkpoint import RESIDUAL, load_checkpoint
from p2pdiloco.training.learner import Learner
from p2pdiloco.training.model import build_model
from p2pdiloco.training.reporting import MetricsLog

STEPS, ROUND = 20, 5


class CodedMerger:
    """A merge with a mate that sent the same: the average is this peer's compensated Δ through the codec.

    Args:
        peer_id: this peer's id.
        alone_rounds: rounds (the contribution's `round`) that merge alone instead.
    """

    def __init__(self, peer_id: str, alone_rounds: frozenset[int] = frozenset()):
        self.peer_id, self.alone_rounds = peer_id, alone_rounds
        self.codec = get_codec("int4")
        self.offered: list[Contribution] = []

    def submit(self, c: Contribution) -> Future[MergeOutcome]:
        self.offered.append(c)
        future: Future[MergeOutcome] = Future()
        if c.round in self.alone_rounds:
            future.set_result(Alone("a mate left", MergeStats(group=[self.peer_id])))
            return future
        target = c.pseudo_grad if c.compensated is None else c.compensated
        held = self.codec.decode(self.codec.encode(target), target.numel())
        future.set_result(Merged(held, 2 * c.weight, final=c.final, sent=held,
                                 stats=MergeStats(group=[self.peer_id, "mate"])))
        return future

    def take_round_shift(self) -> float:
        return 0.0

    def stop_looking(self) -> None:
        pass

    def close(self) -> None:
        pass


def _cfg():
    items = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=16", "data.batch_size=4",
             f"rounds.round_steps={ROUND}", f"run.total_steps={STEPS}", "run.log_every=5", "inner.warmup_steps=2",
             "inner.lr=3e-3", "rounds.sync=true", "run.checkpoint_every=1", "run.eval_every_rounds=0"]
    cfg = load_config(None, [parse_set(items)])
    assert cfg.codec.name == "int4" and cfg.codec.error_feedback  # the defaults: lossy, with error feedback
    return cfg


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        seq = (torch.randint(0, 200, (4, 1), generator=g) + torch.arange(17)) % 256
        out.append((seq[:, :-1].long(), seq[:, 1:].long()))
    return out


def _learner(merger, tmp_path, first_step: int = 0) -> Learner:
    cfg, batches = _cfg(), iter(_batches()[first_step:])
    val = _batches()[:2]
    learner = Learner(cfg, build_model(cfg.model), lambda: next(batches), val, merger, torch.device("cpu"),
                      MetricsLog(tmp_path / f"{merger.peer_id}.jsonl"), checkpoint_dir=tmp_path / merger.peer_id)
    return learner


def test_a_peer_resumed_from_a_checkpoint_sends_the_same_next_pseudo_gradient_as_one_never_killed(tmp_path):
    steady = CodedMerger("steady")
    _learner(steady, tmp_path).run()  # 4 rounds, a checkpoint after each (the newest two kept)
    assert len(steady.offered) == STEPS // ROUND
    tensors, meta = load_checkpoint(tmp_path / "steady" / "ckpt-00000003.safetensors")
    assert RESIDUAL in tensors and float(tensors[RESIDUAL].abs().max()) > 0  # int4 left a residual

    resumed = CodedMerger("resumed")  # killed after the third round's checkpoint, restarted from it
    learner = _learner(resumed, tmp_path, first_step=int(meta["step"]))
    learner.restore(tensors, meta)
    learner.run()
    before, after = steady.offered[3], resumed.offered[0]
    assert torch.equal(after.pseudo_grad, before.pseudo_grad)  # the same Δ: same θg, optimizer and data
    assert not torch.equal(before.compensated, before.pseudo_grad)  # the residual is part of what is sent
    assert torch.equal(after.compensated, before.compensated)  # and it survived the restart

    forgetful = CodedMerger("forgetful")  # the same restart from a checkpoint that holds no residual (an old one)
    learner = _learner(forgetful, tmp_path, first_step=int(meta["step"]))
    learner.restore({k: v for k, v in tensors.items() if k != RESIDUAL}, meta)
    assert learner.feedback.residual is None  # a zero residual: it still loads
    learner.run()
    assert torch.equal(forgetful.offered[0].compensated, before.pseudo_grad)


def test_a_merge_alone_keeps_the_residual_and_a_group_merge_commits_what_was_sent(tmp_path):
    merger = CodedMerger("p", alone_rounds=frozenset({1}))
    learner = _learner(merger, tmp_path)
    learner.run()
    first, alone, after = merger.offered[:3]
    residual_1 = first.compensated - merger.codec.decode(merger.codec.encode(first.compensated), first.pseudo_grad.numel())
    assert torch.equal(alone.compensated, alone.pseudo_grad + residual_1)  # round 0's residual carried in
    assert torch.equal(after.compensated, after.pseudo_grad + residual_1)  # round 1 went alone: still round 0's
