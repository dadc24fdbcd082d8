"""What `bench soak` reads of a running swarm every sample, and the figures it makes of the samples.

Per peer, its process tree by role: `main` (the peer's python process), `dht` (the DHT process it forks), `p2pd`
(that process's p2p daemon) and `reaper` (the watchdog that ends them if the peer dies); per process its PSS and
USS (bench/proctree.py), open file descriptors, threads and child processes. For the machine: hivemind's socket
files in /tmp (all of them, and those of this run's daemons, live or left behind), the run folder's bytes on
disk, and the DHT records an observer node of the swarm holds.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from pathlib import Path

import psutil

from p2pdiloco.bench.proctree import process_memory
from p2pdiloco.network.sockets import bound_paths, bound_sockets, daemon_sockets, socket_files

ROLES = ("main", "dht", "p2pd", "reaper")
COUNTS = ("fds", "threads", "children")
PSS_LIMIT_MB_PER_H = 2.0
"""The most a process's PSS may grow per hour after the warm-up: the slope of its low-water marks (`floor_points`)."""
FLOOR_WINDOW_S = 300.0
"""The span of which a process's lowest PSS sample is one low-water mark (`floor_points`)."""
COUNT_LIMIT = 2
"""The most a process's fds, threads or children may grow from the warm-up's end to the run's end."""
EDGE = 5
"""Samples at each end whose median stands for it: one sample is a moment (a connection or a stream being opened),
five at 30 s are the level over 2.5 minutes."""


def process_counts(pid: int) -> dict[str, int]:
    """Open file descriptors, threads and direct child processes of one process (zeros if it is gone)."""
    out = {"fds": 0, "threads": 0, "children": 0}
    with contextlib.suppress(OSError, psutil.Error):
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
        out["threads"] = psutil.Process(pid).num_threads()
        out["children"] = len(psutil.Process(pid).children())
    return out


ANON_KEYS = {"Rss:": "rss", "Anonymous:": "anon"}
"""smaps_rollup lines read besides PSS and USS: a forked process's USS grows when its parent writes to the pages
they shared at the fork (copy on write gives the writer a fresh page and leaves the old one to the other alone),
while its resident anonymous memory, what it allocated itself or inherited, stays the same."""


def anon_memory(pid: int) -> dict[str, int]:
    """{"rss": bytes, "anon": bytes} of one process (resident, and of that the anonymous part); zeros if gone."""
    out = {"rss": 0, "anon": 0}
    with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(" ")
            if key in ANON_KEYS:
                out[ANON_KEYS[key]] += int(rest.split()[0]) * 1024
    return out


def tree_roles(pid: int) -> dict[str, int]:
    """{role: pid} of a peer's (or a watcher's) process tree: `main` is `pid`; `p2pd` the daemon under it,
    `dht` the daemon's parent, `reaper` the watchdog; processes of no role are left out."""
    roles = {"main": pid}
    with contextlib.suppress(psutil.Error):
        for p in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if p.name() == "p2pd" and "p2pd" not in roles:
                    roles["p2pd"] = p.pid
                    if p.ppid() != pid:
                        roles["dht"] = p.ppid()
                elif "p2pdiloco.network.reaper" in p.cmdline():
                    roles["reaper"] = p.pid
    return roles


def sample_tree(pid: int) -> dict[str, dict]:
    """{role: {"pid", "pss", "uss", "rss", "anon", "fds", "threads", "children"}} of the tree under `pid` (bytes,
    counts)."""
    return {role: {"pid": p, **process_memory(p), **anon_memory(p), **process_counts(p)}
            for role, p in tree_roles(pid).items()}


def daemon_ids(tree: dict[str, dict]) -> list[str]:
    """The hivemind socket files of a sampled tree (`sample_tree`): its p2pd's two, from its command line, and
    every one a process of the tree has bound (the peer's own client of its daemon, bound by its main process)."""
    paths = []
    with contextlib.suppress(psutil.Error, KeyError):
        paths += daemon_sockets(psutil.Process(tree["p2pd"]["pid"]).cmdline())
    table = bound_sockets() or {}
    for proc in tree.values():
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{proc['pid']}/fd"):
                with contextlib.suppress(OSError, ValueError):
                    link = os.readlink(f"/proc/{proc['pid']}/fd/{fd}")
                    path = table.get(int(link[8:-1])) if link.startswith("socket:[") else None
                    if path and Path(path).name.startswith("hivemind-"):
                        paths.append(path)
    return paths


def socket_census(ours: set[str]) -> dict[str, int]:
    """hivemind socket files in /tmp: all, the stale ones (bound by nobody), and of `ours` (the paths of this
    run's daemons so far) those that exist and those of them that are stale."""
    files = [str(p) for p in socket_files()]
    bound = bound_paths() or set()
    stale = [f for f in files if f not in bound]
    return {"machine": len(files), "machine_stale": len(stale),
            "ours": sum(f in ours for f in files), "ours_stale": sum(f in ours for f in stale)}


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under `folder` (their sizes, as `du --apparent-size` counts them)."""
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


async def dht_records(_dht, node) -> dict[str, int]:
    """Run in a DHT's process (`DHT.run_coroutine`): the records its node stores and caches."""
    return {"stored": len(node.protocol.storage), "cached": len(node.protocol.cache)}


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per hour; None under 3 points."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return None
    return sum((t - mt) * (v - mv) for t, v in points) / var * 3600


def floor_points(points: list[tuple[float, float]], window_s: float = FLOOR_WINDOW_S) -> list[tuple[float, float]]:
    """A process's low-water marks: the lowest of `points` (seconds, value) in each `window_s` from the first, at the
    window's mean time; a last window with under half the samples of the fullest is left out (fewer samples, a
    higher lowest).

    A peer's main process frees a round's buffers and hands them back after each merge (util/memory), so its PSS
    swings by tens of MB within minutes and a 30 s sample lands anywhere on that saw: over 50 minutes the
    least-squares slope of all samples was ±10 MB/h wide, five times the limit, with or without a leak. What a leak
    raises is the floor the saw returns to: the slope of the lowest sample of every 5 minutes."""
    windows: dict[int, list[tuple[float, float]]] = {}
    for t, v in points:
        windows.setdefault(int((t - points[0][0]) // window_s), []).append((t, v))
    fullest = max((len(w) for w in windows.values()), default=0)
    return [(sum(t for t, _ in w) / len(w), min(v for _, v in w)) for _, w in sorted(windows.items())
            if 2 * len(w) >= fullest]


def robust_slope_per_hour(points: list[tuple[float, float]]) -> dict[str, float] | None:
    """Two readings of a noisy slope to print beside the least-squares one (which the limits judge).

    `theil_sen`: the median of the slopes between every pair of points, per hour; a few outliers (a sample taken
    mid-merge) do not move it. `ci95`: the half-width of the least-squares slope's 95 % interval, per hour, widened
    for residuals that follow each other (lag-1 autocorrelation r: n (1 - r) / (1 + r) effective points), as a
    process's memory swinging with its rounds does. None under 4 points.
    """
    n = len(points)
    ols = slope_per_hour(points)
    if n < 4 or ols is None:
        return None
    pairs = sorted((v2 - v1) / (t2 - t1) for i, (t1, v1) in enumerate(points) for t2, v2 in points[i + 1:] if t2 != t1)
    mid = len(pairs) // 2
    theil_sen = (pairs[mid] if len(pairs) % 2 else (pairs[mid - 1] + pairs[mid]) / 2) * 3600
    mt, mv = sum(t for t, _ in points) / n, sum(v for _, v in points) / n
    b = ols / 3600
    resid = [v - mv - b * (t - mt) for t, v in points]
    sxx = sum((t - mt) ** 2 for t, _ in points)
    ss = sum(e * e for e in resid)
    r = sum(a * c for a, c in zip(resid, resid[1:], strict=False)) / ss if ss else 0.0
    n_eff = max(4.0, n * (1 - r) / (1 + r)) if r > 0 else float(n)
    df = n_eff - 2
    t95 = 1.96 + 2.372 / df + 2.823 / df**2  # Student's t at 97.5 % (Cornish-Fisher), within 1 % from 5 df
    se = (ss / (n - 2) / sxx) ** 0.5 * (n / n_eff) ** 0.5
    return {"theil_sen": theil_sen, "ci95": t95 * se * 3600, "lag1": r}


def series(samples: list[dict], tree: str, role: str, key: str) -> list[tuple[float, int, float]]:
    """(elapsed s, pid, value) of one figure of one process role of one tree, over the samples that have it."""
    out = []
    for s in samples:
        proc = s["trees"].get(tree, {}).get(role)
        if proc is not None and key in proc:  # (samples of older runs have no "anon")
            out.append((s["elapsed_s"], proc["pid"], proc[key]))
    return out


def flatness(samples: list[dict], warmup_s: float) -> list[dict]:
    """Per tree and role, over the samples of the process alive at the end (a restarted peer's last incarnation)
    after its own warm-up (`warmup_s` from the run's start, or from its first sample if it started later: a resumed
    process loads and faults in its pages as the first one did): PSS and USS slopes in MB/h, of every sample and of
    the low-water marks (`floor_points`: the PSS limit judges that one, where there are 3), and the growth of each
    count from the first such sample to the last (each end the median of its `EDGE` samples). A process judged over
    less than half the time after the run's warm-up is reported without a verdict."""
    if not samples:
        return []
    end = samples[-1]["elapsed_s"]
    rows = []
    for tree in sorted({t for s in samples for t in s["trees"]}):
        for role in ROLES:
            pss = series(samples, tree, role, "pss")
            if not pss:
                continue
            last_pid = pss[-1][1]
            born = min(t for t, pid, _ in pss if pid == last_pid)
            since = max(warmup_s, born - samples[0]["elapsed_s"] + warmup_s)  # its own warm-up if it started later
            after = [(t, v) for t, pid, v in pss if t >= since and pid == last_pid]
            if not after:
                continue
            span = after[-1][0] - after[0][0]
            row = {"tree": tree, "role": role, "pid": last_pid, "samples": len(after), "span_s": span, "from_s": since,
                   "judged": span >= (end - warmup_s) / 2 and len(after) >= 3}
            for key in ("pss", "uss", "anon"):
                pts = [(t, v / 1e6) for t, pid, v in series(samples, tree, role, key) if t >= since and pid == last_pid]
                row[f"{key}_mb_per_h"] = slope_per_hour(pts)
                row[f"{key}_mb_last"] = pts[-1][1] if pts else None
                row[f"{key}_robust"] = robust_slope_per_hour(pts)
                row[f"{key}_floor_mb_per_h"] = slope_per_hour(floor_points(pts))
            for key in COUNTS:
                vals = [v for t, pid, v in series(samples, tree, role, key) if t >= since and pid == last_pid]
                row[f"{key}_first"], row[f"{key}_last"] = statistics.median_low(vals[:EDGE]), statistics.median_low(vals[-EDGE:])
                row[f"{key}_growth"] = row[f"{key}_last"] - row[f"{key}_first"]
            slope = row["pss_floor_mb_per_h"] if row["pss_floor_mb_per_h"] is not None else row["pss_mb_per_h"]
            row["ok"] = (None if not row["judged"] else
                         (slope is None or slope <= PSS_LIMIT_MB_PER_H)
                         and all(row[f"{k}_growth"] <= COUNT_LIMIT for k in COUNTS))
            rows.append(row)
    return rows


def tree_counts(tree: dict[str, dict]) -> dict[str, int]:
    """A sampled tree's counts by role and figure, e.g. {"p2pd.fds": 31, "main.threads": 12}."""
    return {f"{role}.{key}": proc[key] for role, proc in tree.items() for key in COUNTS}
