"""What every bench shares: the benchmark model's settings, the machine line and the results file."""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console

from p2pdiloco.util.files import write_json_atomic

logger = logging.getLogger(__name__)

# What every bench trains on: the first 4 MB of the default text, so runs of one bench and of different
# benches see the same data.
BENCH_DATA = ["data.max_bytes=4000000"]
# A small model whose inner step takes a few ms on one core, and its batch: the benches that compare runs of
# this model (all but slowlink and overhead, which keep the default model) start from these lines and add
# their own run and swarm settings.
BENCH_MODEL = [
    "model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.seq_len=64", "data.batch_size=8",
    *BENCH_DATA,
]
# Evaluate on 16 batches, at the start and end of a run only.
BENCH_EVAL = ["run.eval_batches=16", "run.eval_every_rounds=0"]
# The benchmark model as straggler, churn and bandwidth run it. Benchmark peers pad each step to a fixed
# emulated accelerator time (emulate.min_step_s), so that 4 peers on 2 cores do not compete for cores and the
# figures measure the algorithm, not the CPU scheduler. The merges are real: real DHT, p2p daemons, bytes.
BENCH_MODEL_SETS = [
    *BENCH_MODEL, "run.total_steps=100000", "emulate.min_step_s=0.1", *BENCH_EVAL, "run.log_every=10",
    "inner.warmup_steps=20",
]


def write_results(out: Path, name: str, results: dict) -> Path:
    """A bench's results as out/NAME.json, written atomically (an interrupted bench leaves no half file)."""
    path = out / f"{name}.json"
    write_json_atomic(path, results)
    return path


def report(out: Path, name: str, results: dict, print_results: Callable[[dict, Console], None],
           console: Console) -> dict:
    """Write a bench's results (`write_results`), print them with `print_results`, say where they went."""
    path = write_results(out, name, results)
    print_results(results, console)
    console.print(f"wrote {path}")
    return results


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, torch {torch.__version__}"

