"""The data-parallel baseline: N torch.distributed ranks (gloo, loopback) averaging gradients every step.

Each rank is what a p2pdiloco peer of `p2pdiloco local` would be (the same data shard `i/N`, the same data
seed, model, initial weights, inner AdamW and schedule), except that DDP all-reduces the gradients after
every backward pass instead of merging pseudo-gradients every H steps. So with N ranks of per-rank batch B
it trains on a global batch of N·B, on exactly the batches N peers would see, and the same total tokens.
Used by `bench parity` as the baseline that DiLoCo's eval loss is divided by.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import time
from datetime import timedelta
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from p2pdiloco.algorithm.outer import cosine_lr, state_digest
from p2pdiloco.config import Config, load_config, parse_set
from p2pdiloco.training.batches import BatchSampler, eval_batches
from p2pdiloco.training.data import load_text
from p2pdiloco.training.evaluation import evaluate_model
from p2pdiloco.training.model import build_model

logger = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
"""How long ranks get to exit after SIGTERM (on failure or timeout) before they are killed."""


def loopback_interface() -> str:
    """Name of the interface that holds 127.0.0.1 ('lo' on Linux, 'lo0' on macOS).

    Gloo picks its interface from the host name unless told otherwise; naming loopback keeps the
    baseline's traffic on this machine.
    """
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addrs):
            return name
    return "lo"


def rank_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """The inner AdamW a peer would use, for one data-parallel rank."""
    inner = cfg.inner
    return torch.optim.AdamW(model.parameters(), lr=inner.lr, betas=(inner.beta1, inner.beta2),
                             weight_decay=inner.weight_decay)


def rank_step(ddp: DistributedDataParallel, opt: torch.optim.Optimizer, sampler: BatchSampler, step: int,
              cfg: Config) -> torch.Tensor:
    """One data-parallel step at the run-wide lr schedule; returns the (local) loss."""
    inner = cfg.inner
    lr = cosine_lr(step, inner.lr, inner.warmup_steps, cfg.run.total_steps, inner.min_lr_ratio)
    for group in opt.param_groups:
        group["lr"] = lr
    x, y = sampler.next_batch()
    _, loss = ddp(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()  # DDP averages the gradients over all ranks here
    if inner.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(ddp.module.parameters(), inner.grad_clip)
    opt.step()
    return loss.detach()


def train_rank(cfg: Config, rank: int, world: int, eval_every: int = 0) -> dict:
    """Train one rank of an initialised gloo process group; returns its losses, time and final weights' digest.

    Args:
        cfg: the run's config; `run.total_steps` steps of `data.batch_size` sequences on this rank.
        rank: this rank; it reads data shard `rank/world` with data seed `rank`, as peer `rank` of
            `p2pdiloco local` does.
        world: number of ranks.
        eval_every: also evaluate every this many steps (0: only at the start and the end); rank 0 only.
    """
    device = torch.device("cpu")
    data = load_text(cfg.data, min_bytes=2 * (cfg.model.seq_len + 1))
    sampler = BatchSampler(data.train, cfg.model.seq_len, cfg.data.batch_size, rank, f"{rank}/{world}")
    val = eval_batches(data.val, cfg.model.seq_len, cfg.data.batch_size, cfg.run.eval_batches)
    model = build_model(cfg.model)  # the same init_seed on every rank: the swarm's initial global model
    ddp = DistributedDataParallel(model)
    opt = rank_optimizer(model, cfg)
    curve = [(0, evaluate_model(model, val, device))] if rank == 0 else []
    t0 = time.monotonic()
    loss_sum = 0.0
    for step in range(cfg.run.total_steps):
        loss = rank_step(ddp, opt, sampler, step, cfg)
        loss_sum += float(loss)
        if rank == 0 and eval_every and (step + 1) % eval_every == 0 and step + 1 < cfg.run.total_steps:
            curve.append((step + 1, evaluate_model(model, val, device)))
    train_s = time.monotonic() - t0
    if rank == 0:
        curve.append((cfg.run.total_steps, evaluate_model(model, val, device)))
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {
        "rank": rank, "steps": cfg.run.total_steps, "tokens": cfg.run.total_steps * sampler.tokens_per_batch,
        "train_s": train_s, "train_loss_mean": loss_sum / max(cfg.run.total_steps, 1), "eval_curve": curve,
        "params_digest": state_digest(params),
    }


def _rank_main(rank: int, world: int, init_file: str, sets: list[str], result_dir: str, eval_every: int) -> None:
    """Entry point of one spawned rank: join the group through `init_file`, train, write rank{r}.json."""
    faulthandler.enable()  # an abort in gloo's C++ (SIGABRT) prints every thread's Python stack to stderr
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    torch.set_num_threads(1)  # N ranks on a few cores, as `local` gives each peer one thread
    logging.basicConfig(level=logging.INFO, filename=str(Path(result_dir) / f"rank{rank}.log"), filemode="w",
                        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    cfg = load_config(None, [parse_set(sets)])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    logger.info("joined the group of %d ranks", world)
    try:
        result = train_rank(cfg, rank, world, eval_every)
        logger.info("trained; waiting for every rank before leaving the group")
        dist.barrier()  # no rank tears the group down while another (rank 0 evaluating) may still use it
    finally:
        dist.destroy_process_group()
    logger.info("left the group")
    path = Path(result_dir) / f"rank{rank}.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)


def run_data_parallel(sets: list[str], ranks: int, out: Path, timeout_s: float = 3600.0, eval_every: int = 0) -> dict:
    """Run the baseline in `ranks` spawned processes and return rank 0's result with every rank's digest.

    Args:
        sets: `section.key=value` config overrides, as a peer would get them.
        ranks: processes (N, the number of peers it stands in for).
        out: folder for the rendezvous file and each rank's result.
        timeout_s: the whole run's limit; ranks still running then are killed and RuntimeError is raised.
        eval_every: rank 0 also evaluates every this many steps (0: start and end only).

    Raises:
        RuntimeError: a rank failed or the run timed out (all ranks are stopped and reaped first).
    """
    load_config(None, [parse_set(sets)])  # a bad flag should fail here, not in N children
    out.mkdir(parents=True, exist_ok=True)
    init_file = out / "rendezvous"
    init_file.unlink(missing_ok=True)  # a stale file from an earlier run would break the rendezvous
    for stale in out.glob("rank*.json"):
        stale.unlink()
    ctx = mp.get_context("spawn")  # fork would copy this process's threads (a DHT loop, the console) mid-flight
    procs = [ctx.Process(target=_rank_main, args=(r, ranks, str(init_file), list(sets), str(out), eval_every),
                         name=f"dp-rank{r}") for r in range(ranks)]
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.start()
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # one rank failed: the others would wait for it until the gloo timeout
            if time.monotonic() > deadline:
                raise RuntimeError(f"data-parallel baseline did not finish in {timeout_s:.0f} s")
            mp.connection.wait([p.sentinel for p in procs if p.is_alive()], timeout=0.5)
    finally:
        stop_ranks(procs)
    failed = {p.name: p.exitcode for p in procs if p.exitcode != 0}
    if failed:
        logs = "".join(_log_tail(out / f"rank{r}.log") for r in range(ranks))
        raise RuntimeError(f"data-parallel ranks failed: {failed}{logs}")
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    return {**results[0], "ranks": ranks, "rank_digests": [r["params_digest"] for r in results],
            "max_train_s": max(r["train_s"] for r in results)}


def _log_tail(path: Path, lines: int = 5) -> str:
    """The last lines of a rank's log, for the error that says it failed (how far it got)."""
    try:
        tail = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return f"\n{path.name}: none"
    return f"\n{path.name}:\n" + "\n".join(f"  {line}" for line in tail)


def stop_ranks(procs: list) -> None:
    """Reap every rank: terminate what still runs, kill what ignores that."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        if p.pid is None:  # never started
            continue
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            logger.warning("%s ignored SIGTERM; killing it", p.name)
            p.kill()
            p.join()
