"""`p2pdiloco bench wan`: peers in homes behind routers (NAT or not) over shaped links, beside the same on `lan`.

For each profile (`lan` first, the baseline, then the one asked for), the bench builds a WAN lab (wanlab.py) of
`peers` homes, the first `nat` of them behind NAT routers, the rest behind routers that only route (reachable),
prints what the lab measured of itself (wanaccuracy.py), starts a bootstrap node in the hub and one peer per
home with the public CLI (`p2pdiloco peer --initial-peers ...`), the benchmark model with inner steps padded to
`step_s` and timed rounds, and reports per peer:

- rounds merged in a group (`group_size` >= 2) and alone, from its merge lines;
- the median time of its group merges (`merge_s`, submit to result);
- its final global model's digest, and whether every peer's is the same;

and per run (wanfigures.py, wanreport.py): compute utilization, eval loss ÷ `lan`'s at the same inner steps, the
largest group merge ÷ the median, merges in a group smaller than the swarm, and log records of failed dials.
`--repeat N` runs the profile N times (each in a fresh lab) and counts the clean runs; `--sync` adds a run of the
profile with synchronous rounds; `--joiner` starts one more peer behind NAT at half of every run and times its
state and first group merge; with every peer behind NAT, each peer's seconds until it says why it merges alone,
and what `p2pdiloco status` shows.

Needs root, iproute2, iptables and, for delay and loss, the NetfilterQueue package (`p2pdiloco[lab]`).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from p2pdiloco.app.local import PeerProc
from p2pdiloco.app.summary import final_models
from p2pdiloco.bench.common import BENCH_MODEL_SETS, machine, report, write_results
from p2pdiloco.bench.netns import exec_in
from p2pdiloco.bench.nsswarm import merge_rows, run_swarm, start_peer
from p2pdiloco.bench.wanaccuracy import measure, print_accuracy
from p2pdiloco.bench.wanfigures import alone_reasons, group_figures, joiner_figures, utilization
from p2pdiloco.bench.wanlab import HUB_ADDR, WanLab, check_can_run, profile_links
from p2pdiloco.bench.wanreport import eval_ratio, print_swarm_figures
from p2pdiloco.config import Config, ConfigError, load_config, parse_set
from p2pdiloco.training.model import build_model, count_params
from p2pdiloco.util.logfiles import read_jsonl

STEP_S = 0.3
ROUND_S = 3.0
STEPS = 200
"""Inner steps per peer by default: 60 s of training at `STEP_S`."""
BOOTSTRAP_PORT = 31338
WAN_SETS = [s for s in BENCH_MODEL_SETS if not s.startswith(("run.total_steps", "emulate.min_step_s"))] + [
    f"emulate.min_step_s={STEP_S}", f"rounds.round_seconds={ROUND_S}", "merge.merge_window_s=10",
    "run.checkpoint_every=0"]


SYNC_SETS = ["rounds.sync=true", "rounds.round_seconds=0", f"rounds.round_steps={round(ROUND_S / STEP_S)}",
             "merge.merge_window_s=60"]
"""`--sync`: synchronous DiLoCo with rounds of the same length in steps (H = 10), everyone waits for the merge."""
STATUS_AT_S = 45.0
"""With every peer behind NAT: when `p2pdiloco status` is run in the hub, seconds after the peers started."""


def peer_figures(run_dir: Path, names: list[str], summaries: dict[str, dict]) -> list[dict]:
    """Per peer: group and alone rounds, median group merge time, final digest (see the module docstring).

    Args:
        run_dir: the run's folder (peers/<name>/metrics.jsonl).
        names: the peers, in order.
        summaries: {peer name: its peer summary} (from the run's summary).
    """
    rows = []
    for name in names:
        merges = merge_rows(run_dir / "peers" / name / "metrics.jsonl")
        group = [r["merge_s"] for r in merges if r.get("group_size", 1) >= 2]
        rows.append({"peer": name, "group_rounds": len(group), "alone_rounds": len(merges) - len(group),
                     "group_merge_s_median": statistics.median(group) if group else None,
                     "global_digest": summaries.get(name, {}).get("global_digest"),
                     "eval_loss_final": summaries.get(name, {}).get("eval_loss_final")})
    return rows


def run_profile(profile: str, peers: int, nat: int, steps: int, out: Path, extra_sets: list[str],
                console: Console, name: str | None = None, joiner: bool = False, tcp: str = "") -> dict:
    """One lab of `profile`, its accuracy, and one swarm in it; the figures of both.

    Args:
        name: the run's name and folder under `out` (default the profile's).
        joiner: also start one more peer, behind NAT, once peer0 has taken half the steps.
        tcp: the homes' TCP congestion control ('': the lab's default; see `WanLab`).
        The others as `bench_wan`'s; `extra_sets` are the run's config overrides (`--sync`'s included).
    """
    name = name or profile
    homes = peers + joiner
    links = profile_links(profile, homes)
    sets = WAN_SETS + extra_sets + [f"run.total_steps={steps}", f"swarm.run_id=bench-wan-{profile}"]
    cfg = load_config(None, [parse_set(sets)])
    run_dir, error, status = out / name, None, {}
    names = [f"peer{i}" for i in range(homes)]
    with WanLab(links, nat=[i < nat or i >= peers for i in range(homes)], tag=profile[:4], tcp=tcp) as lab:
        console.print(f"[bold]{name}[/bold]: {peers} peers ({nat} behind NAT)"
                      + (" and a joiner behind NAT at half the run" if joiner else "") + ", the lab measured:")
        accuracy = measure(lab)
        print_accuracy(accuracy, console)
        console.print(f"  training {steps} steps of {cfg.emulate.min_step_s} s, "
                      + (f"sync rounds of {cfg.rounds.round_steps} steps" if cfg.rounds.sync else
                         f"rounds of {cfg.rounds.round_seconds} s") + " ...")
        late = Late(lab, cfg, sets, run_dir, peers, steps, joiner, status if nat == peers else None)
        t0 = time.monotonic()
        try:
            run_swarm(lab.hub, HUB_ADDR, [(h.ns, h.addr) for h in lab.homes[:peers]], cfg, sets, run_dir,
                      timeout_s=3 * steps * cfg.emulate.min_step_s + 300, bootstrap_port=BOOTSTRAP_PORT, late=late)
        except RuntimeError as e:  # the files of a failed run still hold figures
            console.print(f"[red]  {name}: {e}")
            error = str(e)
        daemons = lab.daemons_alive()
    summaries = {n: json.loads(path.read_text()) for n in names
                 if (path := run_dir / "peers" / n / "peer_summary.json").exists()}
    figures = peer_figures(run_dir, names, summaries)
    for row, home in zip(figures, lab.homes, strict=True):
        row.update({"nat": home.nat, "link": home.link.name, "link_set": home.link.describe(), "addr": home.addr,
                    **alone_reasons(run_dir / "peers" / row["peer"], row["peer"])})
    swarm = [summaries[n] for n in names[:peers] if n in summaries]
    losses = [p["eval_loss_final"] for p in swarm if p.get("eval_loss_final") is not None]
    which, _ = final_models([p for p in summaries.values() if not p.get("arrived_after_end")])  # as `summarize`
    result = {"accuracy": accuracy, "peers": figures, "wall_s": time.monotonic() - t0, "error": error,
              "sync": cfg.rounds.sync, "global_models_identical": which == "identical", "final_models": which,
              "eval_loss_final": statistics.mean(losses) if losses else None, "utilization": utilization(swarm),
              "groups": group_figures(run_dir, names[:peers], peers), "status": status,
              "delay_daemons_alive_at_end": daemons}
    if joiner:
        state_bytes = 8 * count_params(build_model(cfg.model))  # θg and outer momentum, fp32 (state_sync.pack_state)
        result["joiner"] = joiner_figures(run_dir / "peers" / names[peers] / "metrics.jsonl", state_bytes,
                                          lab.homes[peers].link.down_mbit)
    return result


class Late:
    """What `run_swarm` does while the peers run: start the joiner at half the run, and, with every peer behind
    NAT, record what `p2pdiloco status` shows from the hub (into `status`)."""

    def __init__(self, lab: WanLab, cfg: Config, sets: list[str], run_dir: Path, peers: int, steps: int,
                 joiner: bool, status: dict | None):
        self.lab, self.cfg, self.sets, self.run_dir, self.peers = lab, cfg, sets, run_dir, peers
        self.join_at = steps // 2 if joiner else None
        self.status = status

    def __call__(self, elapsed_s: float, maddr: str) -> list[PeerProc]:
        if self.status is not None and not self.status and elapsed_s >= STATUS_AT_S:
            self.status.update(swarm_status(self.lab, maddr, self.cfg.swarm.run_id, elapsed_s))
        if self.join_at is None or peer_step(self.run_dir / "peers" / "peer0" / "metrics.jsonl") < self.join_at:
            return []
        self.join_at = None
        home = self.lab.homes[self.peers]
        return [start_peer(self.peers, self.peers + 1, (home.ns, home.addr), self.cfg, maddr, self.sets,
                           self.run_dir)]


def peer_step(metrics: Path) -> int:
    """The last inner step a peer's metrics.jsonl names (0 before any)."""
    rows = read_jsonl(metrics) if metrics.exists() else []
    return max((r.get("step", 0) for r in rows), default=0)


def swarm_status(lab: WanLab, maddr: str, run_id: str, elapsed_s: float) -> dict:
    """`p2pdiloco status --json` run in the hub: per peer name, whether it says others can dial it, and why not."""
    cmd = exec_in(lab.hub) + [sys.executable, "-m", "p2pdiloco", "status", "--initial-peers", maddr, "--run-id",
                              run_id, "--json", "--timeout", "20"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        peers = json.loads(done.stdout)["peers"] if done.stdout.strip() else []
    except (subprocess.TimeoutExpired, json.JSONDecodeError, KeyError) as e:
        return {"at_s": elapsed_s, "error": repr(e)}
    return {"at_s": elapsed_s, "peers": {p.get("name") or p["peer_id"][-8:]: {
        "reachable": p.get("reachable"), "detail": p.get("reach_detail")} for p in peers}}


def bench_wan(out: Path, profile: str = "home", peers: int = 6, nat: int = 4, steps: int = STEPS,
              extra_sets: tuple[str, ...] = (), console: Console | None = None, repeat: int = 1, sync: bool = False,
              joiner: bool = False, tcp: str = "") -> dict:
    """The `lan` run, then the `profile` run(s), each in its own lab; prints every figure beside `lan`'s.

    Args:
        out: results folder (wan.json, one sub-folder per run).
        profile: a profile of wanlab.PROFILES; `lan` runs once.
        peers: peers, one home each.
        nat: how many of them (the first) are behind NAT routers.
        steps: inner steps per peer.
        extra_sets: config overrides (`--set`), for every peer of every run.
        console: where the tables are printed.
        repeat: runs of `profile` (each in a fresh lab), `<profile> 1`, `<profile> 2`, ... when more than one.
        sync: also run `profile` once with synchronous rounds (`SYNC_SETS`), as `<profile> --sync`.
        joiner: in every run, start one more peer behind NAT at half the run (`run_profile`).
        tcp: every run's TCP congestion control in the hub and the homes ('': the lab's default, BBR here;
            `reno`: loss-based, as CUBIC on most volunteers' hosts).
    """
    if not 1 <= peers or not 0 <= nat <= peers or repeat < 1:
        raise ConfigError(f"bench wan needs --peers >= 1, 0 <= --nat <= --peers and --repeat >= 1, got {peers}, "
                          f"{nat} and {repeat}")
    try:
        links = profile_links(profile, peers + joiner)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    check_can_run("bench wan", links)
    console = console or Console()
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"machine": machine(), "profile": profile, "peers": peers, "nat": nat, "steps": steps,
                     "sets": list(extra_sets), "repeat": repeat, "joiner": joiner, "tcp": tcp or "default",
                     "runs": {}}
    plan = [("lan", "lan", [])] + [(profile, f"{profile} {k + 1}" if repeat > 1 else profile, [])
                                   for k in range(repeat if profile != "lan" else 0)]
    plan += [(profile, f"{profile} --sync", SYNC_SETS)] if sync else []
    for run_profile_name, name, mode_sets in plan:
        results["runs"][name] = run_profile(run_profile_name, peers, nat, steps, out, list(extra_sets) + mode_sets,
                                            console, name=name.replace(" --", "-").replace(" ", "-"), joiner=joiner,
                                            tcp=tcp)
        write_results(out, "wan", results)  # after every run: an interrupted bench keeps what it has
    return report(out, "wan", results, print_all, console)


def print_all(results: dict, console: Console) -> None:
    """The per-peer table (`print_wan`) when it fits, then the swarm's figures of every run (wanreport.py)."""
    if len(results["runs"]) <= 4:
        print_wan(results, console)
    print_swarm_figures(results, console)


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
    table.add_row("", "", "eval loss ÷ lan's", *(f"{r:.4f}" if (r := eval_ratio(run, runs.get("lan"))) else "-"
                                                  for run in runs.values()))
    table.add_row("", "", "compute utilization", *(f"{run['utilization']['mean']:.3f}" if run["utilization"]["mean"]
                                                    else "-" for run in runs.values()))
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
