"""Goodput: compute whose effect reached the swarm's model ÷ compute spent, from what a run recorded.

`bench churn` and `simulate --calibrate` compute it the same way, from each peer's metrics.jsonl (every
incarnation of a peer appends to one file, each from its `start` line on) and the run folder's chaos.jsonl (when
`p2pdiloco local --chaos` killed and restarted which peer). The rule is strict: a round counts only where its
effect can be shown to have reached another peer's model or the run's final model.

**Spent**: each process's wall time from its start (the `start` line's `t` minus its `process_s`, so interpreter
start-up, imports and the state download count) to its end: the chaos kill that ended it, else its last line. A
killed process is charged up to the kill, as the data-parallel baseline charges a killed rank, not only to its
last line, which can be seconds earlier; a restarted process killed before it wrote its `start` line is charged
from its restart to that kill. The seconds a killed peer is down count for nothing.

**Reached**, per incarnation, in inner-step seconds (`round_compute_s` of each `merge` line):

- A group merge whose result this peer took: the round counts by `own_kept`, the fraction of its Δ that entered
  the group's average (the slices' owners report whether their guards left this peer's part out).
- A merge alone, a group merge that failed for this peer (it merged alone), and a group merge whose averaged
  global model this peer refused (`state_refused`: it steps its own θg on): the round is counted as being only
  in this peer's own θg. (The others may have taken its Δ all the same: a merge can fail for one member after
  the others got every slice, and a refusing peer's Δ is in the Δ̄ they applied. Neither is counted: the peer
  cannot tell the first, and in the second it judged the group's model farther off than honest peers drift.)
  It is pending, and reaches others only through that θg:
  - a later group merge that averages the members' global models (`adopted_state`) carries the pending rounds
    by this peer's `state_share` of the agreed θg (its state weight ÷ the group's, by the group's count); the
    rest of them was replaced by the others' models and is lost;
  - a later group merge that does not (the members' digests agreed) carries them in full. Within one
    incarnation a peer's θg changes only by its own merges, and after a round merged alone no other peer's
    merges can produce the same θg: the others hold it because a joiner downloaded it, from this peer or
    from one that had, so those rounds are in their models whole. (A peer that had adopted the others' θg in
    between would have done so in a merge that averaged global models, which already settled its pending
    rounds, or in a download at its start, before any round.)
  - the run's end: if the incarnation ends normally (a final `eval` line, and no kill), its θg is the final
    model, and the pending rounds count in full;
  - a kill: they are lost, as are the steps after the incarnation's last merge. A restarted peer's θg from its
    checkpoint is counted as bringing nothing new, even when a later agreement averages it in.

A merge's rebase keeps only `outer.rebase_keep` of the inner steps taken while it was in flight (stale steps,
`outer.stale_share_kept`); the rest of their progress is given up, and their seconds (`rebase_dropped_s` of that
merge's line) are taken off the next round's, whose Δ they are in.

Known to be generous still: `state_share` is a weight share, and the robust rule that combines global models in
groups of 3 or more (CenteredClip by default) can give a lone differing θg less, down to nothing where the others
agree. Lines written before `own_kept` and `state_share` existed count as all kept and no share.
"""

from __future__ import annotations

import math
from pathlib import Path

from p2pdiloco.util.logfiles import read_jsonl


def chaos_events(run: Path) -> dict[str, list[dict]]:
    """{peer name: its kill and restart events in time order} from `run/chaos.jsonl` ({} without churn)."""
    path = run / "chaos.jsonl"
    events: dict[str, list[dict]] = {}
    for row in read_jsonl(path) if path.exists() else []:
        events.setdefault(row["peer"], []).append(row)
    return {peer: sorted(rows, key=lambda r: r["t"]) for peer, rows in events.items()}


def goodput_from_metrics(path: Path, chaos: list[dict] | None = None) -> dict:
    """Spent and reached seconds of one peer (see the module docstring for the rule).

    Args:
        path: the peer's metrics.jsonl, all incarnations.
        chaos: this peer's chaos events ({"t": Unix seconds, "event": "kill" | "restart"}, in time order);
            None or [] when it was never killed.

    Returns:
        {"spent_s", "reached_s", "incarnations"}.
    """
    incarnations: list[list[dict]] = []
    for row in read_jsonl(path):
        if row.get("kind") == "start" or not incarnations:
            incarnations.append([])
        incarnations[-1].append(row)
    incarnations = [rows for rows in incarnations if rows[0].get("kind") == "start"]
    starts = [rows[0]["t"] - rows[0].get("process_s", 0.0) for rows in incarnations]
    kills = [e["t"] for e in chaos or [] if e["event"] == "kill"]
    restarts = [e["t"] for e in chaos or [] if e["event"] == "restart"]
    spent = reached = 0.0
    for i, rows in enumerate(incarnations):
        until = starts[i + 1] if i + 1 < len(starts) else float("inf")
        killed = next((k for k in kills if starts[i] <= k < until), None)
        spent += (killed if killed is not None else rows[-1]["t"]) - starts[i]
        final_eval = any(r.get("kind") == "eval" and r.get("final") for r in rows)
        reached += _reached(rows, ended=killed is None and final_eval)
    for r in restarts:  # a process killed before its start line: nothing else records it
        killed = next((k for k in kills if k > r), None)
        previous = max((k for k in kills if k < r), default=-math.inf)  # the kill this restart follows
        if killed is not None and not any(previous < s <= killed for s in starts):
            spent += killed - r
    return {"spent_s": spent, "reached_s": reached, "incarnations": len(incarnations)}


def _reached(rows: list[dict], ended: bool) -> float:
    """Inner-step seconds of one incarnation whose effect reached another peer's model or, if `ended` (a normal
    end with a final eval), the final model."""
    reached = pending = dropped = 0.0
    for r in rows:
        if r.get("kind") != "merge":
            continue
        # the steps a merge's rebase gave up a share of were taken while it was in flight: in the next round
        compute, kept = max(0.0, r.get("round_compute_s", 0.0) - dropped), r.get("own_kept", 1.0)
        dropped = r.get("rebase_dropped_s", 0.0)
        if r["group_size"] <= 1:
            pending += compute
        elif r.get("state_refused"):
            pending += compute * kept  # in this peer's θg only, through Δ̄, and only the part that entered it
        elif r.get("adopted_state"):
            reached += pending * r.get("state_share", 0.0) + compute * kept
            pending = 0.0
        else:
            reached += pending + compute * kept
            pending = 0.0
    return reached + (pending if ended else 0.0)


def startups(run: Path) -> dict[str, list[float]]:
    """Seconds from each process start to its first inner step (`process_s` of the eval line before it), split
    into first starts and restarts (every later incarnation in a peer's metrics.jsonl); a process killed before
    its first step has none."""
    out: dict[str, list[float]] = {"first": [], "restart": []}
    for path in sorted(run.glob("peers/*/metrics.jsonl")):
        n = 0
        for row in read_jsonl(path):
            if row.get("kind") == "start":
                n, seen = n + 1, False
            elif n and not seen and row.get("kind") == "eval" and "process_s" in row:
                out["first" if n == 1 else "restart"].append(float(row["process_s"]))
                seen = True
    return out


def run_goodput(run: Path) -> dict | None:
    """Goodput of a run folder: every peer's (`run/peers/*/metrics.jsonl`) spent and reached seconds summed.

    Returns:
        {"goodput", "spent_s", "reached_s", "incarnations"}, or None if the folder holds no metrics.
    """
    paths = sorted(run.glob("peers/*/metrics.jsonl"))
    if not paths:
        return None
    chaos = chaos_events(run)
    per_peer = [goodput_from_metrics(p, chaos.get(p.parent.name)) for p in paths]
    spent, reached = sum(p["spent_s"] for p in per_peer), sum(p["reached_s"] for p in per_peer)
    return {"goodput": reached / spent if spent else 0.0, "spent_s": spent, "reached_s": reached,
            "incarnations": sum(p["incarnations"] for p in per_peer)}
