"""util/memory: freed memory handed back to the operating system; the report of what grows."""

import asyncio
import ctypes.util
import os
import subprocess
import sys
import tracemalloc

import pytest

from p2pdiloco.config import SwarmConfig
from p2pdiloco.network.swarm import start_dht
from p2pdiloco.util import memory
from p2pdiloco.util.memory import (
    TRACE_ENV,
    TRACE_EVERY_ENV,
    GrowthReports,
    keep_releasing_memory,
    release_free_memory,
)


def _anon_kb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Anonymous:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup") or ctypes.util.find_library("c") is None,
                    reason="needs Linux's /proc/self/smaps_rollup and a C library to load")
def test_freed_small_blocks_go_back_to_the_system():
    if not release_free_memory():
        pytest.skip("this C library has no malloc_trim (not glibc)")
    blocks = [bytearray(1000) for _ in range(60_000)]  # ~60 MB in small blocks, from malloc's arenas
    held = _anon_kb()
    del blocks[:-1]  # the newest stays: the arena's top is in use, so only a trim of its free pages returns them
    kept = _anon_kb()
    release_free_memory()
    assert _anon_kb() < kept - 30_000 and kept > held - 30_000, (held, kept, _anon_kb())


def test_the_growth_report_names_the_line_that_holds_more():
    was_tracing = tracemalloc.is_tracing()
    tracemalloc.start(1)
    try:
        first = tracemalloc.take_snapshot()
        grown = [bytes(100) + bytes([i % 256]) for i in range(20_000)]  # ~2.6 MB held, from this line
        report = GrowthReports.report(first, tracemalloc.take_snapshot(), 60.0)
    finally:
        if not was_tracing:
            tracemalloc.stop()
    top = report.splitlines()[2]
    assert "test_memory.py" in top and len(grown) == 20_000, report
    assert float(top.split()[0]) > 2000, report  # kB


def _keeper(n: int) -> list[bytes]:
    return [bytes(100) + bytes([i % 256]) for i in range(n)]  # the allocating line; its caller keeps the list


def test_with_frames_the_growth_report_names_who_called_the_allocating_line():
    was_tracing = tracemalloc.is_tracing()
    tracemalloc.stop()
    tracemalloc.start(3)
    try:
        first = tracemalloc.take_snapshot()
        grown = _keeper(20_000)  # ~2.6 MB, allocated in _keeper, kept here
        lines = GrowthReports.report(first, tracemalloc.take_snapshot(), 60.0, frames=3).splitlines()
    finally:
        tracemalloc.stop()
        if was_tracing:
            tracemalloc.start(1)
    assert len(grown) == 20_000
    top = next(i for i, line in enumerate(lines) if i >= 2 and "test_memory.py" in line and "<-" not in line)
    assert float(lines[top].split()[0]) > 2000, lines  # kB
    keeper_line = _keeper.__code__.co_firstlineno + 1
    assert lines[top].endswith(f"test_memory.py:{keeper_line}"), lines
    assert "<-" in lines[top + 1] and "test_memory.py" in lines[top + 1], lines  # its caller: this test's line


def test_a_process_with_the_variable_set_writes_its_report(tmp_path):
    env = {**os.environ, TRACE_ENV: str(tmp_path), TRACE_EVERY_ENV: "0.2"}
    code = ("import os, time; from p2pdiloco.util.memory import trace_growth_from_env as t; assert t(); "
            "x, deadline = [], time.monotonic() + 40\n"
            "while not os.path.exists(f'{os.environ[\"P2PDILOCO_TRACE_MEMORY\"]}/{os.getpid()}.txt') "
            "and time.monotonic() < deadline:\n"
            "    x.append(bytes(1000)); time.sleep(0.05)  # until the reporting thread has written a report")
    proc = subprocess.run([sys.executable, "-c", code], env=env, timeout=60, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    reports = list(tmp_path.glob("*.txt"))
    assert len(reports) == 1, reports  # one process, one reporting thread
    text = reports[0].read_text()
    assert text.startswith(f"pid {reports[0].stem}") and "traced" in text, text


def test_without_the_variable_nothing_is_traced():
    code = "import tracemalloc; from p2pdiloco.util.memory import trace_growth_from_env as t; " \
           "assert not t() and not tracemalloc.is_tracing()"
    env = {k: v for k, v in os.environ.items() if k != TRACE_ENV}
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode == 0


def test_keep_releasing_memory_releases_again_and_again_from_a_task_of_the_loop(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "release_free_memory", lambda: calls.append(1) or True)

    async def run() -> None:
        await keep_releasing_memory(0.01, "the DHT", "its node")  # returns at once; the task goes on
        for _ in range(500):
            if len(calls) >= 3:
                break
            await asyncio.sleep(0.01)
        for task in list(memory._releasing):
            task.cancel()

    asyncio.run(run())
    assert len(calls) >= 3 and not memory._releasing


async def _releasing_tasks(_dht, _node) -> int:
    return sum(not task.done() for task in memory._releasing)


def test_a_started_dht_process_releases_its_memory_from_then_on():
    dht = start_dht(SwarmConfig(host="127.0.0.1"))
    try:
        assert dht.run_coroutine(_releasing_tasks) == 1
    finally:
        dht.shutdown()


_DECODING = """
import asyncio, sys, tracemalloc
import hivemind  # the names a DHT process holds: torch's and hivemind's
from p2pdiloco.util.memory import settle_interned_strings
tracemalloc.start()
if sys.argv[1] == "settled":
    asyncio.run(settle_interned_strings())
start = tracemalloc.get_traced_memory()[0]
for i in range(100_000):  # record fields decoded and dropped, as msgpack interns every map key it decodes
    sys.intern(f"field-{i}")
print(tracemalloc.get_traced_memory()[0] - start)
"""


@pytest.mark.parametrize("settled", [False, True])
def test_a_settled_process_s_memory_does_not_step_when_its_decoding_has_interned_many_strings(settled):
    """CPython's table of interned strings is rebuilt once a process has interned (and dropped) enough of them; its
    first rebuild is a step of the process's memory (3.8 MB in one block where torch and hivemind are imported).
    `settle_interned_strings` takes that step at once: later decoding adds nothing."""
    out = subprocess.run([sys.executable, "-c", _DECODING, "settled" if settled else "fresh"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    grown = int(out.stdout.split()[-1])
    if settled:
        assert grown < 500_000, grown
    else:
        assert grown > 2_000_000, grown  # the step the settling takes at the start
