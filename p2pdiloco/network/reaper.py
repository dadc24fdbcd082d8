"""A tiny watchdog that ends a peer's helper processes (its DHT process and p2p daemon) when the peer dies.

hivemind's DHT runs in a child process that starts the p2pd daemon; neither exits when the peer process
is killed (SIGKILL, OOM killer, a crash), so a dead peer would leave them running and its id reachable.
The peer starts this watchdog with a pipe on its stdin and never writes to it: when the peer dies, for
any reason, the pipe closes, and the watchdog SIGKILLs the processes it was given, removes the socket files
of the p2p daemon it killed (hivemind removes them only on a clean shutdown), then exits.

Usage: python -m p2pdiloco.network.reaper PID:CREATE_TIME [PID:CREATE_TIME ...] [/SOCKET/PATH ...]
"""

from __future__ import annotations

import os
import signal
import sys


def _same_process(pid: int, create_time: float) -> bool:
    """Guard against PID reuse: only a process with the recorded start time is ours."""
    try:
        import psutil

        return abs(psutil.Process(pid).create_time() - create_time) < 0.01
    except Exception:
        return False


def main(argv: list[str]) -> int:
    targets, sockets = [], []
    for item in argv:
        if item.startswith("/"):  # a socket file of the daemon: named by a random id of that daemon alone
            sockets.append(item)
            continue
        pid, _, created = item.partition(":")
        targets.append((int(pid), float(created)))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl+C to the group is for the peer, not for us
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except OSError:
        pass
    for pid, created in targets:
        if _same_process(pid, created):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for path in sockets:  # its daemon is dead now (killed above, or it shut down and removed them itself)
        try:
            os.unlink(path)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
