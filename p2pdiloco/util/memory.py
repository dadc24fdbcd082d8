"""A process's memory: freed memory handed back to the operating system, and a trace of what grows.

glibc's malloc keeps memory a program has freed for its next allocations instead of returning it: the top of each
arena up to a threshold that grows with the largest block freed (up to 64 MB), and every free page inside an
arena. A peer frees tens of MB at the end of each round (the round's pseudo-gradient, the merge's buffers), so its
resident memory swings by that much from round to round with where the freed blocks happen to lie, and creeps up
over its first tens of minutes as its arenas reach their high-water marks. `release_free_memory` hands it all back
(`malloc_trim(0)`), so that what a process holds between rounds is what it uses; `keep_releasing_memory` does it
every minute in a process that has no rounds (a DHT process).

CPython keeps one table of interned strings, sized by how many it holds, and msgpack interns every string key of
every map it decodes: a DHT process interns each record field name that its own code does not hold, and drops it
with the record. Each such insertion takes a slot of the table until it is rebuilt; the first rebuild after the
process started sizes it for the strings it holds (torch's and hivemind's names: 2**18 slots, one block of 3.8 MB),
after which every rebuild gives the same size. In a `dashboard`'s DHT process that rebuild came ~44 minutes in, a
step of +1.9 and +2.7 MB in two hour-long soaks (traced to that one block). `settle_interned_strings` makes it happen
at the start, with strings of its own, so that the process's memory stays flat later (`keep_releasing_memory` runs it
first).

`trace_growth_from_env` is a debugging aid: with ``P2PDILOCO_TRACE_MEMORY=DIR`` in its environment, a process (and
every process it forks) records its Python allocations with `tracemalloc` and writes, every
``P2PDILOCO_TRACE_MEMORY_S`` seconds (default 300), the source lines whose live allocations grew the most since its
first report to ``DIR/<pid>.txt``; with ``P2PDILOCO_TRACE_MEMORY_FRAMES=N`` (default 1), each with the N - 1 calls that
led to it (a line inside a library, such as msgpack's decoding, says little about who keeps what it made). Tracing costs CPU time and memory: it is for finding a leak, not for figures.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import os
import sys
import threading
import time
import tracemalloc
from pathlib import Path

TRACE_ENV = "P2PDILOCO_TRACE_MEMORY"
TRACE_EVERY_ENV = "P2PDILOCO_TRACE_MEMORY_S"
TRACE_FRAMES_ENV = "P2PDILOCO_TRACE_MEMORY_FRAMES"
TRACE_TOP = 25
"""Source lines listed in each report."""
_reporting_in: set[int] = set()
"""The processes (pids) whose reports have started: a forked peer that runs `trace_growth_from_env` again, and the
children it forks, get one reporting thread each."""


@functools.cache
def _malloc_trim():
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS, Windows)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_memory() -> bool:
    """Return the memory malloc holds freed to the operating system (all of it, `malloc_trim(0)`).

    Returns:
        True if the C library could (glibc); False elsewhere, where it does nothing.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


SETTLE_INTERNS = 1 << 18
"""Strings interned and dropped by `settle_interned_strings`: more than the free slots of the table of a process
whose interned strings number up to ~87k (a table of 2**18 slots, 2/3 of them usable), so that it is rebuilt."""


async def settle_interned_strings(count: int = SETTLE_INTERNS, chunk: int = 1 << 14) -> None:
    """Intern `count` strings and drop each at once (see the module's docstring): CPython's table of interned strings
    is rebuilt to the size its strings call for now, instead of once the process's own decoding has used up its free
    slots. ~0.1 s of CPU, in chunks of `chunk` with the event loop served in between."""
    for start in range(0, count, chunk):
        for i in range(start, min(start + chunk, count)):
            sys.intern(f"p2pdiloco-settle-{i}")  # interned, then freed: its slot is used up, as a decoded key's is
        await asyncio.sleep(0)


_releasing: set[asyncio.Task] = set()


async def keep_releasing_memory(every_s: float, *_ignored: object) -> None:
    """Release the process's freed memory (`release_free_memory`) every `every_s` seconds from now on, in a task
    of the running event loop. Arguments after `every_s` are ignored, so that a hivemind DHT's `run_coroutine`
    (which passes the DHT and its node) can start it in the DHT process. Settles the process's table of interned
    strings first (`settle_interned_strings`)."""

    async def release() -> None:
        await settle_interned_strings()
        while True:
            await asyncio.sleep(every_s)
            release_free_memory()

    task = asyncio.create_task(release())
    _releasing.add(task)  # a reference, so that the task is not collected
    task.add_done_callback(_releasing.discard)


class GrowthReports:
    """Reports, every `every_s` seconds, of the source lines whose traced allocations grew since the first report.

    Args:
        folder: where the reports go, one file per process (``<pid>.txt``, rewritten at each report).
        every_s: seconds between reports.
        frames: frames of each allocation's traceback kept and reported (1: the allocating line alone).
    """

    def __init__(self, folder: Path, every_s: float, frames: int = 1):
        self.folder, self.every_s, self.frames = folder, every_s, max(1, frames)
        self.stop = threading.Event()

    def start(self) -> None:
        """Trace allocations (if not yet) and write the reports from a daemon thread of this process (once)."""
        if os.getpid() in _reporting_in:
            return
        _reporting_in.add(os.getpid())
        if not tracemalloc.is_tracing():
            tracemalloc.start(self.frames)
        threading.Thread(target=self._run, name="memory-growth", daemon=True).start()

    def _run(self) -> None:
        path = self.folder / f"{os.getpid()}.txt"
        first, first_at = None, time.monotonic()
        while not self.stop.wait(self.every_s):
            snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
            if first is None:
                first, first_at = snap, time.monotonic()
            partial = path.with_suffix(".partial")
            partial.write_text(self.report(first, snap, time.monotonic() - first_at, self.frames))
            os.replace(partial, path)  # a reader sees a whole report, even one cut short by the process's exit

    @staticmethod
    def report(first: tracemalloc.Snapshot, now: tracemalloc.Snapshot, span_s: float, frames: int = 1) -> str:
        """The growth from `first` to `now`: traced totals, then the lines that grew the most; with `frames` > 1,
        by whole traceback, each line followed by its callers (``<-``, innermost first)."""
        total = sum(s.size for s in now.statistics("filename"))
        was = sum(s.size for s in first.statistics("filename"))
        lines = [f"pid {os.getpid()} {' '.join(sys.argv)[:200]}",
                 f"traced {total / 1e6:.2f} MB, {(total - was) / 1e6:+.3f} MB in {span_s / 60:.1f} min"]
        for stat in now.compare_to(first, "lineno" if frames <= 1 else "traceback")[:TRACE_TOP]:
            lines.append(f"{stat.size_diff / 1e3:+10.1f} kB {stat.count_diff:+8d} blocks  {stat.traceback[-1]}")
            lines.extend(f"{'':30}<- {frame}" for frame in reversed(stat.traceback[:-1]))
        return "\n".join(lines) + "\n"


def trace_growth_from_env() -> bool:
    """Start `GrowthReports` in this process and in every process it forks, if ``P2PDILOCO_TRACE_MEMORY`` names a
    folder. Returns whether it did."""
    folder = os.environ.get(TRACE_ENV)
    if not folder:
        return False
    if os.getpid() in _reporting_in:
        return True
    Path(folder).mkdir(parents=True, exist_ok=True)
    reports = GrowthReports(Path(folder), float(os.environ.get(TRACE_EVERY_ENV, "300")),
                            int(os.environ.get(TRACE_FRAMES_ENV, "1")))
    reports.start()
    os.register_at_fork(after_in_child=reports.start)  # a fork keeps the tracing but not the thread
    return True
