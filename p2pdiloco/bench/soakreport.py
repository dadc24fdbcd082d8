"""`bench soak`'s figures from its samples: slopes and growth beside their limits, the share of group merges early
and late, what was left after the run; printed, and drawn one plot per figure against time."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from p2pdiloco.bench.soakprobe import (
    COUNT_LIMIT,
    COUNTS,
    EDGE,
    PSS_LIMIT_MB_PER_H,
    ROLES,
    flatness,
    slope_per_hour,
)
from p2pdiloco.util.logfiles import read_jsonl

SHARE_LIMIT = 0.05
"""The most a peer's share of group merges may fall from the first window to the last."""


def group_shares(run_dir: Path, start: float, end: float, window_s: float) -> dict[str, dict]:
    """Per peer, the share of its merges that were in a group (not alone) in the first and the last `window_s`
    of the run (Unix times `start`, `end`), from its metrics.jsonl."""
    shares = {}
    for path in sorted(run_dir.glob("peers/*/metrics.jsonl")):
        merges = [r for r in read_jsonl(path) if r.get("kind") == "merge" and "t" in r]
        row = {}
        for name, lo, hi in (("first", start, start + window_s), ("last", end - window_s, end)):
            inside = [r for r in merges if lo <= r["t"] <= hi]
            row[name] = sum(r.get("group_size", 1) > 1 for r in inside) / len(inside) if inside else None
            row[f"{name}_merges"] = len(inside)
        row["drop"] = row["first"] - row["last"] if None not in (row["first"], row["last"]) else None
        shares[path.parent.name] = row
    return shares


def analyse(raw: dict, warmup_s: float, run_dir: Path) -> dict:
    """The soak's figures from its raw samples (see `Soak.run`)."""
    samples = raw["samples"]
    after = [s for s in samples if s["elapsed_s"] >= warmup_s]
    disk = [(s["elapsed_s"], s["run_bytes"] / 1e6) for s in after]
    records = [(s["elapsed_s"], s["dht_records"]["stored"]) for s in after if s.get("dht_records")]
    end = samples[-1]["t"] if samples else raw["start_unix"]
    levels = [lv for lv in raw["levels"] if "growth" in lv]
    worst = {k: max((abs(lv["growth"].get(k, 0)) for lv in levels), default=0)
             for k in sorted({k for lv in levels for k in lv["growth"]})}
    summary = raw["summary"]
    left = {e["peer"] for e in raw["events"] if e["event"] in ("leave", "exit")}
    digests = {p["name"]: p.get("global_digest") for p in summary.get("peers", [])}
    at_end = {name: d for name, d in digests.items() if name not in left}
    return {
        "flatness": flatness(samples, warmup_s),
        "run_mb_per_h": slope_per_hour(disk),
        "run_mb_last": disk[-1][1] if disk else None,
        "dht_records_per_h": slope_per_hour(records),
        "dht_records_first_last": [records[0][1], records[-1][1]] if records else None,
        "sockets_ours_stale_max_after_warmup": max((s["sockets"]["ours_stale"] for s in after), default=None),
        "level_cycles": len(levels), "level_cycles_unfinished": len(raw["levels"]) - len(levels),
        "level_worst_growth": worst,
        "group_shares": group_shares(run_dir, raw["start_unix"], end, warmup_s),
        "final_models": summary.get("final_models"), "final_digests": digests,
        "final_models_identical_at_end": len(set(at_end.values())) == 1 if at_end else None,
        "left_before_end": sorted(left),
        "unscheduled_exits": {e["peer"]: e.get("returncode") for e in raw["events"] if e["event"] == "exit"},
    }


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _robust(r: dict | None) -> tuple[str, str]:
    """The least-squares slope's 95 % interval and the Theil-Sen slope (`robust_slope_per_hour`), as printed."""
    return ("-", "-") if r is None else (f"±{r['ci95']:.2f}", f"{r['theil_sen']:.2f}")


def print_soak(r: dict, console: Console) -> None:
    """Print the soak's figures beside their limits."""
    console.print(f"machine: {r['machine']}")
    table = Table(title=f"after the {r['schedule']['warmup_s']:.0f} s warm-up: PSS floor slope <= {PSS_LIMIT_MB_PER_H} "
                  f"MB/h, fds/threads/children: median of the last {EDGE} samples - of the first {EDGE} <= {COUNT_LIMIT}")
    for col in ("tree", "role", "pid", "span min", "PSS MB", "PSS floor MB/h", "PSS MB/h", "±95%", "Theil-Sen",
                "USS MB/h", "anon MB/h", "anon Theil-Sen", *COUNTS, "ok"):
        table.add_column(col, justify="left" if col in ("tree", "role") else "right", no_wrap=True)
    for f in r["flatness"]:
        table.add_row(f["tree"], f["role"], str(f["pid"]), f"{f['span_s'] / 60:.0f}", _fmt(f["pss_mb_last"], ".0f"),
                      _fmt(f.get("pss_floor_mb_per_h")), _fmt(f["pss_mb_per_h"]), *_robust(f.get("pss_robust")), _fmt(f["uss_mb_per_h"]),
                      _fmt(f.get("anon_mb_per_h")), _robust(f.get("anon_robust"))[1],
                      *(f"{f[k + '_first']}→{f[k + '_last']}" for k in COUNTS),
                      {True: "yes", False: "[red]NO[/red]", None: "(restarted)"}[f["ok"]])
    console.print(table)
    console.print("PSS floor: the slope of the lowest sample of every 5 minutes, which the limit judges (a main "
                  "process's PSS swings by tens of MB with its merges; a leak raises the floor it returns to). PSS: of "
                  "every sample; ±95%: its 95 % interval, for residuals that follow each other; Theil-Sen: the median "
                  "of pairwise slopes.")
    worst = ", ".join(f"{k} {v}" for k, v in r["level_worst_growth"].items() if v) or "none"
    console.print(f"kill/stop cycles: {r['level_cycles']} back in a group ({r['level_cycles_unfinished']} not "
                  f"back by the end); counts after a restart - before, largest |difference| over 0: {worst}")
    console.print(f"run folder: {_fmt(r['run_mb_last'], '.1f')} MB at the end, {_fmt(r['run_mb_per_h'])} MB/h "
                  f"after the warm-up; DHT records held by the observer node: {r['dht_records_first_last']} "
                  f"(first, last after the warm-up), {_fmt(r['dht_records_per_h'], '.1f')} per hour")
    b, a = r["before"], r["after"]
    console.print(f"socket files of this run's daemons left behind: at most {r['sockets_ours_stale_max_after_warmup']}"
                  f" at a sample after the warm-up, {a['ours_stale']} stale and {a['ours']} in all after the run; "
                  f"machine: {b['machine']} files ({b['machine_stale']} stale) before, {a['machine']} "
                  f"({a['machine_stale']} stale) after; /dev/shm entries {b['shm']} -> {a['shm']}; "
                  f"processes of the run still alive: {len(a['processes'])}")
    for name, s in r["group_shares"].items():
        console.print(f"  {name}: share of merges in a group, first {r['schedule']['warmup_s'] / 60:g} min "
                      f"{_fmt(s['first'], '.3f')} ({s['first_merges']} merges), last {_fmt(s['last'], '.3f')} "
                      f"({s['last_merges']}), drop {_fmt(s['drop'], '.3f')} (limit {SHARE_LIMIT})")
    console.print(f"final models of the peers there at the end: "
                  f"{'identical' if r['final_models_identical_at_end'] else 'NOT identical'} (digests "
                  f"{r['final_digests']}; left before the end, with the model they had then: {r['left_before_end']})")
    if r.get("unscheduled_exits"):
        console.print(f"[red]peers that exited outside the schedule (not restarted; exit status):[/red] "
                      f"{r['unscheduled_exits']}")


FIGURES = {
    "pss": ("PSS (MB)", 1e6), "uss": ("USS (MB)", 1e6), "anon": ("anonymous memory (MB)", 1e6),
    "fds": ("open file descriptors", 1),
    "threads": ("threads", 1), "children": ("child processes", 1),
}


def plot_soak(r: dict, out: Path) -> list[Path]:
    """One PNG per figure against minutes (per process: one line per tree and role), the warm-up's end and every
    event marked; returns their paths."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    samples = r["samples"]
    timed = [(s["elapsed_s"] / 60, s) for s in samples]
    paths = []

    def figure(name: str, title: str, ylabel: str, lines: dict[str, list[tuple[float, float]]]) -> None:
        fig = Figure(figsize=(11, 5), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        for label, pts in lines.items():
            if pts:
                ax.plot([t for t, _ in pts], [v for _, v in pts], marker=".", markersize=3, linewidth=1, label=label)
        ax.axvline(r["schedule"]["warmup_s"] / 60, color="grey", linestyle="--", linewidth=0.8)
        for e in r["events"]:
            if e["event"] in ("kill", "term", "join", "leave"):
                ax.axvline(e["at_s"] / 60, color="red" if e["event"] == "kill" else "orange", alpha=0.3, linewidth=0.8)
        ax.set_xlabel("minutes (dashed: end of warm-up; red: kill, orange: stop or join)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        if len(lines) <= 30:
            ax.legend(fontsize=6, ncols=4)
        path = out / f"soak-{name}.png"
        fig.savefig(path, dpi=90)
        paths.append(path)

    trees = sorted({t for s in samples for t in s["trees"]})
    for key, (ylabel, scale) in FIGURES.items():
        lines = {f"{tree}.{role}": [(m, s["trees"][tree][role][key] / scale) for m, s in timed
                                    if key in s["trees"].get(tree, {}).get(role, {})] for tree in trees for role in ROLES}
        figure(key, f"{ylabel} per process", ylabel, {k: v for k, v in lines.items() if v})
    figure("sockets", "hivemind socket files in /tmp", "files",
           {k: [(m, s["sockets"][k]) for m, s in timed] for k in ("ours", "ours_stale", "machine_stale")})
    figure("disk", "run folder on disk", "MB", {"run folder": [(m, s["run_bytes"] / 1e6) for m, s in timed]})
    figure("dht", "DHT records held by the observer node", "records",
           {k: [(m, s["dht_records"][k]) for m, s in timed if s.get("dht_records")]
            for k in ("stored", "cached")})
    return paths
