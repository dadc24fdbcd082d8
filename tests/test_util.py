"""The lowest layer's helpers: atomic file writes, what counts as a number, stopping a child process."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys

import pytest

from p2pdiloco.util.files import replacing, write_atomic, write_json_atomic
from p2pdiloco.util.numbers import finite_number, number_or_none
from p2pdiloco.util.processes import stop_process


def test_writes_replace_the_file_and_leave_nothing_else(tmp_path):
    path = tmp_path / "out.bin"
    write_atomic(path, b"old")
    write_atomic(path, b"new", durable=True)
    assert path.read_bytes() == b"new"
    write_atomic(tmp_path / "out.txt", "héllo\n")
    assert (tmp_path / "out.txt").read_text(encoding="utf-8") == "héllo\n"
    write_json_atomic(tmp_path / "out.json", {"a": [1, 2]})
    assert json.loads((tmp_path / "out.json").read_text()) == {"a": [1, 2]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin", "out.json", "out.txt"]


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "out.bin"
    write_atomic(path, b"old")
    with pytest.raises(RuntimeError), replacing(path) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("the writer failed")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_a_missing_folder_is_an_os_error(tmp_path):
    with pytest.raises(OSError):
        write_atomic(tmp_path / "nowhere" / "out.bin", b"x")


@pytest.mark.parametrize("value", [0, -3, 2**70, 0.5, -1e300])
def test_finite_ints_and_floats_are_numbers(value):
    assert finite_number(value) and number_or_none(value) == float(value)


@pytest.mark.parametrize("value", [True, False, math.nan, math.inf, -math.inf, "1", None, [1], b"1"])
def test_bools_non_finite_values_and_non_numbers_are_not(value):
    assert not finite_number(value) and number_or_none(value) is None


def _child(setup: str = "") -> subprocess.Popen:
    """A python child that runs `setup`, says so, and sleeps for a minute; returned once it has said so."""
    code = f"import signal, time\n{setup}\nprint('ready', flush=True)\ntime.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_a_child_that_stops_on_the_signal_exits_with_it():
    proc = _child()
    assert stop_process(proc, timeout=30) == -signal.SIGTERM
    proc.stdout.close()


def test_a_child_that_ignores_the_signal_is_killed_after_the_timeout():
    proc = _child("signal.signal(signal.SIGINT, signal.SIG_IGN)")
    assert stop_process(proc, timeout=0.5, sig=signal.SIGINT) == -signal.SIGKILL
    proc.stdout.close()


def test_a_child_that_has_exited_gets_no_signal_and_keeps_its_status():
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait(timeout=30)
    assert stop_process(proc, timeout=1) == 3
