"""`p2pdiloco bench churn`: goodput with peers killed and restarted at random, decoupled vs --sync vs data-parallel."""

from __future__ import annotations

import logging
import os
import statistics
import time
from pathlib import Path

from rich.console import Console

from p2pdiloco.app.local import run_local
from p2pdiloco.bench.common import BENCH_MODEL_SETS, machine, write_results
from p2pdiloco.bench.goodput import run_goodput, startups
from p2pdiloco.config import load_config, parse_set

logger = logging.getLogger(__name__)

DP_CHECKPOINT_STEPS = 100
"""The data-parallel baseline's checkpoint interval under churn: 10 s of steps, as often as the peers
checkpoint (every 5 rounds of 2 s)."""


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
        "decoupled_churn": (base + ["rounds.round_seconds=2.0", "merge.merge_window_s=10"], True),
        "sync_churn": (base + ["rounds.sync=true", "rounds.round_steps=20", "merge.merge_window_s=60"], True),
        "decoupled_no_churn": (base + ["rounds.round_seconds=2.0", "merge.merge_window_s=10"], False),
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
        goodput = run_goodput(out / name) or {"goodput": 0.0, "spent_s": 0.0, "reached_s": 0.0, "incarnations": 0}
        final = [p["eval_loss_final"] for p in summary["peers"]]
        results["runs"][name] = {
            **goodput, "kills": summary.get("chaos_kills", 0), "peers_finished": summary["peers_finished"],
            "eval_loss": statistics.mean(final) if final else None, "wall_s": time.monotonic() - t0,
            "startup_s": startups(out / name),
        }
    console.print(f"[bold]data_parallel_churn[/bold]: {peers} gloo ranks, {steps} steps, checkpoint every "
                  f"{DP_CHECKPOINT_STEPS} steps, a kill every {kill_every:.0f} s ...")
    from p2pdiloco.bench.baselines.data_parallel_churn import run_data_parallel_churn

    dp = run_data_parallel_churn(base, peers, out / "data_parallel_churn", kill_every, restart_delay,
                                 checkpoint_every=DP_CHECKPOINT_STEPS, seed=1)
    results["runs"]["data_parallel_churn"] = {**dp, "peers_finished": peers}
    # the same with every restart forked from a server that imported torch once, as `local` forks the peers: how
    # much of data-parallel's loss is its ranks' imports at each restart of the job
    console.print("[bold]data_parallel_churn_forked[/bold]: the same, its ranks forked from a server that imported "
                  "torch once ...")
    dp = run_data_parallel_churn(base, peers, out / "data_parallel_churn_forked", kill_every, restart_delay,
                                 checkpoint_every=DP_CHECKPOINT_STEPS, seed=1, forked=True)
    results["runs"]["data_parallel_churn_forked"] = {**dp, "peers_finished": peers}
    r = results["runs"]
    base_loss = r["decoupled_no_churn"]["eval_loss"]
    for name in ("decoupled_churn", "sync_churn"):
        r[name]["eval_loss_vs_no_churn"] = r[name]["eval_loss"] / base_loss if base_loss else None
    results["goodput_ratio_vs_sync"] = r["decoupled_churn"]["goodput"] / max(r["sync_churn"]["goodput"], 1e-9)
    results["goodput_ratio_vs_data_parallel"] = (r["decoupled_churn"]["goodput"]
                                                 / max(r["data_parallel_churn"]["goodput"], 1e-9))
    results["goodput_ratio_vs_data_parallel_forked"] = (r["decoupled_churn"]["goodput"]
                                                        / max(r["data_parallel_churn_forked"]["goodput"], 1e-9))
    path = write_results(out, "churn", results)
    console.print(f"machine: {results['machine']}")
    console.print("goodput = inner-step time that reached another peer's model or the final one ÷ peer wall time "
                  "(start-up, rejoin, waiting count; a killed peer up to its kill; bench/goodput.py):")
    for name, v in r.items():
        extra = f", eval loss ÷ no-churn {v['eval_loss_vs_no_churn']:.4f}" if "eval_loss_vs_no_churn" in v else ""
        console.print(f"  {name:26s}: goodput {v['goodput']:.3f} ({v['reached_s']:.0f} s ÷ {v['spent_s']:.0f} s), "
                      f"kills survived {v['kills']}, eval loss {v['eval_loss']:.4f}{extra}")
    for name, v in r.items():
        for kind, seconds in v.get("startup_s", {}).items():
            if seconds:
                console.print(f"  {name:26s}: {len(seconds)} {kind} start(s), process start to first inner step "
                              f"median {statistics.median(seconds):.1f} s, max {max(seconds):.1f} s")
    console.print(f"decoupled ÷ sync goodput under churn: {results['goodput_ratio_vs_sync']:.2f}; "
                  f"÷ data-parallel: {results['goodput_ratio_vs_data_parallel']:.2f} (restarted as fresh "
                  f"interpreters, as torchrun does), {results['goodput_ratio_vs_data_parallel_forked']:.2f} (forked)")
    console.print(f"wrote {path}")
    return results

