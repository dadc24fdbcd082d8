"""`p2pdiloco bench byzantine`: what hostile peers do to the honest ones, with the default guards.

For each swarm size (default 5 and 9 peers, 2 of them hostile), each mode (sync: step-based rounds that merge
every live peer; decoupled: timed rounds of 1 s, groups of whoever is ready; about 20 merges each) and each hostile kind (see
testing/hostile.py: corrupted pseudo-gradients, and peers that lie about their model, the end of the run or
their leadership), a swarm runs with peers 0..k-1 hostile. The figure is the honest peers' mean final eval loss
÷ that of a clean run (no hostile peer) of the same size and mode, and ÷ a clean run of the honest peers alone
(`honest_only`: what the swarm would reach if the hostile peers never existed). Beside it: honest peers banned by honest
peers (must be none), the fewest steps an honest peer took (a run ended early by a lie shows here), merges
that adopted or refused a
group's global model, and the rejections the guards counted.

The `donor` kind is left out: it lies only to joiners, and these swarms have none (tests/test_join.py shows the
refusal). `sybil_donor` (every hostile peer serves joiners the same forged state and names it in its records) and
`pinner` (every hostile peer pins the others' state slots, re-asking every 0.1 s and never reading) have a joiner:
their runs restart the last peer as a fresh one mid-run, against `clean_join`, a clean run with the same restart
(byzantine_join.py), and say how long the joiner took to hold the swarm's state beside `clean_join`'s, against one
donor slot's time. The key holders' kinds (testing/insiders.py: `grinder`, an id ground to lead and never invite;
`pinner`; `flood`) attack the swarm's rules rather than the model: their figure is also the honest peers' share of
merges made in a group (`group_share`), beside the clean run's. Decoupled runs pad each inner step to
`emulate.min_step_s` so that the shared cores decide less of who meets whom.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from rich.console import Console

from p2pdiloco.app.local import run_local
from p2pdiloco.bench.byzantine_join import (
    CLEAN_JOIN,
    JOINER_KINDS,
    JoinerRestart,
    baseline_of,
    baselines,
    donors_serving,
    join_against,
    joiner_outcome,
    slot_s,
)
from p2pdiloco.bench.common import BENCH_EVAL, BENCH_MODEL, machine, write_results
from p2pdiloco.config import load_config, parse_set
from p2pdiloco.util.logfiles import read_jsonl

HONEST_ONLY = "honest_only"
"""Not a hostile kind: a clean run of only the honest peers (size − hostile), the best any defence can do, since a
hostile peer's compute is lost to the swarm however well it is stopped."""
KINDS = (HONEST_ONLY, "nan", "scale", "noise", "signflip", "takeover", "final", "leader", *JOINER_KINDS,
         "grinder", "pinner", "flood")
MODES = ("sync", "decoupled")
SIZES = (5, 9)

BYZANTINE_SETS = [
    *BENCH_MODEL, *BENCH_EVAL, "run.log_every=10", "inner.warmup_steps=10", "run.checkpoint_every=0",
    # a merge of this model takes < 1 s: a sync round waits 10 s at most for a peer that is not ready (banned
    # hostile peers, left alone, waited the whole window every round), a failing merge should not take 60
    "merge.merge_window_s=10", "merge.merge_timeout_s=10",
]
MODE_SETS = {
    "sync": ["rounds.sync=true"],
    "decoupled": ["rounds.sync=false", "rounds.round_seconds=1", "emulate.min_step_s=0.05"],
}
DECOUPLED_STEPS = 4
"""Decoupled runs take this many times `steps` (padded to 0.05 s, in rounds of 1 s: about 20 steps a round), so
that they too merge about `steps` ÷ 5 times."""


def _honest_outcome(summary: dict, hostile: set[str]) -> dict:
    """The honest peers' mean final eval loss and what happened to them."""
    honest = [p for p in summary["peers"] if p.get("name") not in hostile]
    honest_ids = {p.get("peer_id") for p in honest}
    losses = [p["eval_loss_final"] for p in honest]
    finite = [x for x in losses if x is not None and x == x]
    banned = sorted({b[-8:] for p in honest for b in p.get("guard", {}).get("banned", []) if b in honest_ids})
    return {
        "eval_loss": statistics.mean(finite) if len(finite) == len(losses) else float("nan"),
        "honest_banned_by_honest": banned,
        "min_honest_step": min(p.get("step", 0) for p in honest),
        "ended_with_swarm": sum(1 for p in honest if p.get("ended_with_swarm")),
        "merges": statistics.mean(p["merges"] for p in honest),
        "rejected": sum(p.get("guard", {}).get("rejected", 0) for p in honest),
        "hostile_banned_by_honest": sum(1 for p in honest for b in p.get("guard", {}).get("banned", [])
                                        if b not in honest_ids),
    }


def _merge_lines(run_dir: Path, names: list[str]) -> tuple[int, int]:
    """(merges that adopted a group's averaged global model, merges whose averaged model was refused)."""

    adopted = refused = 0
    for name in names:
        for row in read_jsonl(run_dir / "peers" / name / "metrics.jsonl"):
            if row.get("kind") != "merge":
                continue
            adopted += bool(row.get("adopted_state"))
            refused += bool(row.get("state_refused"))
    return adopted, refused


def _group_share(run_dir: Path, names: list[str]) -> float:
    """The share of these peers' merges that were made in a group (of 2 or more), over all their merges."""
    sizes = [row.get("group_size", 1) for name in names
             for row in read_jsonl(run_dir / "peers" / name / "metrics.jsonl") if row.get("kind") == "merge"]
    return sum(1 for s in sizes if s > 1) / len(sizes) if sizes else float("nan")


def bench_byzantine(out: Path, steps: int = 100, round_steps: int = 5, sizes: tuple[int, ...] = SIZES,
                    hostile_count: int = 2, modes: tuple[str, ...] = MODES, kinds: tuple[str, ...] = KINDS,
                    extra_sets: tuple[str, ...] = (), console: Console | None = None, seeds: int = 1) -> dict:
    """Runs {clean, each kind} × modes × sizes with the default guards (or `extra_sets` on top, e.g.
    guard.min_cosine=0.1); returns and writes byzantine.json.

    With `seeds` > 1 every run is repeated with that many initial models (model.init_seed = 1234 + k), the seeds
    interleaved so that a machine that slows down slows the clean and the hostile runs alike; each kind's figure is
    the mean of its per-seed ratios (each ÷ the clean run of its seed), with their spread. One decoupled run's ratio
    moves by ±4 % on the clean run's noise alone (docs/benchmarks.md), as much as the ≤ 1.02 target leaves."""
    if seeds < 1:
        raise ValueError("--seeds must be >= 1")
    console = console or Console()
    out.mkdir(parents=True, exist_ok=True)
    quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115 - closed with the process
    results: dict = {"machine": machine(), "steps": steps, "round_steps": round_steps, "hostile_count": hostile_count,
                     "sizes": list(sizes), "modes": list(modes), "kinds": list(kinds), "sets": list(extra_sets),
                     "seeds": seeds, "runs": {}, "figures": {}}
    for peers in sizes:
        for mode in modes:
            for k in range(seeds):
                for kind in ("clean", *baselines(kinds), *kinds):
                    _run(out, results, kind, mode, peers, k, console, quiet)
    runs = results["runs"]
    for peers in sizes:
        for mode in modes:
            for kind in kinds:
                per_seed = [_ratios(runs, kind, mode, peers, k, seeds) for k in range(seeds)]
                figure = {}
                for key in ("ratio", "ratio_honest_only"):
                    values = [r[key] for r in per_seed if key in r]
                    if values:
                        figure[key] = statistics.mean(values)
                        figure[key + "_per_seed"] = values
                        figure[key + "_stdev"] = statistics.stdev(values) if len(values) > 1 else 0.0
                if kind in JOINER_KINDS:
                    figure["join_per_seed"] = [r.get("join", {}) for r in per_seed]
                results["figures"][f"{kind}_{mode}_{peers}"] = figure
    path = write_results(out, "byzantine", results)
    _print(results, path, console)
    return results


def _name(kind: str, mode: str, peers: int, seed: int, seeds: int) -> str:
    return f"{kind}_{mode}_{peers}" + (f"_seed{seed}" if seeds > 1 else "")


def _run(out: Path, results: dict, kind: str, mode: str, peers: int, seed: int, console: Console,
         quiet: Console) -> None:
    """One swarm: `kind` (or clean) in `mode`, with `peers` peers and the `seed`-th initial model; its outcome goes
    into `results` and byzantine.json at once (an interrupted bench keeps what it has)."""
    steps, seeds, hostile_count = results["steps"], results["seeds"], results["hostile_count"]
    name = _name(kind, mode, peers, seed, seeds)
    run_steps = steps * (DECOUPLED_STEPS if mode == "decoupled" else 1)
    sets = BYZANTINE_SETS + MODE_SETS[mode] + [
        f"run.total_steps={run_steps}", f"rounds.round_steps={results['round_steps']}",
        f"swarm.run_id=bench-byz-{name}", *([f"model.init_seed={1234 + seed}"] if seeds > 1 else []),
        *results["sets"]]
    cfg = load_config(None, [parse_set(sets)])
    console.print(f"[bold]{name}[/bold]: {peers - hostile_count if kind == HONEST_ONLY else peers} peers, "
                  f"{hostile_count if kind not in ('clean', HONEST_ONLY, CLEAN_JOIN) else 0} hostile, {run_steps} steps, "
                  f"{mode} ...")
    t0 = time.monotonic()
    clean = kind in ("clean", HONEST_ONLY, CLEAN_JOIN)
    hostile = {i: [f"emulate.hostile={kind}"] for i in range(hostile_count)} if not clean else {}
    n = peers - hostile_count if kind == HONEST_ONLY else peers
    joins = kind in (CLEAN_JOIN, *JOINER_KINDS)
    restart = {"chaos": JoinerRestart(n - 1)} if joins else {}  # the last peer joins again mid-run
    summary = run_local(n, cfg, out / name, None, sets, console=quiet, reraise_interrupt=True, peer_sets=hostile or None,
                        **restart)
    names = [f"peer{i}" for i in range(n)]
    hostile_names = {f"peer{i}" for i in hostile}
    outcome = _honest_outcome(summary, hostile_names)
    outcome["group_share"] = _group_share(out / name, [n for n in names if n not in hostile_names])
    if joins:
        hostile_ids = {p.get("peer_id") for p in summary["peers"] if p.get("name") in hostile_names}
        ids = {p.get("peer_id"): p.get("name") for p in summary["peers"]}
        outcome["joiner"] = joiner_outcome(out / name, names[-1], hostile_ids, ids)
        outcome["donors"] = donors_serving(summary, set(names[:-1]) - hostile_names)
        outcome["slot_s"] = slot_s(summary)
    adopted, refused = _merge_lines(out / name, [n for n in names if n not in hostile_names])
    results["runs"][name] = {"peers_finished": summary["peers_finished"], **outcome, "adopted_state": adopted,
                             "state_refused": refused, "wall_s": time.monotonic() - t0}
    write_results(out, "byzantine", results)


def _ratios(runs: dict, kind: str, mode: str, peers: int, seed: int, seeds: int) -> dict:
    """A kind's run of one seed ÷ that seed's clean run (and its honest-only run, if there is one)."""
    run = runs[_name(kind, mode, peers, seed, seeds)]
    base = runs[_name(baseline_of(kind), mode, peers, seed, seeds)]
    run["ratio"] = run["eval_loss"] / base["eval_loss"]
    if kind in JOINER_KINDS:
        run["join"] = join_against(run, base)
    honest_only = runs.get(_name(HONEST_ONLY, mode, peers, seed, seeds), {}).get("eval_loss")
    if honest_only is not None:
        run["ratio_honest_only"] = run["eval_loss"] / honest_only
    return run


def _print(results: dict, path: Path, console: Console) -> None:
    runs, seeds, steps = results["runs"], results["seeds"], results["steps"]
    console.print(f"machine: {results['machine']}")
    console.print(f"honest peers' final eval loss with {results['hostile_count']} hostile peers ÷ a clean run of the "
                  f"same size and mode (sync: {steps} steps in rounds of {results['round_steps']}; decoupled: "
                  f"{steps * DECOUPLED_STEPS} steps of 0.05 s in rounds of 1 s; default guards"
                  + (f"; each figure the mean of {seeds} seeds' ratios, ± their stdev" if seeds > 1 else "") + "):")
    for peers in results["sizes"]:
        for mode in results["modes"]:
            cleans = [runs[_name("clean", mode, peers, k, seeds)] for k in range(seeds)]
            console.print(f"  {peers} peers, {mode}: clean " + ", ".join(
                f"{c['eval_loss']:.4f} ({c['merges']:.0f} merges, {c.get('group_share', float('nan')):.1%} in groups)"
                for c in cleans))
            for base in baselines(results["kinds"]):
                console.print(f"    ({base}: " + ", ".join(_join_line(runs[_name(base, mode, peers, k, seeds)])
                                                       for k in range(seeds)) + ")")
            for kind in results["kinds"]:
                figure = results["figures"][f"{kind}_{mode}_{peers}"]
                rs = [runs[_name(kind, mode, peers, k, seeds)] for k in range(seeds)]
                ratio = f"{figure['ratio']:.3f}" + (
                    f" ± {figure['ratio_stdev']:.3f} ({', '.join(f'{x:.3f}' for x in figure['ratio_per_seed'])})"
                    if seeds > 1 else "")
                vs_honest = f" (÷ honest only {figure['ratio_honest_only']:.3f})" if "ratio_honest_only" in figure else ""
                console.print(
                    f"    {kind:11s} {statistics.mean(r['eval_loss'] for r in rs):.4f} = {ratio}{vs_honest}  merges "
                    f"{statistics.mean(r['merges'] for r in rs):.0f}, rejected {sum(r['rejected'] for r in rs)}, hostile "
                    f"bans {sum(r['hostile_banned_by_honest'] for r in rs)}, honest banned "
                    f"{sum(len(r['honest_banned_by_honest']) for r in rs)}, fewest steps "
                    f"{min(r['min_honest_step'] for r in rs)}, global models adopted {sum(r['adopted_state'] for r in rs)}"
                    f" / refused {sum(r['state_refused'] for r in rs)}, in groups "
                    f"{statistics.mean(r.get('group_share', float('nan')) for r in rs):.1%}"
                    + ("; " + ", ".join(_join_line(r) for r in rs) if kind in JOINER_KINDS else ""))
    console.print(f"wrote {path}")


def _join_line(run: dict) -> str:
    """A joiner run's eval loss, what its joiner took and when, and what the honest donors did."""
    j = run["joiner"]
    line = (f"{run['eval_loss']:.4f}, joiner took {j['joined']} state (step {j['join_step']}, "
            f"{j['refused_states']} refused by its check")
    if j.get("join_s") is not None:
        line += f"; from {j['donor']}, held {j['join_s']:.1f} s after its start, download {j['download_s']:.1f} s"
    line += ")"
    if (vs := run.get("join")):
        slot = "?" if vs["slot_s"] is None else f"{vs['slot_s']:.1f}"
        line += (f", ÷ clean_join's {vs['clean_join_s']:.1f} s = {vs['ratio']:.2f} ({vs['extra_s']:+.1f} s; one slot "
                 f"{slot} s: {'within' if vs['within_slot'] else 'NOT within'})")
    if run.get("donors"):
        line += "; donors " + ", ".join(f"{n} served {d['served']} cut {d['cut']} refused {d['refused']}"
                                        for n, d in sorted(run["donors"].items()))
    return line
