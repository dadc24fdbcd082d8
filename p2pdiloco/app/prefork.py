"""Peer processes forked from one that has already imported what a peer needs (`p2pdiloco local`).

A fresh interpreter spends most of a peer's start-up importing torch, hivemind and p2pdiloco (most of a restart
in `bench churn`, docs/benchmarks.md, Churn), and the README's four peers pay it four times at once on two cores.
`p2pdiloco local` instead starts multiprocessing's fork server once per run: a fresh process that imports what a
peer needs (app/forkbase.py, which says why forking after it is safe) and forks each peer from itself, so a peer
begins with its imports done and shares their pages with the others. Linux only (macOS's frameworks are not
fork-safe); elsewhere, or with P2PDILOCO_PREFORK=0, peers start as fresh interpreters (`python -m p2pdiloco
peer`). A volunteer's `p2pdiloco peer` is always a fresh interpreter and pays its imports.

A forked peer is the same program as `p2pdiloco peer ARGS`: its stdout and stderr go to its log, its stdin is
/dev/null, its environment is the one given. Its `start` line counts its start-up from the moment `local` asked
for it, so the first peers' wait on the server's imports is theirs (app/startup.process_started_monotonic).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import forkserver, spawn, util
from pathlib import Path

from p2pdiloco.app.startup import REQUESTED_AT

logger = logging.getLogger(__name__)

PRELOAD = ("p2pdiloco.app.forkbase", "p2pdiloco.cli")
"""What the fork server imports, in order, before it forks anything (see app/forkbase.py)."""


def enabled() -> bool:
    """Whether `local` forks its peers (Linux, and not turned off with P2PDILOCO_PREFORK=0)."""
    return sys.platform == "linux" and os.environ.get("P2PDILOCO_PREFORK", "1") != "0"


def _peer_main(argv: list[str], log_path: str, env: dict[str, str]) -> None:
    """The forked child: `python -m p2pdiloco ARGV` with its output in `log_path` (appended to)."""
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(devnull)
    for stream in (sys.stdout, sys.stderr):  # the server's streams, now on the log: line by line, as a pipe's would not be
        stream.reconfigure(line_buffering=True, write_through=True)
    try:  # ps and top show `python -m p2pdiloco peer ...`, as for a fresh interpreter, not the server's command
        from setproctitle import setproctitle

        setproctitle(" ".join([sys.executable, "-m", "p2pdiloco", *argv]))  # before the environment changes: it
    except ImportError:  # finds the room for the title from the C environment's place in memory
        pass
    os.environ.clear()
    os.environ.update(env)
    root = logging.getLogger()  # what an import in the server added, so that `setup_logging` applies as in a fresh process
    for handler in root.handlers[:]:
        root.removeHandler(handler)
    sys.argv = ["p2pdiloco", *argv]
    try:  # `python -m p2pdiloco ARGV` (the program by its name, as a fresh interpreter runs it): ends in SystemExit
        runpy.run_module("p2pdiloco", run_name="__main__", alter_sys=True)
    finally:
        atexit._run_exitfuncs()  # multiprocessing ends a child with os._exit: flush the logs, as an interpreter's exit does


_MAIN_KEYS = ("init_main_from_path", "init_main_from_name")
_main_lock = threading.Lock()


@contextlib.contextmanager
def _callers_main_not_imported():
    """Within it, processes of the fork server do not import the caller's main module.

    multiprocessing has the server and each child it forks import the parent's `__main__` (as `__mp_main__`), for
    targets defined there. Ours is `_peer_main`, in this module, so they need none of it; and a script that calls
    `run_local` at top level, without `if __name__ == "__main__":`, would run again in the server, where
    multiprocessing stops it with its "bootstrapping phase" error and no peer starts.
    """
    with _main_lock:
        original = spawn.get_preparation_data

        def without_main(name: str) -> dict:
            data = original(name)
            for key in _MAIN_KEYS:
                data.pop(key, None)
            return data

        spawn.get_preparation_data = without_main
        try:
            yield
        finally:
            spawn.get_preparation_data = original


class ForkedPeer:
    """A forked peer, with the part of `subprocess.Popen`'s interface that `local` uses."""

    def __init__(self, process: multiprocessing.process.BaseProcess):
        self._process = process
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"peer {self.pid}", timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Prefork:
    """The fork server of one `local` run (or of `bench churn`'s data-parallel baseline, whose restarted ranks
    get the same head start): started (and importing) on construction, stopped by `close`.

    Args:
        preload: the modules it imports before forking anything.
    """

    def __init__(self, preload: tuple[str, ...] = PRELOAD):
        self.context = multiprocessing.get_context("forkserver")
        """Its multiprocessing context: `context.Process` is forked from the server."""
        self.context.set_forkserver_preload(list(preload))
        with _callers_main_not_imported():
            forkserver.ensure_running()  # it imports now, beside whatever the caller does next

    def start(self, argv: list[str], log: Path, env: dict[str, str], asked_at: float | None = None) -> ForkedPeer:
        """Fork `p2pdiloco ARGV` (waits for the server's imports on the first call); its start-up counts from
        `asked_at` (Unix time; default now), not from the fork."""
        env = {**env, REQUESTED_AT: repr(time.time() if asked_at is None else asked_at)}
        process = self.context.Process(target=_peer_main, args=(list(argv), str(log), env), name="p2pdiloco-peer")
        with _callers_main_not_imported():
            process.start()
        return ForkedPeer(process)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the server (peers it forked run on); a later `Prefork` starts a new one.

        The server stops when the write end of its "alive" pipe is closed everywhere, and any process forked from
        the caller after the server started holds a copy (the bootstrap node's DHT process does): so it is asked,
        given `timeout`, then killed. CPython's own `ForkServer._stop` would wait for it without end.
        """
        server = forkserver._forkserver
        with server._lock:
            pid = server._forkserver_pid
            if pid is None:
                return
            os.close(server._forkserver_alive_fd)
            deadline = time.monotonic() + timeout
            while os.waitpid(pid, os.WNOHANG) == (0, 0):
                if time.monotonic() > deadline:
                    logger.warning("the fork server did not stop in %.0f s; killing it", timeout)
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.05)  # a poll of a process's exit, bounded by the deadline above
            address = server._forkserver_address
            server._forkserver_alive_fd = server._forkserver_pid = server._forkserver_address = None
            if address and not util.is_abstract_socket_namespace(address):
                with contextlib.suppress(OSError):
                    os.unlink(address)
