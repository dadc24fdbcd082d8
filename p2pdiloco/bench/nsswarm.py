"""A swarm whose processes live in network namespaces: a bootstrap node in a hub, one peer per namespace.

The benches that emulate links (slowlink, wan) start every process with `ip netns exec NS` and the public
CLI (`p2pdiloco bootstrap`, `p2pdiloco peer --initial-peers ...`), as a volunteer would run them, and stop
and reap them all (by pid, with what they started) however the run ends.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from p2pdiloco.app.local import PeerProc, peer_command, stop_peers
from p2pdiloco.app.summary import summarize
from p2pdiloco.bench.netns import exec_in
from p2pdiloco.config import Config
from p2pdiloco.util.logfiles import read_jsonl

BOOTSTRAP_START_S = 60.0


def start_proc(name: str, cmd: list[str], run_dir: Path) -> PeerProc:
    """Start `cmd` with its output in run_dir/NAME.log, after removing what an earlier run there left."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "peer_summary.json", "bootstrap.maddr"):
        (run_dir / stale).unlink(missing_ok=True)
    proc = PeerProc(name, run_dir, None, (run_dir / f"{name}.log").open("w"), cmd=cmd,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
    proc.start()
    return proc


def bootstrap_maddr(boot: PeerProc, path: Path, host: str, timeout_s: float = BOOTSTRAP_START_S) -> str:
    """The bootstrap node's multiaddr on `host`, once it has written its maddr file at `path`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and boot.proc.poll() is None:
        if path.exists():
            maddrs = path.read_text().split()
            found = next((m for m in maddrs if f"/{host}/" in m), None)
            if found is None:
                raise RuntimeError(f"the bootstrap node listens on {maddrs}, not on {host}")
            return found
        time.sleep(0.2)  # polling for the file, with a deadline
    raise RuntimeError(f"the bootstrap node did not start; see {boot.run_dir / 'bootstrap.log'}")


def merge_rows(path: Path) -> list[dict]:
    """The merge lines of a peer's metrics.jsonl (alone and in a group)."""
    return [r for r in read_jsonl(path) if r.get("kind") == "merge"]


def start_peer(i: int, n: int, place: tuple[str, str], cfg: Config, maddr: str, sets: list[str], out: Path) -> PeerProc:
    """Peer i of n (data shard i/n, seed i; waits for n live peers) in namespace place[0], listening on place[1],
    with its folder out/peers/peer<i>."""
    ns, addr = place
    # the peer command of `local` (shard, seed, wait for all peers); the later --host wins
    cmd = exec_in(ns) + peer_command(i, n, cfg, maddr, out / "peers" / f"peer{i}", None, sets) + ["--host", addr]
    return start_proc(f"peer{i}", cmd, out / "peers" / f"peer{i}")


def run_swarm(hub: str, hub_addr: str, places: list[tuple[str, str]], cfg: Config, sets: list[str], out: Path,
              timeout_s: float, bootstrap_port: int,
              late: Callable[[float, str], list[PeerProc]] | None = None) -> dict:
    """One swarm: a bootstrap node in namespace `hub`, peer i in namespace places[i]; the run's summary.

    Args:
        hub: the namespace of the bootstrap node.
        hub_addr: the bootstrap node's address there.
        places: (namespace, address) of each peer.
        cfg: the run's config (run id, total steps: `local`'s peer command is built from it).
        sets: the --set lines every peer gets.
        out: the run's folder (peers/peer<i>/ each).
        timeout_s: how long the peers may take to finish before the run counts as failed.
        bootstrap_port: the bootstrap node's TCP port.
        late: called every half second while the peers run, with the seconds since they were started and the
            bootstrap node's multiaddr; the peers it starts (e.g. a joiner, `start_peer`) are waited for, stopped
            and summarized with the others.

    Returns:
        `summarize`'s summary, with `merge_s_mean`: the mean merge time of merges in a group.
    """
    n = len(places)
    procs: list[PeerProc] = []
    t0 = time.monotonic()
    try:
        boot = start_proc("bootstrap", exec_in(hub) + [
            sys.executable, "-m", "p2pdiloco", "bootstrap", "--host", hub_addr, "--port", str(bootstrap_port),
            "--identity", str(out / "bootstrap.key"), "--maddr-file", str(out / "bootstrap.maddr")], out)
        procs.append(boot)
        maddr = bootstrap_maddr(boot, out / "bootstrap.maddr", hub_addr)
        for i, place in enumerate(places):
            procs.append(start_peer(i, n, place, cfg, maddr, sets, out))
        started = time.monotonic()
        deadline = started + timeout_s
        while any(p.proc.poll() is None for p in procs[1:]):
            if late is not None:
                procs += late(time.monotonic() - started, maddr)
            if time.monotonic() > deadline:
                raise RuntimeError(f"peers did not finish in {timeout_s:.0f} s; see {out}/peers/*/peer*.log")
            for p in procs:
                if p.proc.poll() is None:
                    p.remember_descendants()
            time.sleep(0.5)  # waiting for the peers to exit, with a deadline
    finally:
        stop_peers(procs)
    failed = {p.name: p.proc.returncode for p in procs[1:] if p.proc.returncode != 0}
    if failed:
        raise RuntimeError(f"peers failed: {failed}; see {out}/peers/*/peer*.log")
    dirs = [p.run_dir for p in procs[1:]]
    summary = summarize(out, dirs, cfg.to_dict(), time.monotonic() - t0)
    merges = [r for d in dirs for r in merge_rows(d / "metrics.jsonl") if r.get("group_size", 1) > 1]
    summary["merge_s_mean"] = statistics.mean(r["merge_s"] for r in merges) if merges else None
    return summary
