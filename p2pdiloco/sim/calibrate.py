"""`p2pdiloco simulate --calibrate RUN_DIR`: a real bench folder beside its simulation.

Reads what `bench straggler` (straggler.json) or `bench churn` (churn.json) wrote, takes the inputs the model needs
from the run itself (the benches' settings, the measured first start-up from the peers' `start` lines, the --sync
merge overhead from the spacing of its merges), simulates the same runs, and returns measured and simulated figures
side by side. Measured goodput is computed by bench/goodput.py's `run_goodput`, the rule `bench churn` reports.
The model's rule is that one but for what it does not model (docs/simulation.md): rounds a learner merged alone
count in full once a later group merge of its carries them, where the measured rule counts them by the learner's
share of that merge's agreement, and no guard leaves a contribution out.
"""

from __future__ import annotations

import copy
import json
import statistics
from pathlib import Path

from p2pdiloco.bench.goodput import run_goodput
from p2pdiloco.config import ConfigError
from p2pdiloco.sim.scenario import Scenario
from p2pdiloco.sim.simulate import run_algorithm
from p2pdiloco.util.logfiles import read_jsonl


def _peer_files(run: Path) -> list[Path]:
    return sorted(run.glob("peers/*/metrics.jsonl"))


def measured_goodput(run: Path) -> float | None:
    """bench churn's goodput rule over every peer of a run folder, its kills included (None: no metrics there)."""
    got = run_goodput(run)
    return got["goodput"] if got is not None and got["spent_s"] else None


def first_start_s(runs: list[Path]) -> float | None:
    """Median time from process start to first step of the runs' first incarnations (`start` lines)."""
    starts = []
    for run in runs:
        for path in _peer_files(run):
            rows = read_jsonl(path)
            if rows and rows[0].get("kind") == "start":
                starts.append(float(rows[0].get("process_s", 0.0)))
    return statistics.median(starts) if starts else None


def sync_overhead_s(run: Path, round_compute_s: float) -> float | None:
    """Mean spacing of a --sync run's merges minus a round's compute: what one merge adds to a round. Each peer's
    last gap (the partial round the time limit cut) is left out."""
    gaps = []
    for path in _peer_files(run):
        t = [r["elapsed_s"] for r in read_jsonl(path) if r.get("kind") == "merge" and r.get("group_size", 1) > 1]
        gaps += [b - a for a, b in zip(t, t[1:-1], strict=False)]
    return max(statistics.mean(gaps) - round_compute_s, 0.0) if gaps else None


def finish_s(run: Path, seconds: float) -> float | None:
    """Median time from a time-limited run's end of training to each peer's last line (final merge, eval)."""
    tails = [rows[-1]["elapsed_s"] - seconds for p in _peer_files(run) if (rows := read_jsonl(p))]
    return max(statistics.median(tails), 0.0) if tails else None


def _bench_scenario(steps_per_round: int = 20) -> Scenario:
    """The benches' swarm: the bench model padded to 0.1 s steps, 2 s timed decoupled rounds, --sync H = 20."""
    s = Scenario()
    s.compute.step_s = 0.1
    s.protocol.round_seconds, s.protocol.round_steps = 2.0, steps_per_round
    s.protocol.merge_window_s, s.protocol.sync_window_s = 10.0, 60.0
    return s


def calibrate(run_dir: Path) -> dict:
    """Measured and simulated figures of a bench folder. Raises ConfigError if it is not one."""
    if (run_dir / "straggler.json").exists():
        return calibrate_straggler(run_dir)
    if (run_dir / "churn.json").exists():
        return calibrate_churn(run_dir)
    raise ConfigError(f"{run_dir} holds neither straggler.json (bench straggler) nor churn.json (bench churn)")


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None


def calibrate_straggler(run_dir: Path) -> dict:
    """bench straggler: fast peers' steps/s with one slow peer ÷ without it, and each run's goodput."""
    data = _read(run_dir / "straggler.json")
    try:
        seconds, peers, factor = float(data["seconds"]), int(data["peers"]), float(data["slow_factor"])
        measured_ratio = {m: float(data[f"{m}_ratio"]) for m in ("decoupled", "sync")}
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{run_dir / 'straggler.json'} lacks {e}") from None
    base = _bench_scenario()
    overhead = sync_overhead_s(run_dir / "sync_without_slow", base.protocol.round_steps * base.compute.step_s)
    if overhead is not None:
        base.network.matchmaking_s = overhead
    base.run.duration_s = seconds
    out: dict = {"kind": "straggler", "run_dir": str(run_dir), "inputs": {
        "sync_merge_overhead_s": base.network.matchmaking_s, "seconds": seconds, "peers": peers,
        "slow_factor": factor, "first_start_s": {}, "finish_s": {}}, "ratio": {}, "goodput": {}}
    for mode in ("decoupled", "sync"):
        fast = {}
        for with_slow in (True, False):
            s = copy.deepcopy(base)
            n = peers if with_slow else peers - 1
            s.run.learners = n
            s.compute.speeds = [1.0] * (peers - 1) + ([factor] if with_slow else [])
            name = f"{mode}_{'with' if with_slow else 'without'}_slow"
            # start-up and the tail differ per run (4 peers start slower than 3 on 2 cores): read each run's own
            s.failures.first_start_s = first_start_s([run_dir / name]) or s.failures.first_start_s
            s.failures.finish_s = finish_s(run_dir / name, seconds) or 0.0
            out["inputs"]["first_start_s"][name] = s.failures.first_start_s
            out["inputs"]["finish_s"][name] = s.failures.finish_s
            r = run_algorithm(s.validate(), mode)
            fast[with_slow] = statistics.mean(r["steps_per_s"][: peers - 1])
            measured = measured_goodput(run_dir / name)
            out["goodput"][name] = {"measured": measured, "simulated": r["goodput"]}
        out["ratio"][mode] = {"measured": measured_ratio[mode], "simulated": fast[True] / fast[False]}
    return out


def calibrate_churn(run_dir: Path) -> dict:
    """bench churn: goodput of decoupled, --sync and data-parallel under the same kill schedule, and without."""
    data = _read(run_dir / "churn.json")
    try:
        runs, peers = data["runs"], int(data["peers"])
        kill_every, delay, steps = float(data["kill_every_s"]), float(data["restart_delay_s"]), int(data["steps"])
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{run_dir / 'churn.json'} lacks {e}") from None
    base = _bench_scenario()
    base.run.learners, base.run.total_steps = peers, steps
    base.failures.down_s = delay
    folders = [run_dir / n for n in ("decoupled_churn", "sync_churn", "decoupled_no_churn")]
    base.failures.first_start_s = first_start_s(folders) or base.failures.first_start_s
    sims = {"decoupled_churn": ("decoupled", True), "sync_churn": ("sync", True),
            "decoupled_no_churn": ("decoupled", False), "data_parallel_churn": ("data_parallel", True)}
    out: dict = {"kind": "churn", "run_dir": str(run_dir), "inputs": {
        "first_start_s": base.failures.first_start_s, "kill_every_s": kill_every, "restart_delay_s": delay,
        "steps": steps, "peers": peers}, "goodput": {}}
    for name, (algorithm, churn) in sims.items():
        s = copy.deepcopy(base)
        s.failures.kill_every_s = kill_every if churn else 0.0
        r = run_algorithm(s.validate(), algorithm)
        measured = runs.get(name, {})
        if (run_dir / name / "peers").is_dir():  # recompute from the metrics by the same rule
            measured = {**measured, "goodput": measured_goodput(run_dir / name)}
        out["goodput"][name] = {"measured": measured.get("goodput"), "simulated": r["goodput"],
                                "kills_measured": measured.get("kills"), "kills_simulated": r["kills"]}
    return out
