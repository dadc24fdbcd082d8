"""`p2pdiloco bench wancodec`: the default codec against `--recipe sparseloco` on home links, in wall-clock time to
a loss, with a model whose int4 merge is >= 10 MB a peer.

The same swarm runs once per arm, each in a fresh WAN lab (wanlab.py) of `peers` homes, with the public CLI
(`p2pdiloco peer --initial-peers ...`, nsswarm.py). An arm is `NAME[@PROFILE]`: a codec or a recipe
(`config/recipes.py`) on a profile (`home` where it names none: 20 Mbit/s up, 100 down, 40 ms each way, 0.5 %
loss). By default: int4 (the default codec, the baseline of every ratio), sparseloco (the recipe's settings), and
int4 on `lan`, whose merges show what int4's cost without the link. The model is wide (d_model 960, 2 layers:
22.4M parameters, an int4 pseudo-gradient of 11.9 MB) and its batches tiny, so that an inner step takes ~0.2 s of
one core; steps are padded to `STEP_S` so that the peers do not compete for the 2 cores, and rounds are timed
(`ROUND_S`); a peer trains `steps` inner steps or `TIME_CAP` times their padded time, whichever comes first. Every
round's merge is followed by an eval of the peer's global model.

Per arm it reports:

- the swarm's eval loss over time: at each moment, the mean over peers of each peer's latest eval of its global
  model (`swarm_curve`), from the earliest peer's first inner step;
- the wall-clock time until that mean first reaches a target (`time_to_target`), and from when it stays there
  (`time_to_stay`): the loss the worst arm ends at (every arm reaches it), the point 75 % of the way there from
  the start, and the other arms' final losses;
- the median time of group merges, bytes a peer sent per round (all merge traffic, failed merges too) and per
  group merge (the pseudo-gradient exchange alone), rounds merged in a group, compute utilization (time in padded
  inner steps ÷ the training loop's wall time; the evals after each merge count as not computing), final eval
  loss, peak host memory;

each arm's figure beside the first arm's, as a ratio. Needs root, like `bench wan`.
"""

from __future__ import annotations

import bisect
import json
import statistics
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from p2pdiloco.algorithm.codecs import get_codec
from p2pdiloco.bench.common import BENCH_DATA, machine, report, write_results
from p2pdiloco.bench.nsswarm import merge_rows, run_swarm
from p2pdiloco.bench.wanaccuracy import measure, print_accuracy
from p2pdiloco.bench.wanlab import HUB_ADDR, PROFILES, WanLab, check_can_run, profile_links
from p2pdiloco.config import CODECS, Config, ConfigError, load_config, parse_set
from p2pdiloco.config.recipes import RECIPES
from p2pdiloco.util.logfiles import read_jsonl

STEP_S = 1.0
"""Padded inner step, seconds: 4 peers' unpadded steps (~0.2 s of one core each) fit twice into it on 2 cores."""
ROUND_S = 10.0
"""Timed rounds: about 10 inner steps (the H at which the sparseloco recipe matches int4, benchmarks.md)."""
STEPS = 300
"""Inner steps per peer by default: 5 minutes of training at `STEP_S`."""
PEERS = 2
"""Two peers: 4 peers of this model do not fit beside other work in this machine's memory (~5 GB a peer)."""
ARMS = ("int4", "sparseloco", "int4@lan")
"""The default codec first (the baseline of every ratio), the sparseloco recipe, and int4 again on `lan` (no
shaping): what its merges cost without the link (CPU, mostly) against what the link adds."""
PROFILE = "home"
"""The profile of an arm that names none."""
BOOTSTRAP_PORT = 31339
TIME_CAP = 1.15
"""Each peer trains at most this many times `steps` × the padded step (`run.time_limit_s`)."""
TARGET_FRACTIONS = (0.75, 1.0)
"""Targets on the way from the initial loss to the worst arm's final loss (1.0: that loss itself); the other arms'
final losses are targets too."""
MODEL_SETS = [
    "model.n_layer=2", "model.d_model=960", "model.n_head=8", "model.seq_len=32", "data.batch_size=2", *BENCH_DATA,
    "inner.warmup_steps=20", "run.eval_batches=8", "run.eval_every_rounds=1", "run.log_every=10",
    "run.checkpoint_every=0", "merge.merge_window_s=10", f"emulate.min_step_s={STEP_S}",
    f"rounds.round_seconds={ROUND_S}",
]
"""Every arm's settings: the wide model, an eval of the global model after every merge, padded steps, timed rounds."""


def parse_arm(arm: str) -> tuple[str, str]:
    """An arm `NAME[@PROFILE]` as (codec or recipe, profile); the profile is `PROFILE` where it names none."""
    name, _, profile = arm.partition("@")
    return name, profile or PROFILE


def arm_sets(arm: str) -> list[str]:
    """The settings of one arm: a recipe's (`config/recipes.py`) if it names one, else `codec.name=NAME`."""
    name, _ = parse_arm(arm)
    return list(RECIPES[name]) if name in RECIPES else [f"codec.name={name}"]


def payload_bytes(cfg: Config, n_params: int, peers: int) -> dict:
    """What one merge of a `n_params` pseudo-gradient costs a peer's uplink, computed before the run.

    int4 is exact (N/2 bytes of codes plus an fp32 scale per 128 values); a sliced codec's all-reduce sends
    2·(n−1)/n of it (the parts of the others' slices, then its own slice's average to each). sparseloco's size
    varies: it is measured on a Gaussian vector of `n_params` values, and its all-gather sends it to n − 1 members.

    Args:
        cfg: the arm's config (its codec and `sparse_keep`).
        n_params: the model's parameter count.
        peers: members of a merge group.
    """
    codec = get_codec(cfg.codec.name, cfg.codec.sparse_keep)
    if codec.exact_size:
        part = codec.encoded_size(n_params)
    else:
        part = len(codec.encode(torch.randn(n_params, generator=torch.Generator().manual_seed(0))))
    sent = part * (2 * (peers - 1) / peers if codec.sliced else peers - 1)
    return {"codec": cfg.codec.name, "part_bytes": part, "sent_bytes": sent}


def eval_series(rows: list[dict]) -> list[tuple[float, float]]:
    """(Unix time, eval loss of the global model) of one peer's metrics lines: its `eval` lines (start and end)
    and the merges that evaluated, in time order."""
    points = [(r["t"], r["eval_loss"]) for r in rows
              if r.get("kind") in ("eval", "merge") and r.get("eval_loss") is not None]
    return sorted(points)


def swarm_curve(series: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """The mean over peers of each peer's latest eval loss, at every moment one changes, from the moment every
    peer has one (before that, the mean of some peers only would be another quantity).

    Args:
        series: one `eval_series` per peer.

    Returns:
        (time, mean) at each point, in time order; empty if a peer has no point.
    """
    if not series or any(not s for s in series):
        return []
    start = max(s[0][0] for s in series)
    times = sorted({t for s in series for t, _ in s if t >= start})
    curve = []
    for t in times:
        latest = [s[bisect.bisect_right(s, (t, float("inf"))) - 1][1] for s in series]
        curve.append((t, statistics.fmean(latest)))
    return curve


def time_to_target(curve: list[tuple[float, float]], target: float, t0: float) -> float | None:
    """Seconds from `t0` until the curve's mean first reaches `target` (<=); None if it never does."""
    return next((t - t0 for t, loss in curve if loss <= target), None)


def time_to_stay(curve: list[tuple[float, float]], target: float, t0: float) -> float | None:
    """Seconds from `t0` until the curve's mean reaches `target` (<=) for good: from the point after its last one
    above it; None if it ends above it. Unlike `time_to_target`, a swarm that dips below and climbs back (peers that
    stop merging) does not count as there."""
    if not curve or curve[-1][1] > target:
        return None
    above = [i for i, (_, loss) in enumerate(curve) if loss > target]
    return curve[above[-1] + 1 if above else 0][0] - t0


def targets(initial: float, finals: list[float], fractions: tuple[float, ...] = TARGET_FRACTIONS) -> list[float]:
    """The losses at `fractions` of the way from `initial` to the worst of `finals` (the loss every arm reaches at
    its end), then the other `finals`, best last."""
    worst = max(finals)
    on_the_way = [initial + f * (worst - initial) for f in fractions]
    return on_the_way + sorted((x for x in set(finals) if x != worst), reverse=True)


def read_metrics(path: Path) -> list[dict]:
    """A metrics.jsonl's lines across its rotations (none if it does not exist)."""
    return read_jsonl(path) if path.exists() else []


def arm_figures(run_dir: Path, summary: dict) -> dict:
    """One arm's figures (the module docstring) from its run folder and `run_swarm`'s summary."""
    peers = summary["peers"]
    metrics = [read_metrics(run_dir / "peers" / f"peer{i}" / "metrics.jsonl") for i in range(len(peers))]
    series = [eval_series(rows) for rows in metrics]
    starts = [s[0][0] for s in series if s]
    merges = [r for i in range(len(peers)) for r in merge_rows(run_dir / "peers" / f"peer{i}" / "metrics.jsonl")]
    group = [r["merge_s"] for r in merges if r.get("group_size", 1) >= 2]
    per_round = [p["bytes_sent"] / p["rounds"] for p in peers if p.get("rounds")]
    delta_per_merge = [p.get("pseudo_grad_bytes_sent", 0) / p["merges"] for p in peers if p.get("merges")]
    return {
        "t0": min(starts) if starts else None, "curve": swarm_curve(series),
        "eval_loss_initial": summary["eval_loss_initial"], "eval_loss_final": summary["eval_loss_final"],
        "group_merge_s_median": statistics.median(group) if group else None,
        "group_merge_s_max": max(group) if group else None,
        "bytes_per_round": statistics.fmean(per_round) if per_round else None,
        "delta_bytes_per_merge": statistics.fmean(delta_per_merge) if delta_per_merge else None,
        "group_rounds": len(group), "rounds": len(merges),
        "inner_steps": statistics.fmean(p["inner_steps"] for p in peers),
        "steps_per_round": statistics.fmean(p["inner_steps"] / p["rounds"] for p in peers if p.get("rounds")),
        "utilization": statistics.fmean(p["compute_s"] / p["train_s"] for p in peers if p.get("train_s")),
        "final_models": summary.get("final_models"), "wall_s": summary["wall_s"],
    }


def run_arm(arm: str, peers: int, nat: int, steps: int, out: Path, extra_sets: list[str], console: Console) -> dict:
    """One lab of the arm's profile, its accuracy, and one swarm of the arm in it; the arm's figures."""
    name, profile = parse_arm(arm)
    folder = f"{name}-{profile}"
    sets = MODEL_SETS + arm_sets(arm) + extra_sets + [f"run.total_steps={steps}",
                                                       f"swarm.run_id=bench-wancodec-{folder}"]
    step_s = load_config(None, [parse_set(sets)]).emulate.min_step_s
    sets.append(f"run.time_limit_s={TIME_CAP * steps * step_s:g}")  # a loaded machine cannot stretch the bench
    cfg = load_config(None, [parse_set(sets)])
    with WanLab(profile_links(profile, peers), nat=[i < nat for i in range(peers)], tag=f"c{name[:2]}{profile[:2]}") as lab:
        console.print(f"[bold]{arm}[/bold]: {peers} peers ({nat} behind NAT) on {profile}, the lab measured:")
        accuracy = measure(lab)
        print_accuracy(accuracy, console)
        console.print(f"  training {steps} steps of {cfg.emulate.min_step_s} s, rounds of "
                      f"{cfg.rounds.round_seconds} s ...")
        summary = run_swarm(lab.hub, HUB_ADDR, [(h.ns, h.addr) for h in lab.homes], cfg, sets, out / folder,
                            timeout_s=2 * steps * cfg.emulate.min_step_s + 300, bootstrap_port=BOOTSTRAP_PORT)
        daemons = lab.daemons_alive()
    figures = arm_figures(out / folder, summary)
    figures.update({"accuracy": accuracy, "sets": arm_sets(arm), "profile": profile, "delay_daemons_alive_at_end": daemons,
                    "peak_host_bytes": max(p.get("peak_host_bytes") or 0 for p in summary["peers"])})
    return figures


def model_params(sets: list[str]) -> int:
    """Parameters of the model `sets` describe (built on CPU, then dropped)."""
    from p2pdiloco.training.model import build_model

    return sum(p.numel() for p in build_model(load_config(None, [parse_set(sets)]).model).parameters())


def bench_wancodec(out: Path, arms: tuple[str, ...] = ARMS, peers: int = PEERS, nat: int = 0, steps: int = STEPS,
                   extra_sets: tuple[str, ...] = (), console: Console | None = None) -> dict:
    """Each arm in its own lab, one after the other; prints the payloads first, then every figure beside the first
    arm's (see the module docstring).

    Args:
        out: results folder (wancodec.json, one sub-folder per arm).
        arms: codecs or recipes (`config/recipes.py`), the first the baseline.
        peers: peers, one home each.
        nat: how many of them (the first) are behind NAT routers.
        steps: inner steps per peer.
        extra_sets: config overrides (`--set`), for every peer of every arm (e.g. the model's size).
        console: where the tables are printed.
    """
    if peers < 2 or not 0 <= nat < peers or len(arms) < 2:
        raise ConfigError(f"bench wancodec needs --peers >= 2, 0 <= --nat < --peers and two arms or more, got "
                          f"{peers}, {nat} and {','.join(arms)}")
    check_can_run("bench wancodec", [link for a in arms for link in profile_links(parse_arm(a)[1], peers)])
    console = console or Console()
    out.mkdir(parents=True, exist_ok=True)
    n_params = model_params(MODEL_SETS + list(extra_sets))
    results: dict = {"machine": machine(), "loadavg_at_start": _loadavg(), "profile": PROFILE, "peers": peers,
                     "nat": nat, "steps": steps, "sets": list(extra_sets), "n_params": n_params, "arms": {},
                     "payload": {parse_arm(a)[0]: payload_bytes(load_config(None, [parse_set(
                         MODEL_SETS + arm_sets(a) + list(extra_sets))]), n_params, peers) for a in arms}}
    print_payload(results, console)
    for arm in arms:
        results["arms"][arm] = run_arm(arm, peers, nat, steps, out, list(extra_sets), console)
        write_results(out, "wancodec", results)  # after every arm: an interrupted bench keeps what it has
    compare(results)
    return report(out, "wancodec", results, print_wancodec, console)


def bench_from_args(out: Path, args) -> dict:
    """`p2pdiloco bench wancodec`'s flags (bench/cli.py) parsed and checked, then `bench_wancodec`."""
    arms = tuple(args.codecs.split(",")) if args.codecs else ARMS
    known = (*CODECS, *RECIPES)
    if (any(parse_arm(a)[0] not in known or parse_arm(a)[1] not in PROFILES for a in arms)
            or len({parse_arm(a) for a in arms}) != len(arms)):
        raise ConfigError(f"--codecs takes distinct arms NAME[@PROFILE] separated by commas (names: "
                          f"{', '.join(known)}; profiles: {', '.join(PROFILES)}), got {args.codecs!r}")
    peers = int(args.peers) if args.peers and args.peers.isdigit() else None
    if args.peers and peers is None:
        raise ConfigError(f"--peers takes one positive integer, got {args.peers!r}")
    return bench_wancodec(out, arms=arms, peers=peers or PEERS, nat=args.nat, steps=args.steps or STEPS,
                          extra_sets=tuple(args.sets))


def compare(results: dict) -> None:
    """Add the targets, each arm's time to each target, and the crossover estimate, to `results`."""
    arms = results["arms"]
    initial = statistics.fmean(a["curve"][0][1] for a in arms.values() if a["curve"])
    finals = [a["curve"][-1][1] for a in arms.values() if a["curve"]]
    results["targets"] = targets(initial, finals) if finals else []
    for a in arms.values():
        a["time_to_target_s"] = [time_to_target(a["curve"], x, a["t0"]) for x in results["targets"]]
        a["time_to_stay_s"] = [time_to_stay(a["curve"], x, a["t0"]) for x in results["targets"]]
    round_s = load_config(None, [parse_set(MODEL_SETS + results["sets"])]).rounds.round_seconds
    first = parse_arm(next(iter(arms)))[0]
    results["crossover"] = crossover(arms, round_s, results["n_params"], results["payload"][first]["sent_bytes"])


def crossover(arms: dict[str, dict], round_s: float, n_params: int, sent_bytes: float) -> dict | None:
    """Where the first arm's merge outlasts a round, if merge time grows in proportion to the parameters.

    Its merge on the same codec's `lan` arm, if there is one, is the part the link does not cause (CPU, mostly);
    the rest is the link's: `link_s` and the uplink rate it means.

    Args:
        arms: the arms' figures, the first the baseline.
        round_s: the rounds' length, seconds.
        n_params: the model's parameters.
        sent_bytes: what the first arm's merge sends a peer's uplink (`payload_bytes`).

    Returns:
        None without group merges; else `merge_s`, `lan_merge_s`, `link_s`, `link_mbit` (`sent_bytes` ÷
        `link_s`), `params_merge_fills_round` (N · round ÷ merge) and `params_link_fills_round` (N · round ÷ link).
    """
    first = next(iter(arms))
    base = arms[first]
    merge_s = base["group_merge_s_median"]
    if not merge_s:
        return None
    name, profile = parse_arm(first)
    lan = next((a for arm, a in arms.items() if parse_arm(arm) == (name, "lan") and profile != "lan"), None)
    lan_s = lan["group_merge_s_median"] if lan else None
    link_s = merge_s - lan_s if lan_s is not None and merge_s > lan_s else None
    return {"merge_s": merge_s, "lan_merge_s": lan_s, "link_s": link_s, "round_s": round_s,
            "link_mbit": sent_bytes * 8 / link_s / 1e6 if link_s else None,
            "params_merge_fills_round": n_params * round_s / merge_s,
            "params_link_fills_round": n_params * round_s / link_s if link_s else None}


def rederive(out: Path, console: Console | None = None) -> dict:
    """The figures of a finished bench again, from its wancodec.json and run folders (after a change to how a
    figure is computed: the runs themselves are not repeated)."""
    results = json.loads((out / "wancodec.json").read_text())
    for arm, figures in results["arms"].items():
        name, profile = parse_arm(arm)
        summary = json.loads((out / f"{name}-{profile}" / "summary.json").read_text())
        kept = {k: figures[k] for k in ("accuracy", "sets", "profile", "delay_daemons_alive_at_end", "peak_host_bytes")}
        results["arms"][arm] = {**arm_figures(out / f"{name}-{profile}", summary), **kept}
    compare(results)
    return report(out, "wancodec", results, print_wancodec, console or Console())


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "unknown"


def print_payload(results: dict, console: Console) -> None:
    """The payload arithmetic, before the runs."""
    console.print(f"machine: {results['machine']}; load average at start: {results['loadavg_at_start']}")
    console.print(f"model: {results['n_params']:,} parameters; per merge of {results['peers']} peers, a peer's part "
                  "and what its uplink sends (computed):")
    for arm, p in results["payload"].items():
        console.print(f"  {arm}: part {p['part_bytes'] / 1e6:.2f} MB, sends {p['sent_bytes'] / 1e6:.2f} MB = "
                      f"{p['sent_bytes'] * 8 / 20e6:.1f} s at 20 Mbit/s")


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.3f}" if value is not None and base else "-"


def print_wancodec(results: dict, console: Console) -> None:
    """Every figure of each arm beside the first arm's, and the ratio."""
    arms = results["arms"]
    names = list(arms)
    base = arms[names[0]]
    table = Table(title=f"bench wancodec: {results['peers']} peers ({results['nat']} behind NAT) on "
                  f"{results['profile']}, {results['n_params']:,} parameters, {results['steps']} inner steps each")
    table.add_column("figure")
    for name in names:
        table.add_column(name)
    for name in names[1:]:
        table.add_column(f"{name} ÷ {names[0]}")
    rows = [row for i, x in enumerate(results.get("targets", [])) for row in (
        (f"eval loss {x:.4f}: first reached (s)", lambda a, i=i: a["time_to_target_s"][i], ".0f"),
        (f"eval loss {x:.4f}: for good from (s)", lambda a, i=i: a["time_to_stay_s"][i], ".0f"))]
    rows += [("group merge, median (s)", lambda a: a["group_merge_s_median"], ".2f"),
             ("group merge, max (s)", lambda a: a["group_merge_s_max"], ".2f"),
             ("bytes sent per round, a peer (MB)", lambda a: a["bytes_per_round"] and a["bytes_per_round"] / 1e6, ".3f"),
             ("Δ bytes per group merge (MB)", lambda a: a["delta_bytes_per_merge"] and a["delta_bytes_per_merge"] / 1e6,
              ".3f"),
             ("rounds in a group", lambda a: a["group_rounds"], "d"), ("rounds", lambda a: a["rounds"], "d"),
             ("inner steps, a peer", lambda a: a["inner_steps"], ".0f"),
             ("inner steps per round", lambda a: a["steps_per_round"], ".1f"),
             ("compute utilization", lambda a: a["utilization"], ".3f"),
             ("eval loss, final (mean)", lambda a: a["eval_loss_final"], ".4f"),
             ("peak host memory, a peer (GB)", lambda a: a["peak_host_bytes"] / 1e9, ".2f"),
             ("run wall time (s)", lambda a: a["wall_s"], ".0f")]
    for label, get, fmt in rows:
        table.add_row(label, *(_num(get(arms[n]), fmt) for n in names),
                      *(_ratio(get(arms[n]), get(base)) for n in names[1:]))
    console.print(table)
    for name, arm in arms.items():
        console.print(f"{name}: final models {arm['final_models']}; sets {' '.join(arm['sets'])}")
        if not all(arm["delay_daemons_alive_at_end"].values()):
            console.print(f"[red]  a delay daemon died during the run: {arm['delay_daemons_alive_at_end']}")
    c = results.get("crossover")
    if c:
        console.print(f"{names[0]}'s median group merge {c['merge_s']:.1f} s against rounds of {c['round_s']:g} s: "
                      f"in proportion to the parameters it outlasts a round at "
                      f"{c['params_merge_fills_round'] / 1e6:.1f}M parameters")
    if c and c["link_s"]:
        console.print(f"  of it on lan {c['lan_merge_s']:.1f} s, so the link's part is {c['link_s']:.1f} s "
                      f"({c['link_mbit']:.1f} Mbit/s of a peer's uplink for its bytes); the link alone would fill a "
                      f"round at {c['params_link_fills_round'] / 1e6:.1f}M parameters")
