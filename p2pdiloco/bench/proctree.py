"""Host resources of each peer of a local swarm as a whole: the peer's python process and everything under it
(the DHT process it forks, that process's p2pd daemon, torch's shared-memory manager, the reaper that stops p2pd
if the peer dies), read from /proc while the swarm runs (Linux only).

Memory is PSS (proportional set size: each shared page divided among the processes that map it, so that the
peers' PSS add up to what the swarm really holds, torch's shared libraries counted once in all) and USS (pages
only this process maps: Private_Clean + Private_Dirty). Both come from /proc/PID/smaps_rollup, which the
kernel sums for us, so a sample of 100 processes costs milliseconds.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import psutil

ROLLUP_KEYS = {"Pss:": "pss", "Private_Clean:": "uss", "Private_Dirty:": "uss"}
"""smaps_rollup lines (in kB) and the figure each adds to."""


def process_memory(pid: int) -> dict[str, int]:
    """{"pss": bytes, "uss": bytes} of one process; zeros if it is gone or unreadable."""
    out = {"pss": 0, "uss": 0}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(" ")
                if key in ROLLUP_KEYS:
                    out[ROLLUP_KEYS[key]] += int(rest.split()[0]) * 1024
    except OSError:  # exited between listing and reading
        pass
    return out


def tree_pids(pid: int) -> list[int]:
    """`pid` and all its descendants (empty if it is gone)."""
    try:
        root = psutil.Process(pid)
        return [pid, *(p.pid for p in root.children(recursive=True))]
    except psutil.Error:
        return []


def tree_memory(pid: int) -> dict[str, int]:
    """PSS and USS in bytes of `pid` and all its descendants together."""
    total = {"pss": 0, "uss": 0}
    for p in tree_pids(pid):
        for key, value in process_memory(p).items():
            total[key] += value
    return total


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of one process, its own threads only (None if it is gone): not its children's
    (`children_user`), which count only children it has reaped; each descendant is read by its own pid."""
    with contextlib.suppress(psutil.Error):
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    return None


def local_peers(root_pid: int) -> dict[str, int]:
    """{peer name: pid} of the peer processes `run_local` started under `root_pid`: their command lines carry
    `--in-local` and `--name NAME` (a forked peer's is its process title, one string); a peer's own forked DHT
    process carries the same command line and is left out, as is the bootstrap node's (it carries neither).
    Forked peers are the fork server's children, so the whole tree is searched."""
    peers = {}
    with contextlib.suppress(psutil.Error):
        for proc in psutil.Process(root_pid).children(recursive=True):
            with contextlib.suppress(psutil.Error, ValueError, IndexError):
                cmd = " ".join(proc.cmdline()).split()
                if "--in-local" in cmd and "--in-local" not in " ".join(proc.parent().cmdline()).split():
                    peers[cmd[cmd.index("--name") + 1]] = proc.pid
    return peers


class PeerSampler:
    """A thread that follows each local peer's process tree while a swarm runs.

    Every `cpu_every_s` it records the CPU seconds of each tree so far (of the processes alive then: one that
    exits takes its CPU seconds out of later readings, which is why figures take differences over a time when
    none exits). Every `memory_every_s` it records the trees' PSS and USS, for `memory_at` to pick the reading
    taken when the swarm was in full swing.

    Args:
        root_pid: the process under which the peers run (the one calling `run_local`).
        cpu_every_s: seconds between CPU readings.
        memory_every_s: seconds between memory readings.
    """

    def __init__(self, root_pid: int | None = None, cpu_every_s: float = 1.0, memory_every_s: float = 5.0):
        self.root_pid = root_pid if root_pid is not None else os.getpid()
        self.cpu_every_s, self.memory_every_s = cpu_every_s, memory_every_s
        self.cpu: dict[str, list[tuple[float, float]]] = {}
        """{peer name: [(Unix time, CPU seconds of its tree so far)]}, one per CPU reading."""
        self.memory: list[tuple[float, dict[str, dict[str, int]]]] = []
        """[(Unix time, {peer name: {"pss": bytes, "uss": bytes}})], one per memory reading."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-sampler", daemon=True)

    def __enter__(self) -> PeerSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def sample(self, memory: bool) -> None:
        """Read every peer tree's CPU now, and its memory too if `memory`."""
        now, mem = time.time(), {}
        for name, pid in local_peers(self.root_pid).items():
            cpu = [process_cpu_s(p) for p in tree_pids(pid)]
            self.cpu.setdefault(name, []).append((now, sum(c for c in cpu if c is not None)))
            if memory:
                mem[name] = tree_memory(pid)
        if mem:
            self.memory.append((now, mem))

    def _run(self) -> None:
        next_memory = 0.0
        while not self._stop.is_set():
            memory = time.monotonic() >= next_memory
            if memory:
                next_memory = time.monotonic() + self.memory_every_s
            self.sample(memory)
            self._stop.wait(self.cpu_every_s)
