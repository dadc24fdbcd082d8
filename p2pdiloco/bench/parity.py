"""`p2pdiloco bench parity`: eval loss at equal tokens, DiLoCo (decoupled and --sync) ÷ data-parallel.

Three runs of the same model, data, inner AdamW and schedule, N workers × the same steps × the same
per-worker batch (so equal tokens, and the same global batch N·B per step):

- data-parallel: N torch.distributed ranks (gloo on loopback) averaging gradients every step
  (`data_parallel.py`); rank i reads the data shard and seed that peer i of `p2pdiloco local` reads;
- synchronous DiLoCo (`rounds.sync=true`): N peers, a merge every H inner steps, everyone waits for it;
- decoupled p2pdiloco: the same N peers and H, merges in the background while training goes on.

All three are evaluated on the same validation batches (`run.eval_batches` of the val split) by the same
function (`evaluation.evaluate_model`); DiLoCo's figure is its peers' global models after the last merge.
Rounds are step-counted (`rounds.round_steps`), so what the algorithm does does not depend on CPU speed,
except in decoupled mode, where the steps taken while a merge is in flight depend on how long it takes:
peers' inner steps are therefore padded to an emulated accelerator time (`emulate.min_step_s`), as in the
other benchmarks.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from rich.console import Console

from p2pdiloco.app.local import run_local
from p2pdiloco.bench.baselines.data_parallel import run_data_parallel
from p2pdiloco.bench.common import BENCH_EVAL, BENCH_MODEL, machine, report
from p2pdiloco.config import load_config, parse_set

# The straggler benchmark's small model (~110k parameters), so that N workers fit on 2 cores.
PARITY_SETS = [
    *BENCH_MODEL, *BENCH_EVAL, "run.log_every=50", "inner.warmup_steps=50", "run.checkpoint_every=0",
]


def _diloco_stats(summary: dict, n: int, name: str, out: Path) -> dict:
    if summary["peers_finished"] != n:
        raise RuntimeError(f"{name}: only {summary['peers_finished']} of {n} peers finished; see {out}")
    peers = summary["peers"]
    return {
        "eval_loss": statistics.mean(p["eval_loss_final"] for p in peers),
        "eval_loss_per_peer": [p["eval_loss_final"] for p in peers],
        "eval_loss_initial": statistics.mean(p["eval_loss_initial"] for p in peers),
        "rounds": statistics.mean(p["rounds"] for p in peers),
        "merges": statistics.mean(p["merges"] for p in peers),
        "tokens": sum(p["tokens"] for p in peers),
        "global_models_identical": summary["global_models_identical"],
        "consensus_distance": summary["consensus_distance"],
        "train_s": statistics.mean(p["train_s"] for p in peers),
    }


def bench_parity(out: Path, steps: int = 3000, h: int = 50, peers: int = 4, step_s: float = 0.05, seeds: int = 1,
                 console: Console | None = None) -> dict:
    """Run the three trainings (for each of `seeds` initial models) and print each DiLoCo eval loss ÷ the
    data-parallel one, and decoupled ÷ sync; with several seeds, each ratio's mean and spread.

    Args:
        out: results folder (parity.json, and one sub-folder per run; per seed with seeds > 1).
        steps: inner steps per worker (each worker sees steps × data.batch_size sequences).
        h: inner steps per DiLoCo round.
        peers: workers: data-parallel ranks and DiLoCo peers.
        step_s: emulated accelerator time per DiLoCo inner step (emulate.min_step_s).
        seeds: initial models (model.init_seed = 1234 + k); the data and its order stay the same.
        console: where the table is printed.
    """
    if seeds < 1:
        raise ValueError("--seeds must be >= 1")
    console = console or Console()
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"machine": machine(), "steps": steps, "h": h, "peers": peers, "step_s": step_s, "seeds": seeds,
                     "per_seed": []}
    for k in range(seeds):
        where = out if seeds == 1 else out / f"seed{k}"
        if seeds > 1:
            console.print(f"[bold]seed {k + 1} of {seeds}[/bold] (model.init_seed={1234 + k})")
        results["per_seed"].append(_one_seed(where, steps, h, peers, step_s, 1234 + k, console))
    for key in ("sync_ratio", "decoupled_ratio", "decoupled_vs_sync"):
        values = [r[key] for r in results["per_seed"]]
        results[key] = statistics.mean(values)
        results[key + "_spread"] = (min(values), max(values), statistics.stdev(values) if len(values) > 1 else 0.0)
    return report(out, "parity", results, _print, console)


def _one_seed(out: Path, steps: int, h: int, peers: int, step_s: float, init_seed: int, console: Console) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115 - closed with the process
    common = PARITY_SETS + [f"run.total_steps={steps}", f"rounds.round_steps={h}", f"model.init_seed={init_seed}"]
    load_config(None, [parse_set(common)])  # fail on a bad flag before the first run
    results: dict = {"init_seed": init_seed, "sets": common, "runs": {}}

    console.print(f"[bold]data-parallel[/bold]: {peers} gloo ranks, {steps} steps ...")
    t0 = time.monotonic()
    dp = run_data_parallel(common, peers, out / "data_parallel", eval_every=h)
    results["runs"]["data_parallel"] = {
        "eval_loss": dp["eval_curve"][-1][1], "eval_loss_initial": dp["eval_curve"][0][1],
        "eval_curve": dp["eval_curve"], "tokens": dp["tokens"] * peers, "train_s": dp["max_train_s"],
        "ranks_identical": len(set(dp["rank_digests"])) == 1, "wall_s": time.monotonic() - t0,
    }
    modes = {
        "sync": ["rounds.sync=true", "merge.merge_window_s=60"],
        "decoupled": [],
    }
    for mode, mode_sets in modes.items():
        sets = common + mode_sets + [f"emulate.min_step_s={step_s}", f"swarm.run_id=bench-parity-{mode}-{init_seed}"]
        cfg = load_config(None, [parse_set(sets)])
        console.print(f"[bold]{mode} DiLoCo[/bold]: {peers} peers, {steps} steps, H = {h} ...")
        t0 = time.monotonic()
        summary = run_local(peers, cfg, out / mode, None, sets, console=quiet, reraise_interrupt=True)
        results["runs"][mode] = _diloco_stats(summary, peers, mode, out / mode)
        results["runs"][mode]["wall_s"] = time.monotonic() - t0
    runs = results["runs"]
    base = runs["data_parallel"]["eval_loss"]
    for mode in modes:
        results[f"{mode}_ratio"] = runs[mode]["eval_loss"] / base
    results["decoupled_vs_sync"] = runs["decoupled"]["eval_loss"] / runs["sync"]["eval_loss"]
    return results


def _print(results: dict, console: Console) -> None:
    console.print(f"machine: {results['machine']}")
    for one in results["per_seed"]:
        runs = one["runs"]
        dp = runs["data_parallel"]
        tokens = dp["tokens"]
        console.print(f"eval loss (nats/byte) at equal tokens ({tokens:,} tokens: {results['peers']} workers × "
                      f"{results['steps']} steps), H = {results['h']}, model.init_seed {one['init_seed']}:")
        console.print(f"  data-parallel ({results['peers']} gloo ranks, gradients averaged every step): "
                      f"{dp['eval_loss']:.4f}   (initial {dp['eval_loss_initial']:.4f})")
        for mode in ("sync", "decoupled"):
            r = runs[mode]
            note = "" if r["tokens"] == tokens else f"   [tokens {r['tokens']:,}, not equal!]"
            console.print(f"  {mode:9s} DiLoCo: {r['eval_loss']:.4f} ÷ {dp['eval_loss']:.4f} = "
                          f"{one[mode + '_ratio']:.4f}   ({r['rounds']:.0f} rounds, {r['merges']:.0f} group merges "
                          f"per peer; initial {r['eval_loss_initial']:.4f}){note}")
        console.print(f"  decoupled ÷ sync: {one['decoupled_vs_sync']:.4f}")
    n = results["seeds"]
    for key, label in (("sync_ratio", "sync ÷ data-parallel"), ("decoupled_ratio", "decoupled ÷ data-parallel"),
                       ("decoupled_vs_sync", "decoupled ÷ sync")):
        low, high, sd = results[key + "_spread"]
        console.print(f"{label}: mean {results[key]:.4f} over {n} seed(s)"
                      + (f", min {low:.4f}, max {high:.4f}, stdev {sd:.4f}" if n > 1 else ""))
