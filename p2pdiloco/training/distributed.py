"""A learner unit of many processes: `p2pdiloco peer --nproc N`, or the same command under torchrun.

The unit is one peer of the swarm. Rank 0 is the peer proper: it runs the DHT, the merger, the heartbeat and
the checkpoints. Every rank runs the inner steps on its own slice of the peer's data, with gradients averaged
across ranks by DDP, so the unit trains like one peer with N times the batch, and the ranks' models and
inner optimizers stay identical by construction.

Rank 0 leads, the others follow, through one hook in the learner's loop (`UnitSync.lead`): before each inner
step rank 0 broadcasts a command (step or stop) and its step counter; when a merge or a downloaded state
changed its model since the last command, it broadcasts its parameters too, and the followers copy them.
Only the parameters travel: gradients are the same on every rank after DDP's all-reduce, so the optimizer
states never diverge. Followers never touch the network or the run folder beyond their own metrics.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from p2pdiloco.config import Config
from p2pdiloco.training.accel import compile_for_training

logger = logging.getLogger(__name__)

STEP, STOP = 1, 0
DIGESTS_ENV = "P2PDILOCO_UNIT_DIGESTS"
"""Test hook: when set, every rank logs a digest of its parameters every `run.log_every` steps."""


@dataclass
class UnitContext:
    """Where this process stands in its learner unit (torchrun's environment variables)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def context_from_env() -> UnitContext:
    """RANK, WORLD_SIZE and LOCAL_RANK as torchrun (or `launch_unit`) sets them; one process without them."""
    env = os.environ
    return UnitContext(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))


def init_unit(ctx: UnitContext, device: torch.device, timeout_s: float = 3600.0) -> torch.device:
    """Join the unit's process group (nccl on CUDA, gloo elsewhere); returns this rank's device.

    Args:
        ctx: this process's place in the unit.
        device: the device `run.device` picked; on CUDA each rank takes GPU `local_rank`.
        timeout_s: longest a rank waits in a collective: followers wait there while rank 0 evaluates, merges
            in sync mode or waits for peers, so it is long.
    """
    if ctx.world_size <= 1:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", ctx.local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=ctx.rank, world_size=ctx.world_size, timeout=timedelta(seconds=timeout_s))
    logger.info("rank %d of %d on %s (%s)", ctx.rank, ctx.world_size, device, backend)
    return device


def close_unit(ctx: UnitContext, timeout_s: float = 120.0) -> None:
    """Tear the unit's process group down on every rank together.

    A follower that destroyed its gloo group while rank 0 was still finishing (final merge, checkpoint) was once
    seen to abort at exit ("terminate called without an active exception", CI, 1 run in 4). Ranks first meet
    at a barrier (bounded: a rank that died makes it fail, and we tear down anyway), and DDP's reducers are
    collected before the group they use goes away.
    """
    if ctx.world_size > 1 and dist.is_initialized():
        gc.collect()
        try:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=timedelta(seconds=timeout_s))
            else:
                dist.barrier()
        except Exception as e:  # another rank is gone: nothing to wait for
            logger.warning("rank %d: the unit did not meet before closing: %r", ctx.rank, e)
        dist.destroy_process_group()


def rank_shard(shard: str, rank: int, world_size: int) -> str:
    """This rank's slice of the peer's data: the peer's shard 'i/n' (or all text, '0/1') cut in `world_size`."""
    if world_size <= 1:
        return shard
    i, n = (int(x) for x in shard.split("/")) if shard else (0, 1)
    return f"{i * world_size + rank}/{n * world_size}"


def params_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class UnitSync:
    """The learner's hook into its unit (see the module docstring).

    Args:
        ctx: this process's place in the unit.
        device: this rank's device (collectives run there: nccl needs CUDA tensors).
    """

    def __init__(self, ctx: UnitContext, device: torch.device):
        self.ctx, self.device = ctx, device
        self._synced = None
        self._digests = bool(os.environ.get(DIGESTS_ENV))

    def attach(self, learner) -> None:
        """Wrap the learner's model in DDP (a collective: every rank calls it at the same point)."""
        ids = [self.device.index] if self.device.type == "cuda" else None
        learner.train_model = DistributedDataParallel(learner.model, device_ids=ids)
        if learner.cfg.run.compile:  # torch.compile supports a DDP module (it splits graphs at its buckets)
            learner.train_model = compile_for_training(learner.train_model, learner.tag)
        learner.report.data_parallel = self.ctx.world_size
        if self.ctx.is_main:
            learner.unit = self
        self._synced = (learner.shared, learner.model_moved)

    def lead(self, learner) -> None:
        """Rank 0, before each inner step: tell the followers to step, from our θ if it changed."""
        self._command(learner, STEP)

    def release(self, learner) -> None:
        """Rank 0, at the end: the followers take the final θ and stop."""
        self._command(learner, STOP)

    def _command(self, learner, command: int) -> None:
        now = (learner.shared, learner.model_moved)  # a merge, an adopted state or an eager update moved θ
        resync = now[0] is not self._synced[0] or now[1] != self._synced[1]
        ctrl = torch.tensor([command, int(resync), learner.c.step], dtype=torch.int64, device=self.device)
        dist.broadcast(ctrl, 0)
        if resync:
            self._broadcast_params(learner)
            self._synced = now
        self._note(learner, command)

    def follow(self, learner) -> None:
        """Ranks > 0: step when rank 0 says so, take its θ when it sends one, until it says stop."""
        while True:
            ctrl = torch.zeros(3, dtype=torch.int64, device=self.device)
            dist.broadcast(ctrl, 0)
            command, resync, step = (int(v) for v in ctrl.cpu())
            if resync:
                self._broadcast_params(learner)
            learner.c.step = step  # the learning-rate schedule's position (a joining rank 0 may jump)
            self._note(learner, command)
            if command == STOP:
                return
            learner.inner_step()

    @torch.no_grad()
    def _broadcast_params(self, learner) -> None:
        for p in learner.model.parameters():  # one tensor at a time: no second copy of a large model
            dist.broadcast(p.data, 0)

    def _note(self, learner, command: int) -> None:
        if command == STOP:
            learner.metrics.write(kind="unit_end", rank=self.ctx.rank, step=learner.c.step,
                                  digest=params_digest(learner.model))
        elif self._digests and learner.c.step % learner.cfg.run.log_every == 0:
            learner.metrics.write(kind="unit_sync", rank=self.ctx.rank, step=learner.c.step,
                                  digest=params_digest(learner.model))


class _NoMerger:
    """A follower's stand-in merger: followers never merge (rank 0 does, for the unit)."""

    def __init__(self, rank: int):
        self.peer_id = f"rank{rank}"

    def submit(self, contribution) -> Future:
        raise RuntimeError("a follower rank does not merge")

    def take_round_shift(self) -> float:
        return 0.0

    def stop_looking(self) -> None:
        pass

    def close(self) -> None:
        pass


def run_follower(cfg: Config, ctx: UnitContext, device: torch.device) -> None:
    """A rank > 0: the same data (its own slice), model and optimizer as rank 0, stepping when rank 0 says."""
    from p2pdiloco.training.batches import BatchSampler
    from p2pdiloco.training.checkpoint import load_latest
    from p2pdiloco.training.corpus import load_corpus
    from p2pdiloco.training.learner import Learner
    from p2pdiloco.training.model import build_model
    from p2pdiloco.training.reporting import MetricsLog
    from p2pdiloco.training.tokenizer import load_tokenizer

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the unit stops; we follow it
    data = load_corpus(cfg.data, load_tokenizer(cfg.data.tokenizer), min_tokens=2 * (cfg.model.seq_len + 1))
    sampler = BatchSampler(data.train, cfg.model.seq_len, cfg.data.batch_size, cfg.run.seed,
                           rank_shard(cfg.data.shard, ctx.rank, ctx.world_size))
    run_dir = Path(cfg.run.run_dir) / "ranks" / f"rank{ctx.rank}"
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    try:
        learner = Learner(cfg, build_model(cfg.model).to(device), sampler.next_batch, [], _NoMerger(ctx.rank),
                          device, metrics)
        unit = UnitSync(ctx, device)
        unit.attach(learner)
        if cfg.run.resume:  # the inner optimizer's state is not broadcast: take it from rank 0's checkpoint
            found = load_latest(Path(cfg.run.run_dir) / "checkpoints")
            if found is not None:
                learner.restore(found[0], found[1])
        unit.follow(learner)
        logger.info("rank %d: %d inner steps, stopped with rank 0", ctx.rank, learner.c.steps_run)
    finally:
        metrics.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In a child before exec: its own process group (a terminal's Ctrl+C reaches the launcher only, which
    passes one SIGINT to rank 0), and SIGKILL if the launcher dies (Linux), so no rank outlives it."""
    os.setpgrp()
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def strip_nproc(argv: list[str]) -> list[str]:
    """`argv` without `--nproc N` / `--nproc=N`."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def launch_unit(nproc: int, argv: list[str], grace_s: float = 60.0) -> int:
    """Run `p2pdiloco ARGV` (a `peer` command line) as `nproc` ranks on this machine (as torchrun would) and reap them.

    Ctrl+C or SIGTERM here is passed to rank 0 as one SIGINT (a second one, as a second SIGINT: stop at
    once); rank 0 then stops the unit. If a follower fails, rank 0 is told to stop and the ranks get `grace_s`
    seconds to exit; followers left after rank 0 has exited get 10 s. Then they are killed. Returns the first
    non-zero exit status, else 0.
    """
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc)}
    procs: list[subprocess.Popen] = []
    signals: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _f: signals.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank in range(nproc):
            procs.append(subprocess.Popen([sys.executable, "-m", "p2pdiloco", *argv],
                                          env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                          preexec_fn=_die_with_parent))
        forwarded, ending_since = 0, None
        while any(p.poll() is None for p in procs):
            while forwarded < len(signals) and procs[0].poll() is None:
                procs[0].send_signal(signal.SIGINT)
                forwarded += 1
            failed = any(p.poll() not in (None, 0) for p in procs)
            if (failed or procs[0].poll() is not None) and ending_since is None:
                ending_since = time.monotonic()
                if procs[0].poll() is None:
                    procs[0].send_signal(signal.SIGINT)  # a follower failed: rank 0 stops the unit cleanly
            # followers outlive a finished rank 0 only when stuck (they stop before rank 0 writes its results)
            limit = min(grace_s, 10.0) if procs[0].poll() is not None else grace_s
            if ending_since is not None and time.monotonic() - ending_since > limit:
                break
            time.sleep(0.2)  # polling children, with the deadline above
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for s, handler in previous.items():
            signal.signal(s, handler)
    codes = [p.returncode for p in procs]
    logger.info("learner unit ended: exit codes %s", codes)
    return next((c for c in codes if c != 0), 0)
