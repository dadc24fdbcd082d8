"""Stopping a child process: ask it with a signal, give it time to close, kill it if it does not."""

from __future__ import annotations

import signal
import subprocess


def stop_process(proc: subprocess.Popen, timeout: float, sig: int = signal.SIGTERM) -> int:
    """Send `sig` to `proc` if it still runs, wait up to `timeout` seconds for it to exit, then SIGKILL it.

    Args:
        proc: a child process of this one.
        timeout: seconds it has to exit after the signal.
        sig: the signal that asks it to stop (SIGTERM; SIGINT for a command that treats Ctrl+C as its stop).

    Returns:
        Its exit status (negative: the signal that ended it).
    """
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
