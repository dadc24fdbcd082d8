"""What `p2pdiloco simulate` prints and draws: the results table, the seeds' comparison, calibration, plots."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from p2pdiloco.sim.presets import SEEDS_PUBLISHED


def _num(v, fmt: str = ".3f") -> str:
    return "-" if v is None else format(v, fmt)


def print_results(results: dict, timing: dict, console: Console) -> None:
    """One line per algorithm, then what the simulation cost."""
    run = results["scenario"]["run"]
    console.print(f"{run['learners']} learners, seed {run['seed']}:")
    console.print(f"  {'algorithm':22s} {'goodput':>8s} {'tokens/s':>12s} {'to budget':>10s} {'GB/learner':>11s} "
                  f"{'link Gbps':>10s} {'group':>6s} {'failures':>8s}")
    for name, r in results["algorithms"].items():
        budget = r.get("time_to_budget_s")
        mb = r.get("bytes_per_learner")
        console.print(f"  {name:22s} {r['goodput']:8.3f} {r['tokens_per_s']:12.4g} "
                      f"{_num(budget, '.0f') + (' s' if budget is not None else ''):>10s} "
                      f"{_num(mb / 1e9 if mb is not None else None, '.4g'):>11s} {r['link_gbps_needed']:10.4g} "
                      f"{_num(r.get('group_size_mean'), '.2f'):>6s} {r['kills']:8d}"
                      + ("  (gave up: failures faster than restarts)" if r.get("gave_up") else ""))
    if (d := results["algorithms"].get("decoupled")) and "delta_bytes_per_learner_round" in d:
        print_consensus(d, console)
    events = sum(t["events"] for t in timing.values())
    wall = sum(t["wall_s"] for t in timing.values())
    console.print(f"simulated {events:,} events in {wall:.2f} s ({1e6 * wall / max(events, 1):.2f} µs per event, "
                  f"{events / max(wall, 1e-9):,.0f} events/s)")
    console.print("goodput: compute that reached a model ÷ compute spent (bench churn's rule, as far as the model "
                  "goes); link Gbps: what one learner's link must carry to keep up (decoupled/sync: a merge within a "
                  "round; data-parallel: an all-reduce within a step)")


def print_consensus(r: dict, console: Console) -> None:
    """A decoupled run's bytes a learner a round, Δ and agreement apart, and how far its groups' models are apart."""
    mixing = r["mixing_rounds"]
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(r["agreements"].items())) or "none"
    console.print(f"decoupled: merge bytes a learner a round (sent) {r['delta_bytes_per_learner_round'] / 1e6:.4g} MB Δ "
                  f"+ {r['agreement_bytes_per_learner_round'] / 1e6:.4g} MB agreement; rounds {r['round_s']:.4g} s, "
                  f"{r['in_group_share']:.1%} merged in a group; group merges by agreement: {kinds}")
    console.print(f"  consensus: a contribution reached every learner in "
                  f"{'-' if mixing is None else format(mixing, '.3g')} rounds (median of {r['mixing_reached']} of "
                  f"{r['mixing_followed']} followed that did); distinct global models {r['distinct_models_mean']:.4g} "
                  f"(mean at each epoch's dealing), {r['final_models']} at the end")


def print_seeds(results: dict, goodput_16: float, console: Console) -> None:
    """The simulated figures beside the seeds' published ones."""
    pub = SEEDS_PUBLISHED
    a = results["algorithms"]
    console.print(f"beside Decoupled DiLoCo (arXiv 2604.21428), {pub['chips']:,} chips:")
    for name, published in pub["goodput"].items():
        if name not in a:  # left out of run.algorithms
            continue
        console.print(f"  goodput {name:22s} simulated {a[name]['goodput']:.3f}   published {published:.2f}")
    console.print(f"  goodput decoupled, 16 learners  simulated {goodput_16:.3f}   published {pub['goodput_16_learners']:.2f}")
    for name, published in pub["link_gbps"].items():
        if name not in a:
            continue
        console.print(f"  link Gbps {name:20s} simulated {a[name]['link_gbps_needed']:.3g}   published {published:g}")
    console.print("  (p2pdiloco's protocol with the assumptions of p2pdiloco/sim/presets.py; docs/simulation.md says "
                  "where they differ from the seeds')")


def print_calibration(cal: dict, console: Console) -> None:
    console.print(f"calibration against {cal['run_dir']} (bench {cal['kind']}); inputs read from the run: "
                  f"{cal['inputs']}")
    for title, rows in (("straggler ratio", cal.get("ratio", {})), ("goodput", cal["goodput"])):
        for name, v in rows.items():
            m, s = v["measured"], v["simulated"]
            diff = f"{s - m:+.3f}" if m is not None else "-"
            console.print(f"  {title} {name:24s} measured {_num(m)}   simulated {s:.3f}   difference {diff}")


def plot_sweeps(failure_rows: list[dict], failure_key: str, n_rows: list[dict], out: Path) -> list[Path]:
    """goodput_vs_failure_rate.png (the seeds' Figure 2, middle) and scaling.png (goodput and link rate against N)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    paths = []
    if failure_rows:
        fig = Figure(figsize=(6, 4), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        names = [k for k in failure_rows[0] if k != failure_key]
        x = [3600.0 / r[failure_key] for r in failure_rows]  # failures per learner-hour
        for name in names:
            ax.plot(x, [r[name]["goodput"] for r in failure_rows], marker="o", label=name)
        ax.set_xscale("log")
        ax.set_xlabel("failures per learner per hour")
        ax.set_ylabel("goodput")
        ax.set_ylim(0, 1.02)
        ax.set_title("goodput against failure rate")
        ax.legend()
        paths.append(out / "goodput_vs_failure_rate.png")
        fig.savefig(paths[-1], dpi=100)
    if n_rows:
        fig = Figure(figsize=(10, 4), layout="constrained")
        FigureCanvasAgg(fig)
        ax1, ax2 = fig.subplots(1, 2)
        names = [k for k in n_rows[0] if k != "learners"]
        x = [r["learners"] for r in n_rows]
        for name in names:
            ax1.plot(x, [r[name]["goodput"] for r in n_rows], marker="o", label=name)
            ax2.plot(x, [r[name]["link_gbps_needed"] for r in n_rows], marker="o", label=name)
        for ax in (ax1, ax2):
            ax.set_xscale("log")
            ax.set_xticks(x, [str(v) for v in x])
            ax.minorticks_off()
            ax.set_xlabel("learners")
        ax1.set_ylabel("goodput")
        ax1.set_ylim(0, 1.02)
        ax2.set_yscale("log")
        ax2.set_ylabel("link rate needed per learner (Gbit/s)")
        ax1.legend()
        fig.suptitle("goodput and bandwidth against swarm size")
        paths.append(out / "scaling.png")
        fig.savefig(paths[-1], dpi=100)
    return paths
