"""`p2pdiloco bench straggler`: fast peers' inner steps/s with one 4x slower peer ÷ without it, decoupled vs --sync."""

from __future__ import annotations

import logging
import os
import statistics
import time
from pathlib import Path

from rich.console import Console

from p2pdiloco.app.local import run_local
from p2pdiloco.bench.common import BENCH_MODEL_SETS, machine, write_results
from p2pdiloco.config import load_config, parse_set

logger = logging.getLogger(__name__)

def _fast_peer_stats(summary: dict, slow_name: str | None) -> dict:
    fast = [p for p in summary["peers"] if p.get("name") != slow_name]
    return {
        "steps_per_s": statistics.mean(p["steps_per_s"] for p in fast),
        "per_peer_steps_per_s": {p["name"]: p["steps_per_s"] for p in fast},
        "eval_loss": statistics.mean(p["eval_loss_final"] for p in fast),
        "merges": statistics.mean(p["merges"] for p in fast),
        "merge_wait_s": statistics.mean(p["merge_wait_s"] for p in fast),
        "train_s": statistics.mean(p["train_s"] for p in fast),
    }


def bench_straggler(out: Path, seconds: float = 60.0, peers: int = 4, factor: float = 4.0,
                    console: Console | None = None) -> dict:
    """Four runs of `seconds` each: {decoupled, sync} x {with the slow peer, without it}.

    Decoupled peers use timed rounds (2 s) so the slow peer merges on the swarm's cadence with fewer steps;
    sync peers use H = 20 steps (2 s at full speed) and wait for everyone, as OpenDiLoCo does.
    """
    console = console or Console()
    out.mkdir(parents=True, exist_ok=True)
    quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115 - closed with the process
    modes = {
        "decoupled": ["rounds.round_seconds=2.0", "merge.merge_window_s=10"],
        "sync": ["rounds.sync=true", "rounds.round_steps=20", "merge.merge_window_s=60"],
    }
    slow_index = peers - 1
    results: dict = {"machine": machine(), "seconds": seconds, "peers": peers, "slow_factor": factor, "runs": {}}
    for mode, mode_sets in modes.items():
        for with_slow in (True, False):
            name = f"{mode}_{'with' if with_slow else 'without'}_slow"
            n = peers if with_slow else peers - 1
            sets = BENCH_MODEL_SETS + mode_sets + [f"run.time_limit_s={seconds}", f"swarm.run_id=bench-{name}"]
            cfg = load_config(None, [parse_set(sets)])
            console.print(f"[bold]{name}[/bold]: {n} peers for {seconds:.0f} s ...")
            t0 = time.monotonic()
            summary = run_local(n, cfg, out / name, None, sets, console=quiet, reraise_interrupt=True,
                                slow={slow_index: factor} if with_slow else None)
            if summary["peers_finished"] != n:
                raise RuntimeError(f"{name}: only {summary['peers_finished']} of {n} peers finished; see {out / name}")
            results["runs"][name] = _fast_peer_stats(summary, f"peer{slow_index}" if with_slow else None)
            results["runs"][name]["wall_s"] = time.monotonic() - t0
    runs = results["runs"]
    for mode in modes:
        runs[mode + "_ratio"] = runs[f"{mode}_with_slow"]["steps_per_s"] / runs[f"{mode}_without_slow"]["steps_per_s"]
    results["decoupled_ratio"] = runs.pop("decoupled_ratio")
    results["sync_ratio"] = runs.pop("sync_ratio")
    path = write_results(out, "straggler", results)
    _plot_straggler(results, out / "straggler.png")

    console.print(f"machine: {results['machine']}")
    console.print(f"fast peers' inner steps/s, one peer {factor:.0f}x slower ÷ without it ({seconds:.0f} s runs):")
    for mode in modes:
        w, wo = runs[f"{mode}_with_slow"], runs[f"{mode}_without_slow"]
        console.print(f"  {mode:9s}: {w['steps_per_s']:.2f} ÷ {wo['steps_per_s']:.2f} = "
                      f"{results[mode + '_ratio']:.3f}   (merges {w['merges']:.0f}, waiting {w['merge_wait_s']:.1f} s)")
    console.print("final eval loss of the fast peers' global models at equal wall time (with the slow peer):")
    console.print(f"  decoupled {runs['decoupled_with_slow']['eval_loss']:.4f} vs sync {runs['sync_with_slow']['eval_loss']:.4f}"
                  f"   (without it: {runs['decoupled_without_slow']['eval_loss']:.4f} vs {runs['sync_without_slow']['eval_loss']:.4f})")
    console.print(f"wrote {path} and {out / 'straggler.png'}")
    return results


def _plot_straggler(results: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = results["runs"]
    fig = Figure(figsize=(10, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    modes = ["decoupled", "sync"]
    ax1.bar(modes, [results[m + "_ratio"] for m in modes], color=["C0", "C1"])
    ax1.axhline(1.0, color="grey", linewidth=0.8)
    ax1.set_ylabel("fast peers' steps/s with slow peer ÷ without")
    ax1.set_title(f"straggler immunity (one peer {results['slow_factor']:.0f}x slower)")
    for i, m in enumerate(modes):
        ax1.text(i, results[m + "_ratio"], f"{results[m + '_ratio']:.3f}", ha="center", va="bottom")
    x = range(2)
    ax2.bar([i - 0.2 for i in x], [runs[f"{m}_with_slow"]["eval_loss"] for m in modes], 0.4, label="with slow peer")
    ax2.bar([i + 0.2 for i in x], [runs[f"{m}_without_slow"]["eval_loss"] for m in modes], 0.4, label="without")
    ax2.set_xticks(list(x), modes)
    ax2.set_ylabel("final eval loss (nats/byte)")
    ax2.set_title(f"eval loss after {results['seconds']:.0f} s")
    ax2.legend()
    fig.savefig(path, dpi=100)

