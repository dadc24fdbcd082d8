"""`p2pdiloco bench`: measured figures, each printed beside its baseline from the same invocation.

- straggler: fast peers' inner steps/s with one 4x slower peer ÷ without it, decoupled vs --sync.
- overhead: a peer's inner-step throughput inside a swarm ÷ the same model and batch in a plain torch loop.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console

from p2pdiloco.config import Config, load_config, parse_set
from p2pdiloco.data import BatchSampler, load_text
from p2pdiloco.local import run_local
from p2pdiloco.model import build_model
from p2pdiloco.peer import write_json_atomic

logger = logging.getLogger(__name__)

# A small model whose inner step takes a few ms on one core. Benchmark peers pad each step to a fixed
# emulated accelerator time (run.min_step_s), so that 4 peers on 2 cores do not compete for cores and the
# figures measure the algorithm, not the CPU scheduler. The merges are real: real DHT, p2p daemons, bytes.
STRAGGLER_SETS = [
    "model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.seq_len=64", "data.batch_size=8",
    "data.max_bytes=4000000", "run.total_steps=100000", "run.min_step_s=0.1", "run.eval_batches=16",
    "run.eval_every_rounds=0", "run.log_every=10", "inner.warmup_steps=20",
]


def write_results(out: Path, name: str, results: dict) -> Path:
    """A bench's results as out/NAME.json, written atomically (an interrupted bench leaves no half file)."""
    path = out / f"{name}.json"
    write_json_atomic(path, results)
    return path


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, torch {torch.__version__}"


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
        "decoupled": ["swarm.round_seconds=2.0", "swarm.merge_window_s=10"],
        "sync": ["swarm.sync=true", "swarm.round_steps=20", "swarm.merge_window_s=60"],
    }
    slow_index = peers - 1
    results: dict = {"machine": machine(), "seconds": seconds, "peers": peers, "slow_factor": factor, "runs": {}}
    for mode, mode_sets in modes.items():
        for with_slow in (True, False):
            name = f"{mode}_{'with' if with_slow else 'without'}_slow"
            n = peers if with_slow else peers - 1
            sets = STRAGGLER_SETS + mode_sets + [f"run.time_limit_s={seconds}", f"swarm.run_id=bench-{name}"]
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


def bench_overhead(out: Path, steps: int = 600, console: Console | None = None) -> dict:
    """Peer 0 of a 2-peer swarm pinned to CPU 0 (peer 1 to CPU 1) vs a plain loop pinned to CPU 0, run
    before and after the swarm (not at the same time), one thread each, evaluation off inside the loop."""
    console = console or Console()
    out.mkdir(parents=True, exist_ok=True)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise RuntimeError("bench overhead needs 2 CPUs: one per peer, so the measured peer has a core to itself")
    sets = [f"run.total_steps={steps}", "run.eval_every_rounds=0", "run.threads=1", "data.max_bytes=4000000",
            "swarm.round_steps=50", "swarm.run_id=bench-overhead"]
    cfg = load_config(None, [parse_set(sets)])
    console.print(f"plain torch loop, {steps} steps on CPU {cpus[0]} ...")
    original = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpus[0]})
    try:
        plain_before = _plain_loop(cfg, steps)
    finally:
        os.sched_setaffinity(0, original)
    console.print(f"swarm of 2 peers (peer0 on CPU {cpus[0]}, peer1 on CPU {cpus[1]}), {steps} steps ...")
    quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115
    summary = run_local(2, cfg, out / "swarm", None, sets, console=quiet, reraise_interrupt=True,
                        peer_sets={0: [f"run.cpu_affinity={cpus[0]}"], 1: [f"run.cpu_affinity={cpus[1]}"]})
    if summary["peers_finished"] != 2:
        raise RuntimeError(f"swarm run failed; see {out / 'swarm'}")
    os.sched_setaffinity(0, {cpus[0]})
    try:
        plain_after = _plain_loop(cfg, steps)
    finally:
        os.sched_setaffinity(0, original)
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
    base = [s for s in STRAGGLER_SETS if not s.startswith("run.total_steps")] + [
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
        from p2pdiloco.local import Chaos

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
    from p2pdiloco.data_parallel_churn import run_data_parallel_churn

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
