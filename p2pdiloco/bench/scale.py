"""`p2pdiloco bench scale`: what one peer costs and gets as the swarm grows, each figure ÷ the smallest swarm's.

For each N in --peers, one `run_local` swarm of N peers of the benchmark model, inner steps padded to
`STEP_S` (an emulated accelerator, so that N peers on a few cores measure the protocol, not the CPU scheduler),
timed rounds of `ROUND_S`, groups of at most `merge.group_size`. Figures, per run (`run_figures`):

- DHT bytes/s per peer: a peer's DHT bytes sent + received (its summary's `traffic.dht`) ÷ its `wall_s` (from
  its learner's start to its summary); mean and max over peers. Beside it the same from its first merge line to
  its last (`traffic.dht` and `elapsed_s` of each), mean over peers: without the start-up, where `local` makes
  every peer poll the census until all N are in it (`startup.wait_for_peers`, 0 for a peer started by hand) and
  32 peers on 2 cores take ~25 s to start. Beside it, the mean of the finds' and stores'
  bytes of the census keys and of the heartbeat shards (its summary's `dht_by_kind`), ÷ `wall_s` the same way.
- merge bytes per peer per round: a peer's merge bytes sent + received (`traffic.merge`) ÷ its rounds; mean.
  Beside it the same of its two phases, from the peer's summary: the Δ exchange (`pseudo_grad_bytes_sent` +
  `_received`) and the (θg, momentum) agreement (`state_bytes_sent` + `_received`); the rest is matchmaking. And
  the agreement's share of all peers' merge bytes, with the agreements by kind (the summaries' `state_merges`,
  `state_merges_caught_up`, `state_merges_anchored`; the rest averaged the members' states without a common anchor).
- group merge time: `merge_s` (submit to result: matchmaking, exchange, averaging) of the merge lines with
  `group_size` >= 2, all peers' pooled; median and p95 (linear interpolation between order statistics). Beside
  it the same of its two parts: `match_s` (submit until the group was formed: waiting for mates) and the rest
  (the exchange and averaging: bytes, and the CPU of encoding, guards and the robust rule, which on a few cores
  queues behind every other peer's merge of the same moment).
- rounds in a group >= 2: merge lines with `group_size` >= 2 ÷ all merge lines, all peers' pooled (a peer-round
  each, so a group of k counts k times); beside it the histogram of `group_size` over the merge lines.
- consensus distance of the final global models and whether their digests are identical (run summary).
- final eval loss of each peer's global model (its summary's `eval_loss_final`): mean, min, max.
- start-up: the `start` lines' `process_s` (process start to the learner's first line): median, max.
- host memory per peer: PSS, and USS, of the peer's whole process tree (python, its DHT process, p2pd and
  helpers; see proctree.py), from the sample nearest `MEMORY_AT` of the way from the last peer's initial eval
  to the first peer's final eval (all peers training); median and max over peers.
- CPU outside inner steps per round: user + system CPU seconds of the peer's whole process tree while it
  trained (from its first reading after the peer's initial eval line to its last reading before its final eval
  line; readings 1 s apart, so start-up and shutdown are left out, the final eval's 16 batches are not), minus
  the training thread's CPU inside all its inner steps (`compute_cpu_s`), ÷ the peer's rounds; mean and max
  over peers. What is left: the DHT process, p2pd, the network thread (merges, heartbeats), and the training
  thread's outer steps and pseudo-gradients.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

from rich.console import Console
from rich.table import Table

from p2pdiloco.app.local import run_local
from p2pdiloco.bench.common import BENCH_MODEL_SETS, machine, report, write_results
from p2pdiloco.bench.proctree import PeerSampler
from p2pdiloco.config import load_config, parse_set
from p2pdiloco.observe.status import human
from p2pdiloco.util.logfiles import read_jsonl

PEERS = (4, 8, 16, 32)
STEPS = 350
"""Inner steps per peer by default: 105 s of training at `STEP_S`."""
STEP_S = 0.3
ROUND_S = 3.0
MEMORY_AT = 0.6
SCALE_SETS = [s for s in BENCH_MODEL_SETS if not s.startswith(("run.total_steps", "emulate.min_step_s"))] + [
    f"emulate.min_step_s={STEP_S}", f"rounds.round_seconds={ROUND_S}", "merge.merge_window_s=10"]


class Figure(NamedTuple):
    key: str
    panel: str
    """What is measured; the plot draws each panel's figures on one axis."""
    stat: str
    unit: str
    """"B", "B/s", "s", "share", "loss" or "" (a plain number): how the table writes it."""


FIGURES = (
    Figure("dht_bytes_per_s_mean", "DHT bytes/s per peer", "mean", "B/s"),
    Figure("dht_bytes_per_s_max", "DHT bytes/s per peer", "max", "B/s"),
    Figure("dht_merging_bytes_per_s", "DHT bytes/s per peer", "first to last merge, mean", "B/s"),
    Figure("dht_census_bytes_per_s", "DHT bytes/s per peer, by key", "census, mean", "B/s"),
    Figure("dht_records_bytes_per_s", "DHT bytes/s per peer, by key", "peer records, mean", "B/s"),
    Figure("merge_bytes_per_round", "merge bytes per peer per round", "mean", "B"),
    Figure("delta_bytes_per_round", "merge bytes per peer per round", "of it Δ exchange, mean", "B"),
    Figure("agreement_bytes_per_round", "merge bytes per peer per round", "of it agreement, mean", "B"),
    Figure("agreement_share", "agreement share of merge bytes", "all peers", "share"),
    Figure("merge_s_median", "group merge time", "median", "s"),
    Figure("merge_s_p95", "group merge time", "p95", "s"),
    Figure("match_s_median", "group merge time", "of it matchmaking, median", "s"),
    Figure("match_s_p95", "group merge time", "of it matchmaking, p95", "s"),
    Figure("exchange_s_median", "group merge time", "of it exchange, median", "s"),
    Figure("exchange_s_p95", "group merge time", "of it exchange, p95", "s"),
    Figure("group_share", "rounds merged in a group >= 2", "all peers", "share"),
    Figure("consensus_distance", "consensus distance, final models", "largest pair", ""),
    Figure("eval_loss_mean", "final eval loss", "mean", "loss"),
    Figure("eval_loss_min", "final eval loss", "min", "loss"),
    Figure("eval_loss_max", "final eval loss", "max", "loss"),
    Figure("startup_s_median", "start-up", "median", "s"),
    Figure("startup_s_max", "start-up", "max", "s"),
    Figure("pss_median", "host memory per peer", "PSS median", "B"),
    Figure("pss_max", "host memory per peer", "PSS max", "B"),
    Figure("uss_median", "host memory per peer", "USS median", "B"),
    Figure("uss_max", "host memory per peer", "USS max", "B"),
    Figure("cpu_per_round_mean", "CPU s per round outside inner steps", "mean", "s"),
    Figure("cpu_per_round_max", "CPU s per round outside inner steps", "max", "s"),
)


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) with linear interpolation between order statistics; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _spread(values: list[float], key: str, center=statistics.median, stat: str = "median") -> dict:
    """{key_<stat>: center(values), key_max: max(values)}, Nones for no values."""
    return {f"{key}_{stat}": center(values) if values else None, f"{key}_max": max(values) if values else None}


def training_window(rows: list[dict]) -> tuple[float, float] | None:
    """(Unix time of a peer's initial eval line, of its final eval line): when it trained; None without both."""
    evals = [r for r in rows if r.get("kind") == "eval"]
    start = next((r["t"] for r in evals if not r.get("final")), None)
    end = next((r["t"] for r in evals if r.get("final")), None)
    return (start, end) if start is not None and end is not None and start < end else None


def memory_at(samples: list[tuple[float, dict]], rows: dict[str, list[dict]], at: float = MEMORY_AT
              ) -> tuple[float, dict[str, dict[str, int]]] | None:
    """The memory sample taken nearest `at` of the way through the time when every peer was training.

    Args:
        samples: [(Unix time, {peer: {"pss": bytes, "uss": bytes}})], as `PeerSampler.memory`.
        rows: each peer's metrics lines (see `training_window`).
        at: where in that time, 0..1.

    Returns:
        (where the sample was taken, 0..1, its memory per peer), or None if no sample of every peer fell inside.
    """
    windows = [training_window(rs) for rs in rows.values()]
    if not windows or None in windows or max(w[0] for w in windows) >= min(w[1] for w in windows):
        return None
    start, end = max(w[0] for w in windows), min(w[1] for w in windows)
    inside = [(t, m) for t, m in samples if start <= t <= end and set(rows) <= set(m)]
    if not inside:
        return None
    t, mem = min(inside, key=lambda s: abs(s[0] - (start + at * (end - start))))
    return (t - start) / (end - start), mem


def cpu_while_training(readings: list[tuple[float, float]], rows: list[dict]) -> float | None:
    """CPU seconds of a peer's process tree from its first reading in its training window to its last one.

    Args:
        readings: [(Unix time, CPU seconds so far)], as `PeerSampler.cpu`.
        rows: the peer's metrics lines (see `training_window`).
    """
    window = training_window(rows)
    inside = [cpu for t, cpu in readings if window and window[0] <= t <= window[1]]
    return inside[-1] - inside[0] if len(inside) >= 2 else None


def run_figures(summary: dict, rows: dict[str, list[dict]], cpu: dict[str, list[tuple[float, float]]],
                memory: list[tuple[float, dict]]) -> dict:
    """The module docstring's figures for one run.

    Args:
        summary: the run's summary (`run_local`'s return, summary.json).
        rows: {peer name: its metrics lines}.
        cpu: {peer name: its process tree's CPU readings}, as `PeerSampler.cpu`.
        memory: the memory samples, as `PeerSampler.memory`.
    """
    peers = summary["peers"]

    def both(p: dict, kind: str) -> int:
        return p["traffic"][kind]["sent"] + p["traffic"][kind]["received"]

    dht_rate = [both(p, "dht") / p["wall_s"] for p in peers if p["wall_s"] > 0]
    by_kind = {kind: [p["dht_by_kind"][kind] / p["wall_s"] for p in peers if p["wall_s"] > 0 and "dht_by_kind" in p]
               for kind in ("census", "peer records")}
    merging = [rate for rs in rows.values() if (rate := _dht_rate_while_merging(rs)) is not None]
    merge_bytes = [both(p, "merge") / p["rounds"] for p in peers if p["rounds"] > 0]
    phases = _phase_bytes(peers)
    merges = [r for rs in rows.values() for r in rs if r.get("kind") == "merge"]
    group_merge_s = [r["merge_s"] for r in merges if r["group_size"] >= 2]
    match_s = [r["match_s"] for r in merges if r["group_size"] >= 2 and "match_s" in r]
    exchange_s = [r["merge_s"] - r["match_s"] for r in merges if r["group_size"] >= 2 and "match_s" in r]
    starts = [r["process_s"] for rs in rows.values() for r in rs if r.get("kind") == "start"]
    losses = [p["eval_loss_final"] for p in peers]
    trained = {p["name"]: cpu_while_training(cpu.get(p["name"], []), rows.get(p["name"], [])) for p in peers}
    cpu_per_round = [(trained[p["name"]] - p["compute_cpu_s"]) / p["rounds"] for p in peers
                     if trained[p["name"]] is not None and p["rounds"] > 0]
    sampled = memory_at(memory, rows)
    mem = list(sampled[1].values()) if sampled else []
    return {
        "peers_finished": summary["peers_finished"],
        "dht_bytes_per_s_mean": statistics.mean(dht_rate) if dht_rate else None,
        "dht_bytes_per_s_max": max(dht_rate) if dht_rate else None,
        "dht_merging_bytes_per_s": statistics.mean(merging) if merging else None,
        "dht_census_bytes_per_s": statistics.mean(by_kind["census"]) if by_kind["census"] else None,
        "dht_records_bytes_per_s": statistics.mean(by_kind["peer records"]) if by_kind["peer records"] else None,
        "merge_bytes_per_round": statistics.mean(merge_bytes) if merge_bytes else None,
        **phases,
        "merge_s_median": percentile(group_merge_s, 0.5), "merge_s_p95": percentile(group_merge_s, 0.95),
        "match_s_median": percentile(match_s, 0.5), "match_s_p95": percentile(match_s, 0.95),
        "exchange_s_median": percentile(exchange_s, 0.5), "exchange_s_p95": percentile(exchange_s, 0.95),
        "group_share": len(group_merge_s) / len(merges) if merges else None,
        "group_sizes": {str(k): v for k, v in sorted(Counter(r["group_size"] for r in merges).items())},
        "alone_causes": alone_causes(merges),
        "consensus_distance": summary["consensus_distance"],
        "global_models_identical": summary["global_models_identical"],
        "final_models": summary.get("final_models"), "eval_loss_final_spread": summary.get("eval_loss_final_spread"),
        "eval_loss_mean": statistics.mean(losses) if losses else None,
        "eval_loss_min": min(losses) if losses else None, "eval_loss_max": max(losses) if losses else None,
        **_spread(starts, "startup_s"),
        **_spread([m["pss"] for m in mem], "pss"), **_spread([m["uss"] for m in mem], "uss"),
        "memory_at": sampled[0] if sampled else None,
        **_spread(cpu_per_round, "cpu_per_round", statistics.mean, "mean"),
        "rounds_mean": statistics.mean(p["rounds"] for p in peers) if peers else None,
        "merge_failures": sum(p["merge_failures"] for p in peers),
    }


def alone_causes(merges: list[dict]) -> dict[str, int]:
    """Merges alone by cause, most first: the search's (`search.ALONE_CAUSES`, a decline with its invitees'
    words), `failed` for a group merge abandoned, `unknown` for a line without a cause (a peer of an older version)."""
    causes = Counter("failed" if r.get("failure") else r.get("alone_cause") or "unknown"
                     for r in merges if r["group_size"] < 2)
    return dict(causes.most_common())


def _phase_bytes(peers: list[dict]) -> dict:
    """The merge bytes' split into the Δ exchange and the agreement (see the module docstring); Nones where a peer's
    summary does not split them (a peer of an older version)."""
    keys = ("pseudo_grad_bytes_sent", "pseudo_grad_bytes_received", "state_bytes_sent", "state_bytes_received")
    counted = [p for p in peers if p["rounds"] > 0]
    if not counted or not all(k in p for p in counted for k in keys):
        return {"delta_bytes_per_round": None, "agreement_bytes_per_round": None, "agreement_share": None,
                "agreements": None}
    delta = [(p["pseudo_grad_bytes_sent"] + p["pseudo_grad_bytes_received"]) / p["rounds"] for p in counted]
    agreement = [p["state_bytes_sent"] + p["state_bytes_received"] for p in counted]
    merge = sum(p["traffic"]["merge"]["sent"] + p["traffic"]["merge"]["received"] for p in counted)
    every, caught_up, anchored = (sum(p.get(k, 0) for p in counted)
                                  for k in ("state_merges", "state_merges_caught_up", "state_merges_anchored"))
    return {"delta_bytes_per_round": statistics.mean(delta),
            "agreement_bytes_per_round": statistics.mean(a / p["rounds"] for a, p in zip(agreement, counted, strict=True)),
            "agreement_share": sum(agreement) / merge if merge else None,
            "agreements": {"all": every, "caught_up": caught_up, "anchored": anchored,
                           "averaged": every - caught_up - anchored}}


def _dht_rate_while_merging(rows: list[dict]) -> float | None:
    """A peer's DHT bytes sent + received per second from its first merge line to its last; None with fewer than
    two merges apart in time."""
    merges = [r for r in rows if r.get("kind") == "merge" and "traffic" in r and "elapsed_s" in r]
    if len(merges) < 2 or merges[-1]["elapsed_s"] <= merges[0]["elapsed_s"]:
        return None
    dht = [m["traffic"]["dht"]["sent"] + m["traffic"]["dht"]["received"] for m in (merges[0], merges[-1])]
    return (dht[1] - dht[0]) / (merges[-1]["elapsed_s"] - merges[0]["elapsed_s"])


def add_ratios(runs: dict[str, dict]) -> None:
    """Each run's `ratios`: every figure ÷ the same figure of the smallest swarm (None where either is None or
    the baseline is 0)."""
    base = runs[min(runs, key=int)]
    for run in runs.values():
        run["ratios"] = {f.key: run[f.key] / base[f.key] if run[f.key] is not None and base[f.key] else None
                         for f in FIGURES}


def bench_scale(out: Path, peers: tuple[int, ...] = PEERS, steps: int = STEPS, group_size: int | None = None,
                extra_sets: tuple[str, ...] = (), console: Console | None = None) -> dict:
    """One swarm per N in `peers` (smallest first, the baseline), `steps` inner steps each; `group_size` sets
    merge.group_size (None: the config's); `extra_sets` override the bench's settings (`--set`, e.g. a longer
    `emulate.min_step_s` and `rounds.round_seconds`, for a machine with fewer cores than peers). Writes scale.json
    after every run, and scale.png."""
    console = console or Console()
    out.mkdir(parents=True, exist_ok=True)
    quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115 - closed with the process
    extra = ([f"merge.group_size={group_size}"] if group_size is not None else []) + list(extra_sets)
    base = load_config(None, [parse_set(SCALE_SETS + extra)])
    step_s, round_s = base.emulate.min_step_s, base.rounds.round_seconds
    results: dict = {"machine": machine(), "steps": steps, "step_s": step_s, "round_s": round_s,
                     "group_size": base.merge.group_size, "sets": list(extra_sets), "peers": sorted(peers), "runs": {}}
    for n in sorted(peers):
        name = f"peers{n}"
        sets = SCALE_SETS + extra + [f"run.total_steps={steps}", f"swarm.run_id=bench-scale-{n}"]
        cfg = load_config(None, [parse_set(sets)])
        console.print(f"[bold]{name}[/bold]: {n} peers, {steps} steps of {step_s} s, rounds of {round_s} s ...")
        t0 = time.monotonic()
        with PeerSampler() as sampler:
            summary = run_local(n, cfg, out / name, None, sets, console=quiet, reraise_interrupt=True)
        if summary["peers_finished"] != n:
            raise RuntimeError(f"{name}: only {summary['peers_finished']} of {n} peers finished; see {out / name}")
        rows = {f"peer{i}": read_jsonl(out / name / "peers" / f"peer{i}" / "metrics.jsonl") for i in range(n)}
        run = run_figures(summary, rows, sampler.cpu, sampler.memory)
        results["runs"][str(n)] = {**run, "wall_s": time.monotonic() - t0}
        add_ratios(results["runs"])
        write_results(out, "scale", results)  # after every run: an interrupted bench keeps what it has
    plot_scale(results, out / "scale.png")
    console.print(f"plot: {out / 'scale.png'}")
    return report(out, "scale", results, print_scale, console)


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit in ("B", "B/s"):
        return human(value, unit)
    if unit == "share":
        return f"{value:.1%}"
    if unit == "loss":
        return f"{value:.4f}"
    if unit == "s":
        return f"{value:.3f} s"
    return f"{value:.3g}"


def _kinds(agreements: dict | None) -> str:
    if not agreements:
        return "-"
    return f"{agreements['all']}: {agreements['caught_up']} / {agreements['anchored']} / {agreements['averaged']}"


def print_scale(results: dict, console: Console) -> None:
    """A table of every figure per N, each beside its ratio to the smallest N's."""
    runs, ns = results["runs"], [str(n) for n in results["peers"] if str(n) in results["runs"]]
    console.print(f"machine: {results['machine']}")
    table = Table(title=f"bench scale: {results['steps']} inner steps of {results['step_s']} s per peer, rounds of "
                  f"{results['round_s']} s, groups of at most {results['group_size']}; (× N={ns[0]})")
    table.add_column("figure")
    for n in ns:
        table.add_column(f"N={n}", justify="right")
    for f in FIGURES:
        cells = []
        for n in ns:
            ratio = runs[n]["ratios"][f.key]
            cells.append(_fmt(runs[n][f.key], f.unit) + ("" if n == ns[0] or ratio is None else f" ({ratio:.2f}×)"))
        table.add_row(f"{f.panel}, {f.stat}", *cells)
    table.add_row("group sizes (peer-rounds)", *(" ".join(f"{k}:{v}" for k, v in runs[n]["group_sizes"].items())
                                                for n in ns))
    table.add_row("merges alone by cause", *(" ".join(f"{k}:{v}" for k, v in runs[n].get("alone_causes", {}).items())
                                            or "-" for n in ns))
    table.add_row("agreements (peer-merges): caught up / anchored / averaged",
                  *(_kinds(runs[n].get("agreements")) for n in ns))
    table.add_row("global models identical", *(str(runs[n]["global_models_identical"]) for n in ns))
    table.add_row("final models (1 % eval loss)", *(str(runs[n].get("final_models")) for n in ns))
    table.add_row("memory sampled at (of training)", *(_fmt(runs[n]["memory_at"], "share") for n in ns))
    table.add_row("rounds per peer, mean", *(f"{runs[n]['rounds_mean']:.1f}" for n in ns))
    table.add_row("merge failures, all peers", *(str(runs[n]["merge_failures"]) for n in ns))
    table.add_row("run wall time", *(f"{runs[n]['wall_s']:.0f} s" for n in ns))
    console.print(table)


def plot_scale(results: dict, path: Path) -> None:
    """One panel per measured thing, its figures against N (log2 axis)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure as MplFigure

    panels: dict[str, list[Figure]] = {}
    for f in FIGURES:
        panels.setdefault(f.panel, []).append(f)
    ns = [n for n in results["peers"] if str(n) in results["runs"]]
    cols = 3
    rows = -(-len(panels) // cols)
    fig = MplFigure(figsize=(5 * cols, 3.4 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    for ax, (panel, figures) in zip(axes, panels.items(), strict=False):
        unit = figures[0].unit
        values = [results["runs"][str(n)][f.key] for f in figures for n in ns]
        scale, label = (1e6, "M" + unit) if unit.startswith("B") and max(v or 0 for v in values) >= 1e6 else (
            (1e3, "k" + unit) if unit.startswith("B") else (1.0, unit))
        for f in figures:
            points = [(n, results["runs"][str(n)][f.key] / scale) for n in ns
                      if results["runs"][str(n)][f.key] is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=f.stat)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("peers")
        if unit != "loss":  # from 0, so that growth reads as a proportion
            ax.set_ylim(bottom=0)
        ax.set_title(panel + (f" ({label})" if label not in ("", "share", "loss") else ""))
        ax.legend(fontsize="small")
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"bench scale ({results['machine']})")
    fig.savefig(path, dpi=100)
