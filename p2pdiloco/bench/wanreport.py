"""`bench wan`'s figures of the swarm as a whole, one row per run beside `lan`'s (the per-peer table is
wanbench.print_wan): merges, splits and failed dials; compute utilization and eval loss ÷ `lan`'s; with every peer
behind NAT, how soon each says why it merges alone; with a joiner, how soon it has the swarm's state and merges."""

from __future__ import annotations

from rich.console import Console

from p2pdiloco.bench.wanfigures import clean

ALONE_SAYS_WITHIN_S = 60.0
"""A peer that nobody in reach can lead says so within this many seconds of its start."""


def _s(value: float | None, digits: int = 2) -> str:
    return f"{value:.{digits}f} s" if value is not None else "-"


def _ratio(value: float | None, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if value is not None else "-"


def eval_ratio(run: dict, lan: dict | None) -> float | None:
    """A run's mean final eval loss ÷ the `lan` run's (both at the same inner steps); None if either is missing."""
    if lan is None or not run.get("eval_loss_final") or not lan.get("eval_loss_final"):
        return None
    return run["eval_loss_final"] / lan["eval_loss_final"]


def print_swarm_figures(results: dict, console: Console) -> None:
    """One line per run; then the runs of the profile that were clean, and the NAT and joiner figures if asked."""
    runs, lan = results["runs"], results["runs"].get("lan")
    console.print(f"per run, the swarm of {results['peers']} peers (the median and the largest ÷ it of group merges "
                  "but the final ones; a split: a merge, alone included, in a group smaller than the swarm):")
    for name, run in runs.items():
        g, u = run["groups"], run["utilization"]
        dials = ", ".join(f"{k} {n}" for k, n in g["failed_dials"].items())
        console.print(f"  {name}: {g['group_merges']} of {g['merges']} merges in a group, median {_s(g['median_s'])}, "
                      f"largest {_ratio(g['max_over_median'], 2)}x the median ({_ratio(g['later_max_over_median'], 2)}x "
                      f"without each peer's first merge; final merges up to "
                      f"{_s(g['final_max_s'])}), {g['split_merges']} splits (smallest group {g['smallest_group'] or '-'}), "
                      f"{g['failed_dial_records']} log records of failed dials or merges"
                      f"{f' ({dials})' if dials else ''}; compute utilization {_ratio(u['mean'])} (min "
                      f"{_ratio(u['min'])}), eval loss ÷ lan's {_ratio(eval_ratio(run, lan), 4)}; clean: {'yes' if clean(g) else 'no'}"
                      + (f" [red](run failed: {run['error']})[/red]" if run.get("error") else ""))
    repeats = [run for name, run in runs.items() if name != "lan" and not run.get("sync")]
    if len(repeats) > 1:
        n_clean = sum(1 for run in repeats if clean(run["groups"]) and not run.get("error"))
        but_first = sum(1 for run in repeats if not run.get("error") and clean(
            {**run["groups"], "max_over_median": run["groups"]["later_max_over_median"]}))
        console.print(f"{n_clean} of {len(repeats)} runs of {results['profile']} clean (no failed dial, no merge over "
                      f"2x the median, no split); {but_first} of {len(repeats)} without each peer's first merge")
    if results["nat"] == results["peers"]:
        print_alone(results, console)
    if results.get("joiner"):
        print_joiner(results, console)


def print_alone(results: dict, console: Console) -> None:
    """Every peer behind NAT: per run and peer, seconds from its start until its log says nobody can dial it, and
    until it says it merges alone because nobody in reach can lead; and what `status` showed."""
    for name, run in results["runs"].items():
        swarm = run["peers"][:results["peers"]]
        says = [r["nobody_leads_s"] for r in swarm]
        worst = max((s for s in says if s is not None), default=None)
        ok = all(s is not None and s <= ALONE_SAYS_WITHIN_S for s in says)
        console.print(f"{name}: every peer behind NAT; seconds from its start until its log says nobody can dial it "
                      f"/ that it merges alone as nobody in reach can lead (within {ALONE_SAYS_WITHIN_S:.0f} s: "
                      f"{'yes' if ok else 'no'}, the latest {_s(worst, 0)}):")
        for r in swarm:
            console.print(f"  {r['peer']}: {_s(r['unreachable_s'], 0)} / {_s(r['nobody_leads_s'], 0)}, "
                          f"{r['group_rounds']} of {r['group_rounds'] + r['alone_rounds']} rounds in a group")
        status = run.get("status") or {}
        if "peers" in status:
            said = {p: ("reachable" if v["reachable"] else "not reachable" if v["reachable"] is False else "unknown")
                    for p, v in sorted(status["peers"].items())}
            console.print(f"  `p2pdiloco status` in the hub {status['at_s']:.0f} s after the peers started: {said}")
        elif status:
            console.print(f"  `p2pdiloco status` in the hub failed: {status.get('error')}")


def print_joiner(results: dict, console: Console) -> None:
    """Per run: the joiner's seconds from its start to the swarm's state and to its first group merge, and the
    bound (state bytes ÷ its downlink + 30 s)."""
    for name, run in results["runs"].items():
        j = run.get("joiner") or {}
        if not j:
            continue
        got = j["state_bytes_received"]
        console.print(f"{name}: joiner behind NAT: state after {_s(j['state_s'], 1)} (download {_s(j['download_s'])}"
                      f" from {(j['donor'] or '-')[-6:]}), first group merge after {_s(j['first_group_merge_s'], 1)}; "
                      f"bound {j['state_bytes'] / 1e6:.2f} MB ÷ downlink + 30 s = {j['bound_s']:.1f} s: "
                      f"{'within' if j['within_bound'] else 'NOT within'}"
                      + (f" ({got / 1e6:.2f} MB of state received)" if got is not None else "")
                      + ("; it started after the swarm had finished: run longer (--steps)"
                         if j.get("arrived_after_end") else ""))

