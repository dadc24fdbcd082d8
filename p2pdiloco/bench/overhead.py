"""`p2pdiloco bench overhead`: a peer's inner-step throughput inside a swarm ÷ the same model and batch in a plain torch loop."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from rich.console import Console

from p2pdiloco.app.local import run_local
from p2pdiloco.bench.common import BENCH_DATA, machine, write_results
from p2pdiloco.config import Config, load_config, parse_set
from p2pdiloco.training.batches import BatchSampler
from p2pdiloco.training.data import load_text
from p2pdiloco.training.model import build_model

logger = logging.getLogger(__name__)

def _plain_loop(cfg: Config, steps: int) -> float:
    """Inner steps/s of the same model, batch and optimizer in a plain torch loop (no swarm, no merges)."""
    torch.set_num_threads(1)
    data = load_text(cfg.data)
    sampler = BatchSampler(data.train, cfg.model.seq_len, cfg.data.batch_size, 0)
    model = build_model(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.inner.lr, betas=(cfg.inner.beta1, cfg.inner.beta2),
                            weight_decay=cfg.inner.weight_decay)
    for _ in range(5):  # warm-up, as the swarm's first steps are also excluded by nothing but its length
        x, y = sampler.next_batch()
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    t0 = time.monotonic()
    for _ in range(steps):
        x, y = sampler.next_batch()
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
        opt.step()
        float(loss.detach())
    return steps / (time.monotonic() - t0)


def _plain_loop_on(cpu: int, cfg: Config, steps: int) -> float:
    """`_plain_loop` pinned to CPU `cpu` (the measured peer's); this process's CPUs are restored after."""
    original = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        return _plain_loop(cfg, steps)
    finally:
        os.sched_setaffinity(0, original)


def bench_overhead(out: Path, steps: int = 600, console: Console | None = None) -> dict:
    """Peer 0 of a 2-peer swarm pinned to CPU 0 (peer 1 to CPU 1) vs a plain loop pinned to CPU 0, run
    before and after the swarm (not at the same time), one thread each, evaluation off inside the loop."""
    console = console or Console()
    out.mkdir(parents=True, exist_ok=True)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise RuntimeError("bench overhead needs 2 CPUs: one per peer, so the measured peer has a core to itself")
    sets = [f"run.total_steps={steps}", "run.eval_every_rounds=0", "run.threads=1", *BENCH_DATA,
            "rounds.round_steps=50", "swarm.run_id=bench-overhead"]
    cfg = load_config(None, [parse_set(sets)])
    console.print(f"plain torch loop, {steps} steps on CPU {cpus[0]} ...")
    plain_before = _plain_loop_on(cpus[0], cfg, steps)
    console.print(f"swarm of 2 peers (peer0 on CPU {cpus[0]}, peer1 on CPU {cpus[1]}), {steps} steps ...")
    quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115
    summary = run_local(2, cfg, out / "swarm", None, sets, console=quiet, reraise_interrupt=True,
                        peer_sets={0: [f"run.cpu_affinity={cpus[0]}"], 1: [f"run.cpu_affinity={cpus[1]}"]})
    if summary["peers_finished"] != 2:
        raise RuntimeError(f"swarm run failed; see {out / 'swarm'}")
    plain_after = _plain_loop_on(cpus[0], cfg, steps)
    plain = (plain_before + plain_after) / 2
    peer0 = next(p for p in summary["peers"] if p["name"] == "peer0")
    results = {
        "machine": machine(), "steps": steps, "plain_steps_per_s": plain, "plain_before": plain_before,
        "plain_after": plain_after, "swarm_steps_per_s": peer0["steps_per_s"], "ratio": peer0["steps_per_s"] / plain,
        "merges": peer0["merges"], "bytes_sent": peer0["bytes_sent"], "n_params": peer0["n_params"],
    }
    path = write_results(out, "overhead", results)
    console.print(f"machine: {results['machine']}")
    console.print(f"inner steps/s: in swarm {results['swarm_steps_per_s']:.2f} ÷ plain loop {plain:.2f} "
                  f"(before {plain_before:.2f}, after {plain_after:.2f}) = {results['ratio']:.3f}   "
                  f"({peer0['merges']} merges, {peer0['bytes_sent'] / 1e6:.1f} MB sent)")
    console.print(f"wrote {path}")
    return results

