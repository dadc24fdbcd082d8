"""`p2pdiloco bench wan`: peers in homes behind routers (NAT or not) over shaped links, beside the same on `lan`.

For each profile (`lan` first, the baseline, then the one asked for), the bench builds a WAN lab (wanlab.py) of
`peers` homes, the first `nat` of them behind NAT routers, the rest behind routers that only route (reachable),
prints what the lab measured of itself (wanaccuracy.py), starts a bootstrap node in the hub and one peer per
home with the public CLI (`p2pdiloco peer --initial-peers ...`), the benchmark model with inner steps padded to
`step_s` and timed rounds, and reports per peer:

- rounds merged in a group (`group_size` >= 2) and alone, from its merge lines;
- the median time of its group merges (`merge_s`, submit to result);
- its final global model's digest, and whether every peer's is the same.

Needs root, iproute2, iptables and, for delay and loss, the NetfilterQueue package (`p2pdiloco[lab]`).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from p2pdiloco.bench.common import BENCH_MODEL_SETS, machine, report, write_results
from p2pdiloco.bench.nsswarm import merge_rows, run_swarm
from p2pdiloco.bench.wanaccuracy import measure, print_accuracy
from p2pdiloco.bench.wanlab import HUB_ADDR, WanLab, check_can_run, profile_links
from p2pdiloco.config import ConfigError, load_config, parse_set

STEP_S = 0.3
ROUND_S = 3.0
STEPS = 200
"""Inner steps per peer by default: 60 s of training at `STEP_S`."""
BOOTSTRAP_PORT = 31338
WAN_SETS = [s for s in BENCH_MODEL_SETS if not s.startswith(("run.total_steps", "emulate.min_step_s"))] + [
    f"emulate.min_step_s={STEP_S}", f"rounds.round_seconds={ROUND_S}", "merge.merge_window_s=10",
    "run.checkpoint_every=0"]


def peer_figures(run_dir: Path, summaries: dict[str, dict]) -> list[dict]:
    """Per peer: group and alone rounds, median group merge time, final digest (see the module docstring).

    Args:
        run_dir: the run's folder (peers/peer<i>/metrics.jsonl).
        summaries: {peer name: its peer summary} (from the run's summary).
    """
    rows = []
    for i in range(len(summaries)):
        name = f"peer{i}"
        merges = merge_rows(run_dir / "peers" / name / "metrics.jsonl")
        group = [r["merge_s"] for r in merges if r.get("group_size", 1) >= 2]
        rows.append({"peer": name, "group_rounds": len(group), "alone_rounds": len(merges) - len(group),
                     "group_merge_s_median": statistics.median(group) if group else None,
                     "global_digest": summaries.get(name, {}).get("global_digest"),
                     "eval_loss_final": summaries.get(name, {}).get("eval_loss_final")})
    return rows


def run_profile(profile: str, peers: int, nat: int, steps: int, out: Path, extra_sets: list[str],
                console: Console) -> dict:
    """One lab of `profile`, its accuracy, and one swarm in it; the figures of both."""
    links = profile_links(profile, peers)
    sets = WAN_SETS + extra_sets + [f"run.total_steps={steps}", f"swarm.run_id=bench-wan-{profile}"]
    cfg = load_config(None, [parse_set(sets)])
    with WanLab(links, nat=[i < nat for i in range(peers)], tag=profile[:4]) as lab:
        console.print(f"[bold]{profile}[/bold]: {peers} peers ({nat} behind NAT), the lab measured:")
        accuracy = measure(lab)
        print_accuracy(accuracy, console)
        console.print(f"  training {steps} steps of {cfg.emulate.min_step_s} s, rounds of "
                      f"{cfg.rounds.round_seconds} s ...")
        t0 = time.monotonic()
        summary = run_swarm(lab.hub, HUB_ADDR, [(h.ns, h.addr) for h in lab.homes], cfg, sets, out / profile,
                            timeout_s=3 * steps * cfg.emulate.min_step_s + 300, bootstrap_port=BOOTSTRAP_PORT)
        daemons = lab.daemons_alive()
    by_name = {p["name"]: p for p in summary["peers"]}
    figures = peer_figures(out / profile, by_name)
    for row, home in zip(figures, lab.homes, strict=True):
        row.update({"nat": home.nat, "link": home.link.name, "link_set": home.link.describe(), "addr": home.addr})
    return {"accuracy": accuracy, "peers": figures, "wall_s": time.monotonic() - t0,
            "global_models_identical": summary["global_models_identical"],
            "final_models": summary.get("final_models"), "eval_loss_final": summary["eval_loss_final"],
            "delay_daemons_alive_at_end": daemons}


def bench_wan(out: Path, profile: str = "home", peers: int = 6, nat: int = 4, steps: int = STEPS,
              extra_sets: tuple[str, ...] = (), console: Console | None = None) -> dict:
    """The `lan` run, then the `profile` run, each in its own lab; prints every figure beside `lan`'s.

    Args:
        out: results folder (wan.json, one sub-folder per profile).
        profile: a profile of wanlab.PROFILES; `lan` runs once.
        peers: peers, one home each.
        nat: how many of them (the first) are behind NAT routers.
        steps: inner steps per peer.
        extra_sets: config overrides (`--set`), for every peer of both runs.
        console: where the tables are printed.
    """
    if not 1 <= peers or not 0 <= nat <= peers:
        raise ConfigError(f"bench wan needs --peers >= 1 and 0 <= --nat <= --peers, got {peers} and {nat}")
    try:
        links = profile_links(profile, peers)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    check_can_run("bench wan", links)
    console = console or Console()
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"machine": machine(), "profile": profile, "peers": peers, "nat": nat, "steps": steps,
                     "sets": list(extra_sets), "runs": {}}
    for name in dict.fromkeys(("lan", profile)):
        results["runs"][name] = run_profile(name, peers, nat, steps, out, list(extra_sets), console)
        write_results(out, "wan", results)  # after every run: an interrupted bench keeps what it has
    return report(out, "wan", results, print_wan, console)


def _merges(row: dict) -> str:
    total = row["group_rounds"] + row["alone_rounds"]
    median = f"{row['group_merge_s_median']:.2f} s" if row["group_merge_s_median"] is not None else "-"
    return f"{row['group_rounds']}/{total}, {median}"


def _share(rows: list[dict]) -> str:
    group = sum(r["group_rounds"] for r in rows)
    total = group + sum(r["alone_rounds"] for r in rows)
    return f"{group} of {total} rounds in a group" + (f" ({group / total:.0%})" if total else "")


def print_wan(results: dict, console: Console) -> None:
    """Per peer, each profile's figures side by side (the first column is `lan`'s)."""
    runs = results["runs"]
    console.print(f"machine: {results['machine']}")
    table = Table(title=f"bench wan: {results['peers']} peers ({results['nat']} behind NAT), {results['steps']} "
                  "inner steps each; per run: rounds merged in a group / all rounds, median group merge time")
    table.add_column("peer")
    table.add_column("router")
    table.add_column(f"link ({results['profile']})")
    for name in runs:
        table.add_column(name)
    last = list(runs.values())[-1]["peers"]
    for i, row in enumerate(next(iter(runs.values()))["peers"]):
        table.add_row(row["peer"], "NAT" if row["nat"] else "routes", last[i]["link"],
                      *(_merges(run["peers"][i]) for run in runs.values()))
    table.add_row("", "", "final models", *(f"{run['final_models']} (digests identical: "
                                             f"{run['global_models_identical']})" for run in runs.values()))
    table.add_row("", "", "eval loss, mean", *(f"{run['eval_loss_final']:.4f}" if run["eval_loss_final"] else "-"
                                                for run in runs.values()))
    table.add_row("", "", "run wall time", *(f"{run['wall_s']:.0f} s" for run in runs.values()))
    console.print(table)
    for name, run in runs.items():
        nat = [r for r in run["peers"] if r["nat"]]
        reachable = [r for r in run["peers"] if not r["nat"]]
        console.print(f"{name}: behind NAT {_share(nat)}; reachable {_share(reachable)}")
        digests = {row["peer"]: (row["global_digest"] or "-")[:10] for row in run["peers"]}
        console.print(f"  final global digests {digests}")
        console.print(f"  links: {'; '.join(sorted({row['link_set'] for row in run['peers']}))}")
        if not all(run["delay_daemons_alive_at_end"].values()):
            console.print(f"[red]  a delay daemon died during the run: {run['delay_daemons_alive_at_end']}")
