"""The Unix socket files hivemind's p2p daemons leave in the temporary folder, and which of them are stale.

Every hivemind P2P instance binds two Unix sockets, `/tmp/hivemind-p2pd-UID.sock` (the daemon's control socket)
and `/tmp/hivemind-p2pclient-UID.sock` (the Python side's callback socket), and removes both when it shuts down
cleanly. A daemon or DHT process that is SIGKILLed (a peer killed, the OOM killer, a crash) leaves them behind,
and the folder fills up over days of restarts.

A socket file is stale when no socket in any network namespace of this machine is bound to its path any more:
the kernel lists every bound Unix socket with its path in /proc/PID/net/unix (one table per network namespace;
the WAN lab's peers bind theirs inside namespaces of their own). Only files of this user, older than a grace
period, whose path no table lists are removed, so another live run's sockets are never touched.

Python's multiprocessing leaves a second kind: a process that hands a connection or file descriptor to another
(hivemind's DHT process does, for each of its pipes' replies) serves it from a `listener-*` socket in a
`pymp-*` folder of the temporary folder, removed at a clean exit only. Such a socket of this user that nobody has
bound is a dead process's, and is removed; the folder never is. A forked child (a DHT process) makes its listeners
in its parent's folder, which the parent goes on using: a live process's folder can hold only dead children's
listeners, and removing it made the parent's next fork fail to bind (a whole test run's worker, while peers
started beside it swept the temporary folder).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

SOCKET_DIR = Path("/tmp")
"""Where hivemind binds its sockets (its `P2P._UNIX_SOCKET_PREFIX` is fixed to /tmp, whatever TMPDIR says)."""
PATTERNS = ("hivemind-p2pd-*.sock", "hivemind-p2pclient-*.sock")
GRACE_S = 2.0
"""A file younger than this is never removed, whatever the tables say."""


def socket_files(folder: Path = SOCKET_DIR) -> list[Path]:
    """hivemind's daemon and client socket files in `folder`."""
    return sorted(p for pattern in PATTERNS for p in folder.glob(pattern))


def bound_paths() -> set[str] | None:
    """The paths of every bound Unix socket in every network namespace this user can see processes of; None if
    the tables cannot be read (not Linux): then nothing can be proven stale."""
    table = bound_sockets()
    return None if table is None else set(table.values())


def bound_sockets() -> dict[int, str] | None:
    """{inode: path} of every bound Unix socket in every network namespace this user can see processes of (a
    process's /proc/PID/fd links name the inodes of its sockets); None if the tables cannot be read."""
    seen_ns: set[str] = set()
    paths: dict[int, str] = {}
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for pid in ["self", *pids]:
        try:
            ns = os.readlink(f"/proc/{pid}/ns/net")
        except OSError:  # gone, or another user's process: its sockets are in files we may not remove anyway
            continue
        if ns in seen_ns:
            continue
        try:
            with open(f"/proc/{pid}/net/unix") as f:
                next(f, None)  # the header
                for line in f:
                    fields = line.split(maxsplit=7)
                    if len(fields) == 8:
                        paths[int(fields[6])] = fields[7].strip()
        except OSError:
            continue
        seen_ns.add(ns)
    return paths if seen_ns else None


def stale_socket_files(folder: Path = SOCKET_DIR, grace_s: float = GRACE_S) -> list[Path]:
    """This user's hivemind socket files in `folder` that no process has bound, older than `grace_s`."""
    files = socket_files(folder)  # listed before the tables are read: a file bound then is in them
    bound = bound_paths()
    if bound is None:
        return []
    now, uid, stale = time.time(), os.getuid(), []
    for path in files:
        with contextlib.suppress(OSError):
            st = path.lstat()
            if st.st_uid == uid and now - st.st_mtime >= grace_s and str(path) not in bound:
                stale.append(path)
    return stale


def stale_listeners(folder: Path | None = None, grace_s: float = GRACE_S) -> list[Path]:
    """This user's multiprocessing `listener-*` sockets in the `pymp-*` folders of `folder` (default: the temporary
    folder), older than `grace_s`, that nobody has bound."""
    now, uid, listed = time.time(), os.getuid(), []
    for path in sorted(Path(folder or tempfile.gettempdir()).glob("pymp-*/listener-*")):
        with contextlib.suppress(OSError):  # listed before the tables are read: a socket bound then is in them
            st = path.lstat()
            if st.st_uid == uid and stat.S_ISSOCK(st.st_mode) and now - st.st_mtime >= grace_s:
                listed.append(path)
    bound = bound_paths()
    if bound is None:
        return []
    return [path for path in listed if str(path) not in bound]


def remove_stale_sockets(folder: Path = SOCKET_DIR, grace_s: float = GRACE_S) -> int:
    """Remove the socket files `stale_socket_files` finds, and the listeners `stale_listeners` finds in the
    temporary folder; returns how many were removed."""
    removed = 0
    for path in stale_socket_files(folder, grace_s):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
    listeners = 0
    for path in stale_listeners(None if folder == SOCKET_DIR else folder, grace_s):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            listeners += 1
    if removed or listeners:
        logger.info("removed %d socket file(s) of dead p2p daemons and %d of dead processes' multiprocessing "
                    "listeners", removed, listeners)
    return removed + listeners


def daemon_sockets(cmdline: list[str]) -> list[str]:
    """The socket files of one p2pd daemon from its command line (`-listen=/unix/PATH`): its control socket
    and its client's, which hivemind names with the same random id."""
    for arg in cmdline:
        if arg.startswith("-listen=/unix/") and "hivemind-p2pd-" in arg:
            path = arg[len("-listen=/unix"):]
            return [path, path.replace("hivemind-p2pd-", "hivemind-p2pclient-")]
    return []
