"""The data-parallel baseline under churn, for `bench churn`: what lockstep training does when a rank dies.

N gloo ranks train like `data_parallel.py` (DDP averages gradients every step), paced to `emulate.min_step_s`
per step as the peers are, and rank 0 saves a checkpoint every `checkpoint_every` steps. A supervisor
kills a random rank with SIGKILL every `kill_every` seconds. As an elastic launcher (torchrun) would, it
then stops the whole job (the survivors' collectives fail or hang), waits `restart_delay` seconds for the
lost rank to come back, and restarts every rank from the last checkpoint. The survivors' idle time in that
wait counts as spent; the killed rank's does not (`bench churn` counts the peers the same way).

Its ranks start as fresh interpreters (multiprocessing's spawn), as torchrun restarts its workers, so every
restart of the job pays torch's import on every rank. With `forked=True` they are forked from a server that
imported torch once (app/prefork.py, Linux), as `p2pdiloco local` forks its peers: the same restart without the
imports. `bench churn` runs both.

Goodput is computed from what the ranks and the supervisor recorded, not estimated:
- spent: each rank process's wall time from its start to exit or kill, plus the survivors' wait for a restart;
- reached: the inner-step compute of the steps in the final model's history; the steps after an
  incarnation's last checkpoint that the next incarnation resumed from are lost.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import random
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from p2pdiloco.app.prefork import Prefork
from p2pdiloco.app.prefork import enabled as prefork_enabled
from p2pdiloco.bench.baselines.data_parallel import loopback_interface, rank_optimizer, rank_step, stop_ranks
from p2pdiloco.config import load_config, parse_set
from p2pdiloco.training.batches import BatchSampler, eval_batches
from p2pdiloco.training.data import load_text
from p2pdiloco.training.evaluation import evaluate_model
from p2pdiloco.training.model import build_model

logger = logging.getLogger(__name__)

FAIL_GRACE_S = 10.0
"""How long the survivors of a kill get to fail on their own (gloo notices the closed connections)."""


def _append(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()


def _rank_main(rank: int, world: int, init_file: str, sets: list[str], out: str, incarnation: int,
               checkpoint_every: int) -> None:
    """One rank of one incarnation: resume from the checkpoint if any, train to the end, record progress."""
    t_entry = time.monotonic()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    torch.set_num_threads(1)
    folder = Path(out)
    logging.basicConfig(level=logging.INFO, filename=str(folder / f"rank{rank}.log"), filemode="a",
                        format=f"%(asctime)s rank{rank} inc{incarnation} %(levelname)s %(name)s: %(message)s")
    cfg = load_config(None, [parse_set(sets)])
    progress = folder / f"rank{rank}.jsonl"
    data = load_text(cfg.data, min_bytes=2 * (cfg.model.seq_len + 1))
    val = eval_batches(data.val, cfg.model.seq_len, cfg.data.batch_size, cfg.run.eval_batches)
    model = build_model(cfg.model)
    opt = rank_optimizer(model, cfg)
    step, ckpt = 0, folder / "checkpoint.pt"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = int(state["step"])
    # a fresh batch order per resume point (the baseline's data position is not part of its checkpoint)
    sampler = BatchSampler(data.train, cfg.model.seq_len, cfg.data.batch_size, rank + 7919 * step, f"{rank}/{world}")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    ddp = DistributedDataParallel(model)
    _append(progress, {"kind": "start", "inc": incarnation, "step": step, "setup_s": time.monotonic() - t_entry})
    compute = 0.0
    try:
        while step < cfg.run.total_steps:
            t0 = time.monotonic()
            rank_step(ddp, opt, sampler, step, cfg)
            spent = time.monotonic() - t0
            if cfg.emulate.min_step_s > spent:  # the same emulated step time as the peers
                time.sleep(cfg.emulate.min_step_s - spent)
            compute += time.monotonic() - t0
            step += 1
            if step % checkpoint_every == 0 or step == cfg.run.total_steps:
                # recorded first: if rank 0's file lands and a kill stops the barrier, the next incarnation
                # still resumes from this step, and these steps did reach the final model
                _append(progress, {"kind": "checkpoint", "inc": incarnation, "step": step, "compute_s": compute})
                if rank == 0:
                    tmp = ckpt.with_name(ckpt.name + ".tmp")
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
                    with tmp.open("rb") as f:
                        os.fsync(f.fileno())
                    os.replace(tmp, ckpt)
                dist.barrier()  # nobody runs ahead of a checkpoint that may not exist
        if rank == 0:
            _append(progress, {"kind": "end", "inc": incarnation, "step": step,
                               "eval_loss": evaluate_model(model, val, torch.device("cpu"))})
    except RuntimeError as e:  # a collective with a killed rank: expected under churn, not worth a traceback
        logger.warning("step %d: collective failed, stopping this incarnation: %s", step, str(e).splitlines()[0])
        raise SystemExit(1) from None
    finally:
        dist.destroy_process_group()


def goodput_from_progress(progress: list[dict], spent_s: float) -> dict:
    """Reached compute of one rank, from its progress lines (all incarnations), and goodput against `spent_s`.

    An incarnation's steps count up to the checkpoint the next incarnation resumed from (the last one's,
    up to its final checkpoint): everything after it was redone, and an incarnation killed before its first
    checkpoint reached nothing.
    """
    starts = [r for r in progress if r["kind"] == "start"]
    reached = 0.0
    for i, start in enumerate(starts):
        resumed_at = starts[i + 1]["step"] if i + 1 < len(starts) else None
        ckpts = [r for r in progress if r["kind"] == "checkpoint" and r["inc"] == start["inc"]]
        kept = [r for r in ckpts if resumed_at is None or r["step"] == resumed_at]
        if kept:
            reached += kept[-1]["compute_s"]
    return {"reached_s": reached, "spent_s": spent_s, "incarnations": len(starts)}


def run_data_parallel_churn(sets: list[str], ranks: int, out: Path, kill_every: float, restart_delay: float = 5.0,
                            checkpoint_every: int = 100, seed: int = 1, max_kills: int | None = None,
                            timeout_s: float = 3600.0, forked: bool = False) -> dict:
    """Run the baseline under churn and return its goodput, kills and final eval loss.

    Args:
        sets: config overrides (`run.total_steps`, `emulate.min_step_s`, the model and data), as for the peers.
        ranks: processes.
        out: folder for the rendezvous, checkpoint, progress lines and logs (emptied first).
        kill_every: seconds between kills (0: never).
        restart_delay: seconds a killed rank stays down before the job restarts.
        checkpoint_every: steps between rank 0's checkpoints.
        seed: seed of the choice of victims.
        max_kills: stop killing after this many (None: no limit).
        timeout_s: the whole run's limit.
        forked: fork the ranks from a server that imported torch once (Linux; elsewhere spawned all the same).

    Raises:
        RuntimeError: the run did not finish in time, or an incarnation failed with no kill to explain it.
    """
    cfg = load_config(None, [parse_set(sets)])  # a bad flag should fail here, not in N children
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("rank*.jsonl"), *out.glob("rank*.log"), out / "checkpoint.pt", out / "rendezvous.0"]:
        stale.unlink(missing_ok=True)
    rng = random.Random(seed)
    prefork = Prefork(("p2pdiloco.bench.baselines.data_parallel_churn",)) if forked and prefork_enabled() else None
    try:
        return _run(out, ranks, sets, kill_every, restart_delay, checkpoint_every, rng, max_kills, timeout_s,
                    cfg, prefork.context if prefork is not None else mp.get_context("spawn"))
    finally:
        if prefork is not None:
            prefork.close()


def _run(out: Path, ranks: int, sets: list[str], kill_every: float, restart_delay: float, checkpoint_every: int,
         rng: random.Random, max_kills: int | None, timeout_s: float, cfg, ctx) -> dict:
    t_run = time.monotonic()
    deadline = t_run + timeout_s
    next_kill = t_run + kill_every if kill_every > 0 else float("inf")
    spent = [0.0] * ranks
    kills: list[dict] = []
    incarnation = 0
    while True:
        init_file = out / f"rendezvous.{incarnation}"
        init_file.unlink(missing_ok=True)
        procs = [ctx.Process(target=_rank_main, args=(r, ranks, str(init_file), list(sets), str(out), incarnation,
                                                      checkpoint_every), name=f"dp-rank{r}") for r in range(ranks)]
        started = [0.0] * ranks
        victim, fail_by = None, float("inf")
        try:
            launched = time.monotonic()  # a fork can wait on the server's imports, and the next ranks on it
            for r, p in enumerate(procs):
                started[r] = launched
                p.start()
            while any(p.is_alive() for p in procs):
                now = time.monotonic()
                if now > deadline:
                    raise RuntimeError(f"data-parallel churn run did not finish in {timeout_s:.0f} s")
                if victim is None and now >= next_kill and (max_kills is None or len(kills) < max_kills):
                    victim = rng.randrange(ranks)
                    os.kill(procs[victim].pid, signal.SIGKILL)
                    kills.append({"t": now - t_run, "rank": victim, "incarnation": incarnation})
                    logger.info("data-parallel churn: killed rank %d", victim)
                    next_kill = now + kill_every
                    fail_by = now + FAIL_GRACE_S
                if victim is not None and now >= fail_by:
                    break  # the survivors hang in a collective: stop them as the launcher would
                if victim is None and any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"a data-parallel rank failed on its own: {[p.exitcode for p in procs]}")
                mp.connection.wait([p.sentinel for p in procs if p.is_alive()], timeout=0.2)
        finally:
            stop_ranks(procs)
            for r in range(ranks):  # the victim's time ends at its kill, the survivors' when they are stopped
                end = kills[-1]["t"] + t_run if r == victim else time.monotonic()
                spent[r] += end - started[r] if started[r] else 0.0
        if victim is None:
            break  # every rank finished
        down_until = kills[-1]["t"] + t_run + restart_delay
        wait = max(0.0, down_until - time.monotonic())
        for r in range(ranks):
            if r != victim:
                spent[r] += wait  # idle, waiting for the lost rank to come back
        time.sleep(wait)  # the lost rank's downtime, as in the peers' chaos schedule
        incarnation += 1
    for stale in out.glob("rendezvous.*"):
        stale.unlink(missing_ok=True)
    per_rank = []
    for r in range(ranks):
        rows = [json.loads(x) for x in (out / f"rank{r}.jsonl").read_text().splitlines() if x.endswith("}")]
        per_rank.append(goodput_from_progress(rows, spent[r]))
    end = [json.loads(x) for x in (out / "rank0.jsonl").read_text().splitlines() if '"end"' in x][-1]
    reached, total = sum(p["reached_s"] for p in per_rank), sum(p["spent_s"] for p in per_rank)
    return {"goodput": reached / total if total else 0.0, "reached_s": reached, "spent_s": total,
            "kills": len(kills), "incarnations": incarnation + 1, "eval_loss": end["eval_loss"],
            "steps": cfg.run.total_steps, "checkpoint_every": checkpoint_every, "wall_s": time.monotonic() - t_run}
