"""`p2pdiloco local`: a bootstrap node and N peer processes on 127.0.0.1, with live progress."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from rich.console import Console
from rich.live import Live
from rich.table import Table

from p2pdiloco.app.prefork import ForkedPeer, Prefork, enabled
from p2pdiloco.app.startup import STAGES, stage_of
from p2pdiloco.app.summary import summarize
from p2pdiloco.config import Config, SwarmConfig
from p2pdiloco.network.reachability import serving_reach
from p2pdiloco.network.swarm import Reaper, start_dht, visible_maddrs
from p2pdiloco.util.logfiles import read_from

logger = logging.getLogger(__name__)

STOP_GRACE_S = 20.0
"""How long peers get to exit after SIGTERM before they are killed."""


@dataclass
class PeerProc:
    """One peer child process and what we have read of its metrics so far."""

    name: str
    run_dir: Path
    proc: subprocess.Popen | ForkedPeer
    log: object
    offset: int = 0
    last: dict = field(default_factory=dict)
    eval_loss: float | None = None
    descendants: set[int] = field(default_factory=set)
    cmd: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    kills: int = 0
    restart_at: float | None = None
    """While killed by chaos: when to start it again."""
    stage: str = "starting"
    """How far its start-up has come, as its log's progress lines say (app/startup.STAGES); "training" after."""
    log_offset: int = 0
    prefork: Prefork | None = None
    """Where it is forked from, None: started as a fresh interpreter (`cmd`)."""

    def start(self, resume: bool = False, asked_at: float | None = None) -> None:
        """Start it (`asked_at`: when `local` began to start it, Unix time; default now)."""
        cmd = self.cmd + (["--resume"] if resume else [])
        self.stage = "starting"
        if self.prefork is not None:  # cmd is `python -m p2pdiloco ARGS`
            self.proc = self.prefork.start(cmd[3:], self.run_dir / "peer.log", self.env, asked_at)
        else:
            self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env)

    def kill_tree(self) -> None:
        """SIGKILL the peer and everything it started, as a machine that loses power would vanish."""
        self.remember_descendants()
        victims = [self.proc.pid, *self.descendants]
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        psutil.wait_procs([p for p in map(_process, self.descendants) if p is not None], timeout=5)
        self.descendants.clear()
        self.kills += 1

    def poll_metrics(self) -> None:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return
        self.offset = read_from(path, self.offset)  # from the start of a new file after a rotation
        with path.open() as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]  # a line being written is read next time
        self.offset += len(complete.encode())
        for line in complete.splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.last.update({k: v for k, v in row.items() if k != "kind"})
            if row.get("eval_loss") is not None:
                self.eval_loss = row["eval_loss"]

    def poll_log(self) -> None:
        """Read the new lines of its log (`run_dir/peer.log`) for its start-up stage; none once it trains."""
        path = self.run_dir / "peer.log"
        if self.stage == "training" or not path.exists():
            self.log_offset = path.stat().st_size if path.exists() else 0  # a restart's lines are read from here on
            return
        self.log_offset = read_from(path, self.log_offset)  # from the start after the peer's cap emptied it
        with path.open("rb") as f:
            f.seek(self.log_offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.log_offset += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            self.stage = stage_of(line) or self.stage

    def remember_descendants(self) -> None:
        """Note the DHT and p2pd processes this peer started, to reap them if the peer dies without doing so."""
        try:
            self.descendants |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.Error:
            pass


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


@dataclass
class Chaos:
    """Kill a random running peer every `kill_every` seconds and restart it `restart_delay` seconds later
    with --resume (`p2pdiloco local --chaos`)."""

    kill_every: float
    restart_delay: float = 5.0
    seed: int = 0
    log: Path | None = None

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._next = time.monotonic() + self.kill_every

    def tick(self, peers: list[PeerProc]) -> None:
        now = time.monotonic()
        for p in peers:
            if p.restart_at is not None and now >= p.restart_at:
                p.restart_at = None
                p.start(resume=True)
                self._event("restart", p)
        if now < self._next:
            return
        self._next = now + self.kill_every
        running = [p for p in peers if p.restart_at is None and p.proc.poll() is None]
        if len(running) < 2:  # never kill the last peer standing: nobody would hold the model
            return
        victim = self._rng.choice(running)
        victim.kill_tree()
        victim.restart_at = now + self.restart_delay
        self._event("kill", victim)

    def _event(self, kind: str, p: PeerProc) -> None:
        logger.info("chaos: %s %s", kind, p.name)
        if self.log is not None:
            with self.log.open("a") as f:
                f.write(json.dumps({"t": time.time(), "event": kind, "peer": p.name}) + "\n")


def peer_command(i: int, n: int, cfg: Config, initial_peer: str, run_dir: Path, config_path: str | None,
                 sets: list[str], slow_factor: float = 1.0, start_barrier: Path | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "p2pdiloco", "peer", "--initial-peers", initial_peer, "--host", "127.0.0.1",
           "--run-dir", str(run_dir), "--name", f"peer{i}", "--in-local",
           "--set", f"data.shard={i}/{n}", "--set", f"run.seed={i}", "--set", f"run.total_steps={cfg.run.total_steps}",
           "--set", f"swarm.run_id={cfg.swarm.run_id}"]
    if cfg.startup.wait_for_peers == 0:
        cmd += ["--set", f"startup.wait_for_peers={n}"]  # start together, so the first rounds merge as a group
    if start_barrier is not None:  # peers that see themselves in the census say so there (together.wait_for_peers)
        cmd += ["--start-barrier", str(start_barrier)]
    if cfg.run.threads == 0:
        cmd += ["--set", "run.threads=1"]  # N peers on a few cores: one thread each avoids oversubscription
    if config_path:
        cmd += ["--config", config_path]
    for s in sets:
        cmd += ["--set", s]
    if slow_factor != 1.0:
        cmd += ["--set", f"emulate.slow_factor={slow_factor}"]
    if cfg.run.metrics_port:  # one port each: peer i serves on metrics_port + i
        cmd += ["--set", f"run.metrics_port={cfg.run.metrics_port + i}"]
    return cmd


def progress_table(peers: list[PeerProc], total_steps: int, started: float) -> Table:
    table = Table(title=f"p2pdiloco local — {time.monotonic() - started:.0f} s")
    for col in ("peer", "step", "round", "train loss", "eval loss", "merges", "group", "tok/s", "state"):
        table.add_column(col, justify="right" if col != "peer" else "left", no_wrap=True)
    for p in peers:
        r = p.last
        rc = p.proc.poll()
        state = p.stage if rc is None else ("done" if rc == 0 else f"exit {rc}")
        table.add_row(
            p.name, f"{r.get('step', 0)}/{total_steps}", str(r.get("round", 0)),
            f"{r['loss']:.3f}" if isinstance(r.get("loss"), float) else "-",
            f"{p.eval_loss:.3f}" if p.eval_loss is not None else "-", str(r.get("merges", 0)),
            str(r.get("group_size", "-")), f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else "-", state,
        )
    return table


class StartupLines:
    """The line `local` prints while peers start, e.g. "peers starting: 1/4 loading, 2/4 DHT up, 1/4 training":
    again each time it changes, until every peer trains ("peers started: 4/4 training"); a chaos restart starts it
    again. A peer that has exited counts at the stage it reached: in a short run peers can finish between two
    looks, before all of them were seen training at once."""

    def __init__(self) -> None:
        self.last = ""
        self.starting = False

    def update(self, peers: list[PeerProc]) -> str | None:
        """The line to print now, or None."""
        counts = Counter(p.stage for p in peers if p.proc is not None)
        starting = any(stage != "training" for stage in counts)
        order = ["starting", *dict.fromkeys(STAGES.values())]
        line = (f"peers {'starting' if starting else 'started'}: "
                + ", ".join(f"{counts[s]}/{len(peers)} {s}" for s in order if counts[s]))
        show = line != self.last and (starting or self.starting)  # the last line of a start-up says it ended
        self.starting = starting
        if show:
            self.last = line
        return line if show else None


def stop_peers(peers: list[PeerProc]) -> None:
    """SIGTERM every peer, wait, then SIGKILL what is left, including processes they started."""
    for p in peers:
        p.remember_descendants()
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in peers:
        try:
            p.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s did not exit in %.0f s; killing it", p.name, STOP_GRACE_S)
            p.proc.kill()
            p.proc.wait()
    reap_descendants(peers)


def reap_descendants(peers: list[PeerProc]) -> None:
    for p in peers:
        for pid in p.descendants:
            try:
                proc = psutil.Process(pid)
                proc.wait(timeout=3)
            except psutil.TimeoutExpired:
                proc.kill()
            except psutil.Error:
                pass
        p.log.close()


def run_local(n_peers: int, cfg: Config, run_dir: Path, config_path: str | None, sets: list[str],
              console: Console | None = None, slow: dict[int, float] | None = None,
              peer_sets: dict[int, list[str]] | None = None, chaos: Chaos | None = None,
              dashboard_port: int | None = None, reraise_interrupt: bool = False) -> dict:
    """Run a whole swarm on this machine and return the run's summary.

    Args:
        n_peers: peer processes to start.
        cfg: the config every peer uses (validated here, passed on as the same file and flags).
        run_dir: the run folder; peer i writes under `run_dir/peers/peer{i}`.
        config_path: the TOML file the peers should load, if any.
        sets: `section.key=value` overrides the peers should apply.
        console: where progress is drawn.
        reraise_interrupt: on Ctrl+C, stop and reap the peers and raise KeyboardInterrupt instead of returning a
            summary (a benchmark must not go on to its next run, nor write figures of a run cut short).
        slow: {peer index: factor} for peers that emulate a slower accelerator.
        peer_sets: extra overrides for single peers, {peer index: ["section.key=value", ...]}.
        chaos: kill and restart peers on a schedule.
        dashboard_port: serve the web dashboard on 127.0.0.1 at this port (0: any free one); None: no dashboard.
    """
    console = console or Console()
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    peers: list[PeerProc] = []
    # each part registers its close as it starts; they close in reverse: peers, dashboard, dial-back service,
    # DHT, reaper, fork server
    with contextlib.ExitStack() as closing:
        maddr, prefork = start_bootstrap(cfg, run_dir, console, dashboard_port, closing)
        closing.callback(stop_peers, peers)
        launch_peers(peers, n_peers, cfg, maddr, run_dir, config_path, sets, peer_sets or {}, slow or {}, prefork)
        console.print(f"{n_peers} peers started; logs in {run_dir}/peers/*/peer.log")
        interrupted = watch_peers(peers, cfg, started, console, chaos)
    if interrupted and reraise_interrupt:
        raise KeyboardInterrupt
    return report_run(peers, cfg, run_dir, started, console, chaos, interrupted)


def start_bootstrap(cfg: Config, run_dir: Path, console: Console, dashboard_port: int | None,
                    closing: contextlib.ExitStack) -> tuple[str, Prefork | None]:
    """Start the fork server, the run's bootstrap node and its dashboard, each closed by `closing`.

    Returns:
        The bootstrap node's multiaddr, and the fork server (None: peers start as fresh interpreters).
    """
    prefork = Prefork() if enabled() else None  # its imports run beside the bootstrap node's start
    if prefork is not None:  # after the DHT: its process, forked from this one, holds the server's alive pipe
        closing.callback(prefork.close)
    dht = start_dht(SwarmConfig(host="127.0.0.1", port=0, swarm_key=cfg.swarm.swarm_key))
    reaper = Reaper(dht)
    closing.callback(reaper.close)
    closing.callback(dht.shutdown)
    closing.enter_context(serving_reach(dht))  # as a bootstrap node does: peers ask it first
    maddr = visible_maddrs(dht)[0]
    (run_dir / "bootstrap.maddr").write_text(maddr + "\n")
    console.print(f"bootstrap node at {maddr}", soft_wrap=True)  # one line, so it can be copied
    if dashboard_port is not None:  # in this process: it reads the peers' records through the bootstrap node
        from p2pdiloco.observe.dashboard import BackgroundDashboard

        dashboard = BackgroundDashboard(dht, cfg.swarm.run_id, "127.0.0.1", dashboard_port)
        closing.callback(dashboard.close)
        console.print(f"dashboard at {dashboard.url}")
    return maddr, prefork


def launch_peers(peers: list[PeerProc], n_peers: int, cfg: Config, maddr: str, run_dir: Path,
                 config_path: str | None, sets: list[str], peer_sets: dict[int, list[str]], slow: dict[int, float],
                 prefork: Prefork | None) -> None:
    """Start the peers, each appended to `peers` as it starts (so that a failure stops those already running)."""
    barrier = run_dir / "started"  # peers waiting for each other list it, not the census (together.wait_for_peers)
    shutil.rmtree(barrier, ignore_errors=True)
    barrier.mkdir()
    launched = time.time()  # the first fork waits on the fork server's imports, and the others on it
    for i in range(n_peers):
        pdir = run_dir / "peers" / f"peer{i}"
        pdir.mkdir(parents=True, exist_ok=True)
        for stale in [*(pdir / "checkpoints").glob("ckpt-*"), *(pdir / s for s in ("metrics.jsonl", "metrics.jsonl.1",
                      "peer.log", "peer.log.1", "peer_summary.json"))]:  # a restart must not resume an old run
            stale.unlink(missing_ok=True)
        log = (pdir / "peer.log").open("a")  # appended to, so that the peer can cap it (util/logfiles.cap_output)
        cmd = peer_command(i, n_peers, cfg, maddr, pdir, config_path, sets + peer_sets.get(i, []),
                           slow.get(i, 1.0), barrier)
        peer = PeerProc(f"peer{i}", pdir, None, log, cmd=cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                        prefork=prefork)
        peer.start(asked_at=launched)
        peers.append(peer)


def watch_peers(peers: list[PeerProc], cfg: Config, started: float, console: Console, chaos: Chaos | None) -> bool:
    """Draw the peers' progress until all have ended (chaos kills and restarts them meanwhile); True if Ctrl+C
    cut the run short."""
    startup = StartupLines()
    try:
        with Live(progress_table(peers, cfg.run.total_steps, started), console=console, refresh_per_second=2) as live:
            while any(p.proc.poll() is None or p.restart_at is not None for p in peers):
                if chaos is not None:
                    chaos.tick(peers)
                for p in peers:
                    p.poll_metrics()
                    p.poll_log()
                    if p.proc.poll() is None:
                        p.remember_descendants()
                if (line := startup.update(peers)) is not None:
                    console.print(line, soft_wrap=True)
                live.update(progress_table(peers, cfg.run.total_steps, started))
                time.sleep(0.5)  # a display refresh, not a wait for a condition
            for p in peers:
                p.poll_metrics()
                p.poll_log()
            if (line := startup.update(peers)) is not None:  # peers that ended between two looks
                console.print(line, soft_wrap=True)
            live.update(progress_table(peers, cfg.run.total_steps, started))
    except KeyboardInterrupt:
        console.print("interrupted: stopping peers")
        return True
    return False


def report_run(peers: list[PeerProc], cfg: Config, run_dir: Path, started: float, console: Console,
               chaos: Chaos | None, interrupted: bool) -> dict:
    """Say which peers failed, write the run's summary and plots, and return the summary."""
    for p in peers:
        if p.proc.returncode not in (0, None) and not interrupted and p.restart_at is None:
            tail = (p.run_dir / "peer.log").read_text().strip().splitlines()[-1:] or ["(empty log)"]
            console.print(f"[red]{p.name} exited with {p.proc.returncode}[/red]: {tail[0]}")
    extra = {"chaos_kills": sum(p.kills for p in peers)} if chaos is not None else {}
    summary = summarize(run_dir, [p.run_dir for p in peers], cfg.to_dict(), time.monotonic() - started, extra)
    try:
        from p2pdiloco.observe.plot import plot_run

        for path in plot_run(run_dir):
            console.print(f"plot: {path}")
    except Exception as e:  # a plot must not lose the run's results
        logger.warning("plotting failed: %r", e)
    return summary
