"""Peers forked from `local`'s fork server (app/prefork.py): the same program as `p2pdiloco ARGS` in a fresh
interpreter, with its log, exit code and signals; a server safe to fork from; a start-up counted from when
`local` asked; and a swarm whose peers are killed and restarted by `local --chaos` through it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from p2pdiloco.app.prefork import Prefork
from p2pdiloco.app.startup import REQUESTED_AT, process_started_monotonic
from tests.conftest import kill_quietly, wait_for
from tests.test_cli import TINY
from tests.test_startup import UNWANTED


def test_the_fork_servers_imports_start_no_python_thread_touch_no_accelerator_and_skip_what_a_peer_avoids():
    script = ("import json, sys, threading; import p2pdiloco.app.forkbase, p2pdiloco.cli; import torch; "
              f"print(json.dumps([threading.active_count(), torch.cuda.is_initialized(), "
              f"[m for m in {UNWANTED!r} if m in sys.modules], 'p2pdiloco.app.peer' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr[-2000:]
    threads, accelerator, unwanted, peer = json.loads(out.stdout.strip().splitlines()[-1])
    assert threads == 1 and accelerator is False and unwanted == [] and peer is True


def test_a_forked_command_has_its_log_exit_code_and_signals_and_the_server_stops(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    prefork = Prefork()
    server = None
    started = []
    try:
        bad = prefork.start(["peer", "--set", "no_such_section.key=1"], tmp_path / "bad.log", env)
        server = psutil.Process(bad.pid).parent()  # the fork server, not this process
        assert server.pid != os.getpid()
        assert bad.wait(timeout=60) == 2
        assert "error" in (tmp_path / "bad.log").read_text()

        log = tmp_path / "bootstrap.log"
        node = prefork.start(["bootstrap", "--host", "127.0.0.1", "--port", "0", "--identity",
                              str(tmp_path / "b.key")], log, env)
        started.append(node)
        wait_for(lambda: log.exists() and "running; Ctrl+C to stop" in log.read_text(), 60, what="the bootstrap node up")
        assert "/ip4/127.0.0.1/tcp/" in log.read_text()
        assert "-m p2pdiloco bootstrap --host 127.0.0.1" in " ".join(psutil.Process(node.pid).cmdline())  # for ps
        with pytest.raises(subprocess.TimeoutExpired):
            node.wait(timeout=0.1)
        children = psutil.Process(node.pid).children(recursive=True)
        assert children  # its DHT process and p2p daemon
        node.send_signal(signal.SIGTERM)
        assert node.wait(timeout=30) == 0
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive

        again = prefork.start(["bootstrap", "--host", "127.0.0.1", "--port", "0", "--identity",
                               str(tmp_path / "b.key")], tmp_path / "again.log", env)
        started.append(again)
        wait_for(lambda: psutil.Process(again.pid).children(), 60, what="the second node's DHT process")
        children = psutil.Process(again.pid).children(recursive=True)
        again.kill()
        assert again.wait(timeout=10) == -signal.SIGKILL
        kill_quietly(children)  # a SIGKILLed node leaves them to its reaper; do not wait on it here
    finally:
        for p in started:
            p.kill()
        prefork.close()
    assert server is not None and not server.is_running()


def test_a_start_up_counts_from_when_local_asked_for_the_peer(monkeypatch):
    now_wall, now_mono = time.time(), time.monotonic()
    monkeypatch.setenv(REQUESTED_AT, repr(now_wall - 5.0))
    assert process_started_monotonic(now_wall - 1.0) == pytest.approx(now_mono - 5.0, abs=0.5)
    monkeypatch.setenv(REQUESTED_AT, repr(now_wall + 60.0))  # asked after it started: not a forked peer's
    assert process_started_monotonic(now_wall - 1.0) == pytest.approx(now_mono - 1.0, abs=0.5)
    monkeypatch.setenv(REQUESTED_AT, "not a time")
    assert process_started_monotonic(now_wall - 1.0) == pytest.approx(now_mono - 1.0, abs=0.5)
    monkeypatch.delenv(REQUESTED_AT)
    assert process_started_monotonic(now_wall - 2.0) == pytest.approx(now_mono - 2.0, abs=0.5)


def test_a_script_without_a_main_guard_forks_peers_without_running_itself_again(tmp_path):
    # multiprocessing would have the fork server import the caller's script; unguarded, it runs again there
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import os, sys\n"
        "from p2pdiloco.app.prefork import Prefork\n"
        "print('script ran', flush=True)\n"
        "prefork = Prefork(preload=('p2pdiloco.cli',))\n"
        f"peer = prefork.start(['--version'], {str(tmp_path / 'peer.log')!r}, dict(os.environ))\n"
        "try:\n"
        "    print('exit', peer.wait(timeout=60), flush=True)\n"
        "finally:\n"
        "    peer.kill()\n"
        "    prefork.close()\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["script ran", "exit 0"]  # once, in this process only
    assert "p2pdiloco" in (tmp_path / "peer.log").read_text()  # the forked command's own output


@pytest.mark.integration
def test_local_chaos_kills_and_restarts_forked_peers_and_leaves_nothing_running(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "p2pdiloco", "local", "--peers", "2", "--steps", "300", "--run-dir", str(tmp_path),
         "--chaos", "--kill-every", "6", "--restart-delay", "1", "--set", "run.min_step_s=0.05",
         "--set", "run.checkpoint_every=20", "--set", "rounds.round_steps=20", *TINY],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    seen: dict[int, tuple[psutil.Process, str]] = {}  # pid -> (process, its command line while it ran)
    try:
        deadline = time.monotonic() + 150
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                for p in psutil.Process(proc.pid).children(recursive=True):
                    if p.pid not in seen:
                        seen[p.pid] = (p, " ".join(p.cmdline()))
            except psutil.Error:
                pass
            time.sleep(0.2)  # sampling the process tree while it runs, bounded by the deadline
        assert proc.poll() is not None, "local did not finish in 150 s"
        out = proc.stdout.read()
        assert proc.returncode == 0, out[-3000:]
        _, alive = psutil.wait_procs([p for p, _ in seen.values()], timeout=10)
        assert not alive, f"left running: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_quietly([p for p, _ in seen.values()])
    assert any("forkserver" in cmdline for _, cmdline in seen.values())  # the peers were forked from it
    assert any("-m p2pdiloco peer " in c and "--name peer0 " in c for _, c in seen.values())  # and say which peer
    events = [json.loads(line) for line in (tmp_path / "chaos.jsonl").read_text().splitlines()]
    restarts = [e for e in events if e["event"] == "restart"]
    assert restarts and any(e["event"] == "kill" for e in events)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["peers_finished"] == 2
    # the first restart is a new incarnation of its peer: a start line of its own, counted from the restart
    first = restarts[0]
    rows = [json.loads(line) for line in (tmp_path / "peers" / first["peer"] / "metrics.jsonl").read_text().splitlines()]
    starts = [r for r in rows if r["kind"] == "start"]
    later = [r for r in starts if r["t"] > first["t"]]
    assert len(starts) >= 2 and later
    assert later[0]["t"] - later[0]["process_s"] >= first["t"] - 1.0
