"""Append-only log files capped by size, and reading them whole across their rotations.

A capped file `NAME` is written until it holds half its byte budget; then it is renamed `NAME.1` (replacing the
previous `NAME.1`) and a new `NAME` is started, so the two together never hold more than the budget and the
newest lines are always kept. Readers take `NAME.1` then `NAME`: `rotations` lists them, `read_jsonl` parses
them in that order.

A process whose output someone else redirected to a file (`local`'s peer.log) caps that file with `OutputCap`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import stat
import threading
from pathlib import Path

KEEP = 1
"""Rotated files kept beside the live one (`NAME.1`)."""


def rotations(path: Path) -> list[Path]:
    """The files of a capped log that exist, oldest first: `NAME.1`, then `NAME`."""
    older = [path.with_name(f"{path.name}.{i}") for i in range(KEEP, 0, -1)]
    return [p for p in [*older, path] if p.exists()]


def read_jsonl(path: Path) -> list[dict]:
    """Every JSON object line of a capped log, oldest first, across its rotations; a line that is not JSON (one
    being written, or torn by a crash) is skipped."""
    rows = []
    for p in rotations(path):
        with p.open(errors="replace") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(row, dict):
                    rows.append(row)
    return rows


def read_from(path: Path, offset: int) -> int:
    """Where a reader that has read `offset` bytes of a growing log goes on: there, or at 0 when the file is
    shorter (rotated or emptied since)."""
    return offset if path.stat().st_size >= offset else 0


def rotate(path: Path) -> None:
    """Move `NAME` to `NAME.1` (and each older one up, the oldest dropped)."""
    for i in range(KEEP, 0, -1):
        older = path.with_name(f"{path.name}.{i - 1}") if i > 1 else path
        if older.exists():
            os.replace(older, path.with_name(f"{path.name}.{i}"))


class CappedLog:
    """Lines appended to `path`, line-buffered (a crash loses at most the line being written), rotated so that
    the file and its rotations hold at most `max_bytes` together.

    Args:
        path: the live file; opened for appending (a resumed process goes on where it stopped).
        max_bytes: the budget of the file and its rotations together; 0 or less: no cap.
    """

    def __init__(self, path: Path, max_bytes: int):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.max_bytes = path, max_bytes
        self._file = path.open("a", buffering=1)
        self._size = self._file.tell()

    def write_line(self, line: str) -> None:
        if self.max_bytes > 0 and self._size > 0 and self._size + len(line) + 1 > self.max_bytes // (KEEP + 1):
            self._file.close()
            rotate(self.path)
            self._file, self._size = self.path.open("a", buffering=1), 0
        self._file.write(line + "\n")
        self._size += len(line.encode()) + 1

    def close(self) -> None:
        self._file.close()


def cap_output(max_bytes: int, fd: int = 2) -> bool:
    """Keep a log that this process's output is redirected to within `max_bytes`, as logrotate's copytruncate
    does: once the file behind `fd` holds more than half the budget, copy it to `NAME.1` and empty it. The writers
    (this process, and the DHT process and p2p daemon that inherited the descriptor) keep writing, at the new
    end: only a file opened for appending is capped, since one written at an offset would go on at that offset.
    A line written between the copy and the emptying is lost.

    Returns:
        Whether the file was rotated (False: under the budget, no budget, not a regular appended file, or not
        Linux, where the file's path is not known).
    """
    try:
        st = os.fstat(fd)
        if max_bytes <= 0 or not stat.S_ISREG(st.st_mode) or st.st_size <= max_bytes // (KEEP + 1):
            return False
        if not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND:
            return False
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        older = path.with_name(f"{path.name}.1")
        tmp = path.with_name(f".{path.name}.1.tmp")
        shutil.copyfile(path, tmp)
        os.replace(tmp, older)
        os.ftruncate(fd, 0)
    except OSError:
        return False
    return True


class OutputCap:
    """A thread that calls `cap_output` on stderr (and on stdout, when it is another file) every `every_s`.

    Args:
        max_bytes: the budget of each file and its rotation together; 0 or less: nothing is done.
        every_s: seconds between looks.
    """

    def __init__(self, max_bytes: int, every_s: float = 30.0):
        self.max_bytes, self.every_s = max_bytes, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="output-cap", daemon=True)
        if max_bytes > 0:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            cap_output(self.max_bytes, 2)
            with contextlib.suppress(OSError):
                if not os.path.samestat(os.fstat(1), os.fstat(2)):
                    cap_output(self.max_bytes, 1)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
