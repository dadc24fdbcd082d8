"""What `bench wan` reads out of a finished run's folder: figures from peers' metrics.jsonl, logs and summaries.

Pure functions of files (no lab, no root), so that each figure is tested on small fixture files:

- **compute utilization**: time in inner steps ÷ wall time of the training loop (`compute_s ÷ train_s` of each
  peer summary), as `bench slowlink` computes it;
- **failed dials**: log records (lines that start with a time and a level) that say a dial or a merge failed;
- **group figures**: per run, the group merge times (their median, and the largest ÷ the median), and the merges
  in a group smaller than the whole swarm (a split; a merge alone counts too);
- **seconds from a peer's start** (its process start: the `start` line's `t` − `process_s`) until its log first
  says something, e.g. why it merges alone; log times have a resolution of one second;
- **a joiner**: seconds from its start until it holds the swarm's state (its `join` line) and until its first
  group merge, against state bytes ÷ downlink + `JOIN_SLACK_S`.
"""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path

from p2pdiloco.util.logfiles import read_jsonl

JOIN_SLACK_S = 30.0
"""What a joiner may take beyond downloading the state at its downlink's rate: start-up, matchmaking, a round."""

FAILED_DIAL: tuple[tuple[str, re.Pattern], ...] = (
    ("dial backoff", re.compile(r"dial backoff")),
    ("dial failed", re.compile(r"failed to dial|dial tcp|Connect failed|i/o timeout|network is unreachable")),
    ("merge failed", re.compile(r"merge of round \d+ failed|unexpected error in merge")),
    ("leader silent", re.compile(r"never sent the group")),
)
"""What a peer logs when a dial or a merge failed, by kind; a record that matches several counts as the first."""

NOBODY_LEADS = "nobody can dial this peer nor any of its"
"""The warning of a peer that merges alone because neither it nor a ready mate can be dialed (network/dialable.py)."""
UNREACHABLE = "others cannot dial this peer"
"""The warning of a peer whose dial-back check found that nobody can dial it (app/reach.py)."""

_RECORD = re.compile(r"^(\d\d):(\d\d):(\d\d) [A-Z]+ ")
"""A log record's first line: its local time of day and its level (WARN where hivemind's handler names it)."""


def utilization(peers: list[dict]) -> dict:
    """Compute utilization of a run's peers from their summaries: {"mean", "min", "per_peer"} (None if none)."""
    per_peer = [p["compute_s"] / p["train_s"] for p in peers if p.get("train_s")]
    return {"mean": statistics.mean(per_peer) if per_peer else None, "min": min(per_peer, default=None),
            "per_peer": per_peer}


def failed_dials(log: Path) -> dict[str, int]:
    """{kind: log records of that kind} (`FAILED_DIAL`) in a peer's log; kinds never seen are left out."""
    counts: dict[str, int] = {}
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        if not _RECORD.match(line):
            continue  # a traceback's lines belong to the record above them
        kind = next((k for k, pattern in FAILED_DIAL if pattern.search(line)), None)
        if kind is not None:
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def process_start(rows: list[dict]) -> float | None:
    """Unix time at which a peer's process started, from the first `start` line of its metrics (None without)."""
    start = next((r for r in rows if r.get("kind") == "start"), None)
    return start["t"] - start.get("process_s", 0.0) if start else None


def seconds_until(log: Path, text: str, start: float) -> float | None:
    """Seconds from `start` (Unix time) until the first log record of `log` that contains `text` (None if none).

    Log records carry the local time of day to the second; a record is placed on the day that puts it within
    12 hours of `start`.
    """
    local = time.localtime(start)
    start_of_day = local.tm_hour * 3600 + local.tm_min * 60 + local.tm_sec + start % 1
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        m = _RECORD.match(line)
        if m and text in line:
            offset = int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3]) - start_of_day
            return offset - 86400 if offset > 43200 else offset + 86400 if offset < -43200 else offset
    return None


def group_figures(run_dir: Path, names: list[str], swarm: int) -> dict:
    """Merges of a run's peers: group merge times, and merges in a group smaller than `swarm` peers.

    Args:
        run_dir: the run's folder (peers/<name>/metrics.jsonl and <name>.log).
        names: the peers to read.
        swarm: how many peers a merge of the whole swarm has.

    Returns:
        {"merges", "group_merges", "median_s", "max_s", "max_over_median" (of the group merges but the final ones:
        a peer that reached the last step waits there for the others), "later_max_over_median" (the same without
        each peer's first merge, which opens its first connections), "final_max_s", "split_merges" (merges, alone
        included, in a group of fewer than `swarm`), "smallest_group", "failed_dials" ({kind: records}, every peer),
        "failed_dial_records"}.
    """
    merges, later, dials = [], [], {}
    for name in names:
        path = run_dir / "peers" / name / "metrics.jsonl"
        own = [r for r in read_jsonl(path) if r.get("kind") == "merge"] if path.exists() else []
        merges, later = merges + own, later + own[1:]
        for kind, n in failed_dials(run_dir / "peers" / name / f"{name}.log").items():
            dials[kind] = dials.get(kind, 0) + n
    group = [r for r in merges if r.get("group_size", 1) >= 2]
    before_final = [r["merge_s"] for r in group if not r.get("final")]
    final = [r["merge_s"] for r in group if r.get("final")]
    after_first = [r["merge_s"] for r in later if r.get("group_size", 1) >= 2 and not r.get("final")]
    median = statistics.median(before_final) if before_final else None
    return {"merges": len(merges), "group_merges": len(group), "median_s": median,
            "max_s": max(before_final, default=None),
            "max_over_median": max(before_final) / median if before_final and median else None,
            "later_max_over_median": max(after_first) / median if after_first and median else None,
            "final_max_s": max(final, default=None),
            "split_merges": sum(1 for r in merges if r.get("group_size", 1) < swarm),
            "smallest_group": min((r.get("group_size", 1) for r in merges), default=None),
            "failed_dials": dials, "failed_dial_records": sum(dials.values())}


def clean(figures: dict, max_ratio: float = 2.0) -> bool:
    """A run with no failed dial, no merge over `max_ratio` times the median and no split (`group_figures`)."""
    return (figures["group_merges"] > 0 and figures["failed_dial_records"] == 0 and figures["split_merges"] == 0
            and figures["max_over_median"] is not None and figures["max_over_median"] <= max_ratio)


def alone_reasons(peer_dir: Path, name: str) -> dict:
    """Seconds from a peer's start until its log says nobody can dial it, and until it says it merges alone
    because nobody in reach can lead; its rounds in a group and alone."""
    rows = read_jsonl(peer_dir / "metrics.jsonl") if (peer_dir / "metrics.jsonl").exists() else []
    start = process_start(rows)
    log = peer_dir / f"{name}.log"
    merges = [r for r in rows if r.get("kind") == "merge"]
    group = sum(1 for r in merges if r.get("group_size", 1) >= 2)
    return {"unreachable_s": seconds_until(log, UNREACHABLE, start) if start else None,
            "nobody_leads_s": seconds_until(log, NOBODY_LEADS, start) if start else None,
            "group_rounds": group, "alone_rounds": len(merges) - group}


def joiner_figures(metrics: Path, state_bytes: int, down_mbit: float | None) -> dict:
    """A joiner's seconds from its start to the swarm's state and to its first group merge, and the bound on both.

    Args:
        metrics: the joiner's metrics.jsonl.
        state_bytes: the bytes of one state download (θg and outer momentum, fp32: 8 bytes a parameter).
        down_mbit: the joiner's downlink, Mbit/s (None: not limited).

    Returns:
        {"state_s" (its `join` line; None if it never downloaded a state), "download_s", "donor", "first_group_merge_s"
        (None if it never merged in a group), "state_bytes", "state_bytes_received" (the state traffic it counted
        by its first merge; a fetch may download from more than one donor), "arrived_after_end" (the swarm had
        finished when it looked: the run was too short for it), "bound_s", "within_bound"}.
    """
    rows = read_jsonl(metrics) if metrics.exists() else []
    start = process_start(rows)
    join = next((r for r in rows if r.get("kind") == "join"), None)
    merge = next((r for r in rows if r.get("kind") == "merge" and r.get("group_size", 1) >= 2), None)
    first = next((r for r in rows if r.get("kind") == "merge"), None)
    bound = state_bytes * 8 / (down_mbit * 1e6) + JOIN_SLACK_S if down_mbit else JOIN_SLACK_S
    state_s = join["t"] - start if join and start is not None else None
    merge_s = merge["t"] - start if merge and start is not None else None
    return {"state_s": state_s, "download_s": join.get("download_s") if join else None,
            "donor": join.get("donor") if join else None, "first_group_merge_s": merge_s,
            "state_bytes": state_bytes, "bound_s": bound,
            "state_bytes_received": (first or {}).get("traffic", {}).get("state", {}).get("received"),
            "arrived_after_end": any(r.get("kind") == "swarm_finished" for r in rows),
            "within_bound": state_s is not None and merge_s is not None and max(state_s, merge_s) <= bound}
