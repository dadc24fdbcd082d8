"""`p2pdiloco bench soak`: a swarm under churn for an hour or more, its peers' processes sampled every 30 s, to
see whether anything a peer holds (memory, file descriptors, threads, child processes, socket files, disk, DHT
records) grows without bound.

The swarm is `local`'s: a bootstrap node and peers of the benchmark model with padded steps and timed rounds, on
loopback, started with the public command line. `peer0` (and every original peer past `peer2`) runs the whole time
untouched; on a fixed schedule `peer1` is SIGKILLed with everything it started (as a machine losing power) and
restarted 5 s later with --resume, `peer2` is stopped with SIGTERM and resumed, and fresh peers join, each leaving
for good at the next event. An observer DHT node, a `p2pdiloco dashboard` and a `p2pdiloco status --watch 30` watch the swarm
the whole time and are sampled too. After each kill or stop, the peer's counts are read again once it has merged in a group after its restart:
they should be back at the level they had before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from p2pdiloco.app.local import (
    STOP_GRACE_S,
    PeerProc,
    launch_peers,
    peer_command,
    report_run,
    start_bootstrap,
    stop_peers,
)
from p2pdiloco.bench.common import BENCH_MODEL_SETS, machine, write_results
from p2pdiloco.bench.soakprobe import (
    daemon_ids,
    dht_records,
    folder_bytes,
    sample_tree,
    socket_census,
    tree_counts,
)
from p2pdiloco.bench.soakreport import analyse, plot_soak, print_soak
from p2pdiloco.config import SwarmConfig, load_config, parse_set
from p2pdiloco.network.swarm import start_dht
from p2pdiloco.util.processes import stop_process

logger = logging.getLogger(__name__)

EVENTS = ("kill", "join", "leave", "term", "join", "leave", "join", "leave")
"""What happens at each event time, in turn: kill and restart peer1, a fresh peer joins, the newest joiner leaves
(SIGTERM, for good), SIGTERM and resume peer2. Each joiner leaves at the next event, so that a departed peer's traces
in the others (routing tables, connections, records, caches keyed by peer) add up: an hour's 11 events are 4 joins,
4 leaves, 2 kills and a stop."""
RESTART_DELAY_S = 5.0
QUIET_TAIL_S = 30.0
"""No event starts in a run's last seconds: the swarm is stopped with SIGTERM, on which each peer ends on the global
model it holds (having landed at most a merge under way), and a peer restarted later may not have merged back into its mates' model yet (in 2-minute soaks,
a resume 16-19 s before the end left the fresh joiner on a model of its own once in four runs)."""
STATUS_EVERY_S = 30
"""Seconds between the readings of the `status --watch` left running beside the swarm."""
SOAK_SETS = ["rounds.round_seconds=5.0", "merge.merge_window_s=10", "run.checkpoint_every=5", "swarm.heartbeat_s=5"]
"""The swarm's settings on top of the benchmark model: timed rounds of 5 s, a checkpoint every 5 rounds."""


@dataclass
class Schedule:
    """When things happen in a soak of `minutes` (all in seconds)."""

    total_s: float
    warmup_s: float
    event_s: float
    sample_s: float

    @classmethod
    def for_minutes(cls, minutes: float, event_s: float | None = None, sample_s: float | None = None) -> Schedule:
        """10 minutes of warm-up for an hour or more (a sixth of shorter runs), an event every twelfth of the run
        (5 min in an hour), a sample every 30 s (more often in runs under 12 minutes)."""
        total = minutes * 60
        return cls(total, 600.0 if minutes >= 60 else total / 6, event_s or total / 12,
                   sample_s or min(30.0, total / 24))


class Soak:
    """One soak run: the swarm, its schedule of kills, stops and joins, and the samples.

    Args:
        out: the bench's folder; the swarm runs in `out/run`.
        peers: peers started at the beginning.
        schedule: when to sample and when to disturb the swarm.
        sets: the peers' config overrides.
    """

    def __init__(self, out: Path, peers: int, schedule: Schedule, sets: list[str]):
        self.out, self.n, self.schedule, self.sets = out, peers, schedule, sets
        self.run_dir = out / "run"
        self.cfg = load_config(None, [parse_set(sets)])
        self.peers: list[PeerProc] = []
        self.samples: list[dict] = []
        self.events: list[dict] = []
        self.levels: list[dict] = []
        self.awaiting: dict[str, dict] = {}
        """{peer name: its level record} for peers killed or stopped whose counts after the restart are not read."""
        self.stopping: dict[str, float] = {}
        """{peer name: when SIGTERM was sent} for peers stopping that are to be resumed."""
        self.ours: set[str] = set()
        self.t0 = 0.0
        self.prefork = None
        self.maddr = ""

    def run(self) -> dict:
        """Run the swarm for the schedule's time, stop it, and return the samples, events and run summary."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115 - closed with the process
        before = {"shm": len(os.listdir("/dev/shm")), **socket_census(set())}
        started = time.monotonic()
        with contextlib.ExitStack() as closing:
            self.maddr, self.prefork = start_bootstrap(self.cfg, self.run_dir, quiet, None, closing)
            closing.callback(stop_peers, self.peers)
            launch_peers(self.peers, self.n, self.cfg, self.maddr, self.run_dir, None, self.sets, {}, {}, self.prefork)
            self.observer = start_dht(SwarmConfig(host="127.0.0.1", initial_peers=[self.maddr],
                                                  run_id=self.cfg.swarm.run_id))
            closing.callback(self.observer.shutdown)
            self.dashboard = self._start_watcher("dashboard", "--port", "0", "--refresh", "2")
            closing.callback(stop_process, self.dashboard, STOP_GRACE_S)
            self.status = self._start_watcher("status", "--watch", str(STATUS_EVERY_S), "--json", "--timeout", "60")
            closing.callback(stop_process, self.status, STOP_GRACE_S)
            self._loop()
            pids = {proc["pid"] for s in self.samples for tree in s["trees"].values() for proc in tree.values()}
        summary = report_run(self.peers, self.cfg, self.run_dir, started, quiet, None, False)
        left = {"processes": sorted(p for p in pids if _alive(p)), "shm": len(os.listdir("/dev/shm")),
                **socket_census(self.ours)}
        return {"samples": self.samples, "events": self.events, "levels": self.levels, "summary": summary,
                "before": before, "after": left, "start_unix": self.t0_unix}

    def _start_watcher(self, command: str, *flags: str) -> subprocess.Popen:
        """`p2pdiloco dashboard` or `status --watch`, its output in the bench's folder (not the run's: its bytes
        are not the peers')."""
        with (self.out / f"{command}.log").open("w") as log:
            return subprocess.Popen([sys.executable, "-m", "p2pdiloco", command, "--initial-peers", self.maddr,
                                     "--run-id", self.cfg.swarm.run_id, *flags],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def _loop(self) -> None:
        s = self.schedule
        self.t0, self.t0_unix = time.monotonic(), time.time()
        next_sample, next_event, k = self.t0, self.t0 + s.event_s, 0
        while (now := time.monotonic()) < self.t0 + s.total_s:
            self._restarts(now)
            if now >= next_event and next_event < self.t0 + s.total_s - QUIET_TAIL_S:
                self._event(EVENTS[k % len(EVENTS)])
                k, next_event = k + 1, next_event + s.event_s
            for p in self.peers:
                if p.proc.poll() is None:
                    p.remember_descendants()
                p.poll_metrics()
            self._unscheduled_exits()
            self._levels_after()
            if now >= next_sample:
                self._sample()
                next_sample += s.sample_s
            time.sleep(0.5)  # the schedule's tick, not a wait for a condition
        self._sample()

    def _peer(self, name: str) -> PeerProc | None:
        return next((p for p in self.peers if p.name == name), None)

    def _event(self, kind: str) -> None:
        """Disturb the swarm: `kind` is one of `EVENTS`."""
        if kind == "join":
            return self._join()
        if kind == "leave":
            joiners = [p for p in self.peers[self.n:] if p.proc.poll() is None]
            if joiners:
                joiners[-1].proc.send_signal(signal.SIGTERM)
                self._note(kind, joiners[-1])
            return None
        victim = self._peer("peer1" if kind == "kill" or self.n < 3 else "peer2")
        if victim is None or victim.proc.poll() is not None or victim.name in self.stopping:
            return None
        level = {"event": kind, "peer": victim.name, "at_s": time.monotonic() - self.t0,
                 "before": self._counts(victim)}
        if kind == "kill":
            victim.kill_tree()
            victim.restart_at = time.monotonic() + RESTART_DELAY_S
        else:
            victim.proc.send_signal(signal.SIGTERM)
            self.stopping[victim.name] = time.monotonic()
        self.levels.append(level)
        self.awaiting[victim.name] = level
        self._note(kind, victim)
        return None

    def _join(self) -> None:
        i = len(self.peers)
        pdir = self.run_dir / "peers" / f"peer{i}"
        pdir.mkdir(parents=True, exist_ok=True)
        cmd = peer_command(i, i + 1, self.cfg, self.maddr, pdir, None, [*self.sets, "startup.wait_for_peers=1"],
                           1.0, self.run_dir / "started")
        peer = PeerProc(f"peer{i}", pdir, None, (pdir / "peer.log").open("a"), cmd=cmd,
                        env={**os.environ, "PYTHONUNBUFFERED": "1"}, prefork=self.prefork)
        peer.start()
        self.peers.append(peer)
        self._note("join", peer)

    def _restarts(self, now: float) -> None:
        """Start again the killed peers whose delay is over and the stopped ones that have exited."""
        for p in self.peers:
            stopped = p.name in self.stopping and p.proc.poll() is not None
            if stopped or (p.restart_at is not None and now >= p.restart_at):
                self.stopping.pop(p.name, None)
                p.restart_at = None
                p.poll_metrics()  # the old incarnation's last lines, so that only a new merge line sets group_id
                p.last.pop("group_id", None)
                p.start(resume=True)
                if p.name in self.awaiting:
                    self.awaiting[p.name]["restarted_at_s"] = now - self.t0
                self._note("restart", p)
            elif p.name in self.stopping and now - self.stopping[p.name] > STOP_GRACE_S:
                p.proc.kill()

    def _unscheduled_exits(self) -> None:
        """Note, once, every peer that ended without the schedule stopping it (it crashed, or something outside the
        bench killed it): it is not restarted, and its model is not one of those that should agree at the end."""
        gone = {e["peer"] for e in self.events if e["event"] in ("leave", "exit")}
        for p in self.peers:
            if (p.name not in gone and p.name not in self.stopping and p.restart_at is None
                    and p.proc.poll() is not None):
                logger.warning("soak: %s exited outside the schedule (exit status %s)", p.name, p.proc.poll())
                self._note("exit", p)
                self.events[-1]["returncode"] = p.proc.poll()

    def _levels_after(self) -> None:
        """Read the counts of restarted peers once they have merged in a group again."""
        for name, level in list(self.awaiting.items()):
            p = self._peer(name)
            if "restarted_at_s" in level and p.last.get("group_id") and p.last.get("group_size", 1) > 1:
                level["after"] = self._counts(p)
                level["after_at_s"] = time.monotonic() - self.t0
                keys = set(level["before"]) | set(level["after"])
                level["growth"] = {k: level["after"].get(k, 0) - level["before"].get(k, 0) for k in sorted(keys)}
                del self.awaiting[name]

    def _counts(self, p: PeerProc) -> dict[str, int]:
        tree = sample_tree(p.proc.pid)
        self.ours.update(daemon_ids(tree))
        return {**tree_counts(tree), "sockets_ours_stale": socket_census(self.ours)["ours_stale"]}

    def _note(self, kind: str, p: PeerProc) -> None:
        logger.info("soak: %s %s", kind, p.name)
        self.events.append({"event": kind, "peer": p.name, "at_s": time.monotonic() - self.t0})

    def _sample(self) -> None:
        trees = {p.name: sample_tree(p.proc.pid) for p in self.peers
                 if p.proc.poll() is None and p.restart_at is None and p.name not in self.stopping}
        trees["observer"] = sample_tree(self.observer.pid)
        trees["dashboard"] = sample_tree(self.dashboard.pid)
        trees["status"] = sample_tree(self.status.pid)
        for tree in trees.values():
            self.ours.update(daemon_ids(tree))
        records = None
        with contextlib.suppress(Exception):  # a busy DHT process misses one sample, not the run
            records = self.observer.run_coroutine(dht_records, return_future=True).result(timeout=10)
        self.samples.append({
            "elapsed_s": time.monotonic() - self.t0, "t": time.time(), "trees": trees,
            "sockets": socket_census(self.ours), "run_bytes": folder_bytes(self.run_dir), "dht_records": records,
            "shm": len(os.listdir("/dev/shm")),
        })


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def bench_soak(out: Path, minutes: float = 60.0, peers: int = 4, event_s: float | None = None,
               sample_s: float | None = None, console: Console | None = None) -> dict:
    """Run a soak of `minutes` with `peers` peers, write soak.json and one plot per figure into `out`, print the
    figures beside their limits and return them.

    Args:
        out: output folder.
        minutes: length of the run.
        peers: peers at the start (at least 2; peer0 is never disturbed).
        event_s: seconds between events (default a twelfth of the run).
        sample_s: seconds between samples (default 30, less in runs under 12 minutes).
        console: where the figures are printed.
    """
    console = console or Console(soft_wrap=True, width=max(Console().width, 150))  # the table's columns whole
    out.mkdir(parents=True, exist_ok=True)
    schedule = Schedule.for_minutes(minutes, event_s, sample_s)
    sets = [*BENCH_MODEL_SETS, *SOAK_SETS, "swarm.run_id=bench-soak"]
    console.print(f"soak: {peers} peers for {minutes:g} min, warm-up {schedule.warmup_s:.0f} s, an event every "
                  f"{schedule.event_s:.0f} s, a sample every {schedule.sample_s:.0f} s; load {os.getloadavg()[0]:.2f}")
    raw = Soak(out, peers, schedule, sets).run()
    results = {"machine": machine(), "minutes": minutes, "peers": peers, "schedule": schedule.__dict__,
               "sets": sets, **analyse(raw, schedule.warmup_s, out / "run"), **raw}
    path = write_results(out, "soak", results)
    plots = plot_soak(results, out)
    print_soak(results, console)
    console.print(f"wrote {path}; plots: {', '.join(str(p) for p in plots)}")
    return results
