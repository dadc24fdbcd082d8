"""`p2pdiloco bench churn`: goodput with peers killed and restarted at random, decoupled vs --sync vs data-parallel."""

from __future__ import annotations

import json
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

DP_CHECKPOINT_STEPS = 100
"""The data-parallel baseline's checkpoint interval under churn: 10 s of steps, as often as the peers
checkpoint (every 5 rounds of 2 s)."""


def goodput_from_metrics(path: Path) -> dict:
    """Compute that reached a global model ÷ compute spent, for one peer's metrics.jsonl (all incarnations).

    Spent: each incarnation's wall time from process start (its `start` line's `process_s` before it)
    to its last line, so start-up, state download, idle waiting and lost rounds all count.
    Reached: the inner-step time of every round whose contribution was merged with other peers, and of
    rounds merged alone that later reached others through this peer's next group merge (its θg is
    averaged in) or through the run's end (its final global model); rounds merged alone before a kill,
    and the steps after the last merge before a kill, are lost.
    """
    incarnations: list[list[dict]] = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        if row.get("kind") == "start" or not incarnations:
            incarnations.append([])
        incarnations[-1].append(row)
    spent = reached = compute = 0.0
    for rows in incarnations:
        start = next((r for r in rows if r.get("kind") == "start"), None)
        if start is None:
            continue
        spent += rows[-1]["t"] - (start["t"] - start.get("process_s", 0.0))
        pending = 0.0
        for r in rows:
            if r.get("kind") == "merge":
                compute += r.get("round_compute_s", 0.0)
                if r["group_size"] > 1:
                    reached += pending + r.get("round_compute_s", 0.0)
                    pending = 0.0
                else:
                    pending += r.get("round_compute_s", 0.0)
        if any(r.get("kind") == "eval" and r.get("final") for r in rows):
            reached += pending
    return {"spent_s": spent, "reached_s": reached, "incarnations": len(incarnations)}


def bench_churn(out: Path, minutes: float = 5.0, peers: int = 4, kill_every: float = 60.0,
                restart_delay: float = 5.0, console: Console | None = None) -> dict:
    """Three runs of 4 peers (decoupled with churn, --sync with the same churn schedule, decoupled without),
    and data-parallel training of the same model with the same kills (data_parallel_churn.py)."""
    console = console or Console(soft_wrap=True)
    out.mkdir(parents=True, exist_ok=True)
    quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115
    steps = int(minutes * 60 / 0.1)  # at the emulated 0.1 s per inner step
    base = [s for s in BENCH_MODEL_SETS if not s.startswith("run.total_steps")] + [
        f"run.total_steps={steps}", "run.checkpoint_every=5", "swarm.heartbeat_s=2"]
    runs = {
        "decoupled_churn": (base + ["swarm.round_seconds=2.0", "swarm.merge_window_s=10"], True),
        "sync_churn": (base + ["swarm.sync=true", "swarm.round_steps=20", "swarm.merge_window_s=60"], True),
        "decoupled_no_churn": (base + ["swarm.round_seconds=2.0", "swarm.merge_window_s=10"], False),
    }
    results: dict = {"machine": machine(), "minutes": minutes, "peers": peers, "kill_every_s": kill_every,
                     "restart_delay_s": restart_delay, "steps": steps, "runs": {}}
    for name, (sets, churn) in runs.items():
        sets = sets + [f"swarm.run_id=bench-{name}"]
        cfg = load_config(None, [parse_set(sets)])
        console.print(f"[bold]{name}[/bold]: {peers} peers, {steps} steps each" + (f", a kill every {kill_every:.0f} s" if churn else "") + " ...")
        from p2pdiloco.app.local import Chaos

        chaos = Chaos(kill_every, restart_delay, seed=1, log=out / name / "chaos.jsonl") if churn else None
        (out / name).mkdir(parents=True, exist_ok=True)
        (out / name / "chaos.jsonl").unlink(missing_ok=True)
        t0 = time.monotonic()
        summary = run_local(peers, cfg, out / name, None, sets, console=quiet, reraise_interrupt=True, chaos=chaos)
        per_peer = [goodput_from_metrics(out / name / "peers" / f"peer{i}" / "metrics.jsonl") for i in range(peers)]
        spent, reached = sum(p["spent_s"] for p in per_peer), sum(p["reached_s"] for p in per_peer)
        final = [p["eval_loss_final"] for p in summary["peers"]]
        results["runs"][name] = {
            "goodput": reached / spent if spent else 0.0, "spent_s": spent, "reached_s": reached,
            "kills": summary.get("chaos_kills", 0), "peers_finished": summary["peers_finished"],
            "eval_loss": statistics.mean(final) if final else None, "wall_s": time.monotonic() - t0,
            "incarnations": sum(p["incarnations"] for p in per_peer),
        }
    console.print(f"[bold]data_parallel_churn[/bold]: {peers} gloo ranks, {steps} steps, checkpoint every "
                  f"{DP_CHECKPOINT_STEPS} steps, a kill every {kill_every:.0f} s ...")
    from p2pdiloco.bench.baselines.data_parallel_churn import run_data_parallel_churn

    dp = run_data_parallel_churn(base, peers, out / "data_parallel_churn", kill_every, restart_delay,
                                 checkpoint_every=DP_CHECKPOINT_STEPS, seed=1)
    results["runs"]["data_parallel_churn"] = {**dp, "peers_finished": peers}
    r = results["runs"]
    base_loss = r["decoupled_no_churn"]["eval_loss"]
    for name in ("decoupled_churn", "sync_churn"):
        r[name]["eval_loss_vs_no_churn"] = r[name]["eval_loss"] / base_loss if base_loss else None
    results["goodput_ratio_vs_sync"] = r["decoupled_churn"]["goodput"] / max(r["sync_churn"]["goodput"], 1e-9)
    results["goodput_ratio_vs_data_parallel"] = (r["decoupled_churn"]["goodput"]
                                                 / max(r["data_parallel_churn"]["goodput"], 1e-9))
    path = write_results(out, "churn", results)
    console.print(f"machine: {results['machine']}")
    console.print("goodput = inner-step time that reached a global model ÷ peer wall time (start-up, rejoin, waiting count):")
    for name, v in r.items():
        extra = f", eval loss ÷ no-churn {v['eval_loss_vs_no_churn']:.4f}" if "eval_loss_vs_no_churn" in v else ""
        console.print(f"  {name:19s}: goodput {v['goodput']:.3f} ({v['reached_s']:.0f} s ÷ {v['spent_s']:.0f} s), "
                      f"kills survived {v['kills']}, eval loss {v['eval_loss']:.4f}{extra}")
    console.print(f"decoupled ÷ sync goodput under churn: {results['goodput_ratio_vs_sync']:.2f}; "
                  f"÷ data-parallel: {results['goodput_ratio_vs_data_parallel']:.2f}")
    console.print(f"wrote {path}")
    return results

