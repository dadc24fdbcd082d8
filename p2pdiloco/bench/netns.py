"""Network namespaces for the benches that emulate links (slowlink, wan): create, shape, clean up.

Every name a bench creates starts with its prefix and the pid of the process that created it
(`p2pdsl12345-hub`), so that the leftovers of a run that died without cleaning up (SIGKILL, a crash of the
machine's power aside) are found at the next start and removed, and those of a run still alive are not. Nothing
here touches the host's own namespace: commands run through `ip -n NS` or `ip netns exec NS`.
"""

from __future__ import annotations

import logging
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from p2pdiloco.config import ConfigError

logger = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 30.0
"""How long one `ip`, `tc` or `iptables` command may take before it counts as failed."""


class NamespacesUnavailable(ConfigError):
    """This machine or user cannot create the namespaces, rate limits or filters a bench needs."""


def check_can_run(what: str, tools: tuple[str, ...] = ("ip", "tc")) -> None:
    """Raise NamespacesUnavailable, saying what is missing, unless we are root on Linux with `tools` on PATH.

    Args:
        what: the command that needs them, for the message (e.g. "bench slowlink").
        tools: programs that must be on PATH (iproute2's ip and tc, iptables).
    """
    if not sys.platform.startswith("linux"):
        raise NamespacesUnavailable(f"{what} needs Linux network namespaces (ip netns)")
    if os.geteuid() != 0:
        raise NamespacesUnavailable(
            f"{what} must run as root: it creates network namespaces, veth pairs and tc rate limits "
            f"(only inside its own namespaces); try: sudo $(which p2pdiloco) {what}")
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        package = {"ip": "iproute2's", "tc": "iproute2's", "iptables": "the iptables package's"}
        names = " and ".join(f"{package.get(t, '')} {t}".strip() for t in missing)
        raise NamespacesUnavailable(f"{what} needs {names} on PATH")


def sh(*cmd: str) -> str:
    """Run one command; its stdout, or RuntimeError with its stderr if it fails or takes over 30 s."""
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")
    return done.stdout


def namespaces() -> list[str]:
    """The names of the machine's named network namespaces (`ip netns list`)."""
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def exec_in(ns: str) -> list[str]:
    """Command prefix that runs a program inside namespace `ns` (it execs: the pid is the program's)."""
    return ["ip", "netns", "exec", ns]


def add_namespace(name: str) -> None:
    """Create namespace `name` with its loopback up (p2pd and the DHT also talk over loopback)."""
    sh("ip", "netns", "add", name)
    sh("ip", "-n", name, "link", "set", "lo", "up")


def add_bridge(ns: str, cidr: str) -> None:
    """Create bridge br0 in `ns` with address `cidr` (e.g. 10.77.0.1/24), up: the hub that veths attach to."""
    sh("ip", "-n", ns, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", ns, "addr", "add", cidr, "dev", "br0")
    sh("ip", "-n", ns, "link", "set", "br0", "up")


def delete_namespace(name: str) -> bool:
    """Delete namespace `name` (its interfaces and their qdiscs go with it); False, logged, if that failed."""
    done = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if done.returncode != 0:
        logger.error("could not delete network namespace %s: %s", name, done.stderr.strip())
    return done.returncode == 0


def tbf(ns: str, dev: str, rate_mbit: float, burst: str = "32kb") -> None:
    """Limit what leaves `dev` in `ns` to `rate_mbit` Mbit/s with a token bucket.

    Args:
        ns: the namespace of the interface.
        dev: the interface.
        rate_mbit: the rate, Mbit/s.
        burst: the bucket, in tc's units: a few full-size packets, and it must exceed rate ÷ the kernel's timer
            frequency. The queue is bounded by 100 ms of latency, like a modem's buffer.
    """
    sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
       "rate", f"{rate_mbit:g}mbit", "burst", burst, "latency", "100ms")


def wait_ready(proc: subprocess.Popen, timeout_s: float, what: str) -> None:
    """Wait until a child started with text pipes prints `ready` as its first line.

    Args:
        proc: the child, with stdout and stderr pipes in text mode.
        timeout_s: how long it may take, seconds.
        what: the child, for the message.

    Raises:
        RuntimeError: it printed something else, exited or said nothing in time (the caller still stops it;
            the message has the end of its stderr if it exited).
    """
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline().strip() if ready else ""
    if line != "ready":
        err = proc.stderr.read().strip()[-500:] if proc.poll() is not None else ""
        raise RuntimeError(f"{what} did not start in {timeout_s:g} s: {err or line or 'no output'}")


class Namespaces:
    """The namespaces a bench builds, deleted together: a context manager around a subclass's `_create`.

    Whatever `_create` made before it failed is deleted too (namespaces are recorded before they are made);
    `close` stops, by pid, any process still running inside one (logged: its owner should have stopped it),
    then deletes them all, the last made first. Deleting a namespace deletes its interfaces, their qdiscs and
    its iptables with it.
    """

    def __init__(self) -> None:
        self.created: list[str] = []

    def __enter__(self):
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        raise NotImplementedError

    def _netns(self, name: str) -> None:
        self.created.append(name)  # first: a namespace half made is deleted too
        add_namespace(name)

    def close(self) -> None:
        """Stop what still runs in the namespaces, then delete every one this object created."""
        for ns in reversed(self.created):
            left = pids_in(ns)
            if left:
                logger.warning("stopping processes still running in %s: %s", ns, left)
                kill_pids(left)
            delete_namespace(ns)
        self.created.clear()


def creator_pid(ns: str, prefix: str) -> int | None:
    """The pid in a namespace name `<prefix><pid>...`, or None if the name is not one of `prefix`'s."""
    found = re.match(rf"{re.escape(prefix)}(\d+)", ns)
    return int(found.group(1)) if found else None


def pids_in(ns: str) -> list[int]:
    """The processes running inside namespace `ns` (`ip netns pids`)."""
    done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def kill_pids(pids: list[int], grace_s: float = 3.0) -> None:
    """SIGTERM each pid, wait up to `grace_s` for them to go, then SIGKILL the rest."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if running(pid)]
        if alive:
            time.sleep(0.05)  # polling for the processes to exit, with a deadline
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (a zombie is dead; its parent has not reaped it yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def remove_stale_namespaces(prefix: str) -> list[str]:
    """Delete the namespaces named `<prefix><pid>...` whose creating process is gone, and what runs in them.

    A run killed with SIGKILL leaves its namespaces behind, and with them any process it started inside (a delay
    daemon, a peer): those are stopped by pid, then the namespace is deleted. Namespaces of a live creator,
    this process's own, and every other name are left alone.

    Args:
        prefix: the bench's namespace prefix (e.g. "p2pdsl").

    Returns:
        The names deleted.
    """
    removed = []
    for ns in namespaces():
        pid = creator_pid(ns, prefix)
        if pid is None or pid == os.getpid() or Path(f"/proc/{pid}").exists():
            continue
        kill_pids(pids_in(ns))
        if delete_namespace(ns):
            removed.append(ns)
    return removed
