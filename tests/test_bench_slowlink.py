"""`bench slowlink`: its refusal without root, and its rate-limited namespaces (as root, where `ip` exists)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from p2pdiloco.bench import netns, slowlink
from p2pdiloco.bench.slowlink import SlowLinks, SlowlinkUnavailable, check_can_run
from p2pdiloco.cli import main

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux-only")
needs_root = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")),
    reason="needs root and iproute2 (ip, tc) to create network namespaces: run as root with iproute2 installed")


@linux
def test_without_root_the_bench_exits_with_a_clear_message(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SlowlinkUnavailable, match="must run as root"):
        check_can_run()
    assert main(["bench", "slowlink", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("p2pdiloco bench: error: bench slowlink must run as root")
    assert not (tmp_path / "out").exists()  # refused before creating anything


@linux
def test_without_iproute2_the_bench_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "tc" else f"/usr/sbin/{tool}")
    with pytest.raises(SlowlinkUnavailable, match="needs iproute2's tc on PATH"):
        check_can_run()


def _ours() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith(f"p2pdsl{os.getpid()}")}


def _host_qdiscs() -> str:
    return subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True, timeout=10).stdout


RECEIVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5001)); s.listen(1); s.settimeout(20)
c, _ = s.accept(); c.settimeout(20); n, t0 = 0, None
while True:
    b = c.recv(1 << 16)
    if not b:
        break
    t0 = t0 or time.monotonic(); n += len(b)
print(n, time.monotonic() - t0)
"""
SENDER = """
import socket, sys, time
deadline = time.monotonic() + 15
while True:
    try:
        c = socket.create_connection((sys.argv[1], 5001), timeout=5); break
    except OSError:
        if time.monotonic() > deadline: raise
        time.sleep(0.05)
c.sendall(b"x" * int(sys.argv[2])); c.close()
"""


@needs_root
def test_links_are_rate_limited_and_everything_is_deleted_after(tmp_path):
    qdiscs_before = _host_qdiscs()
    size = 1_000_000  # 0.8 s at 10 Mbit/s; milliseconds on an unlimited veth
    with SlowLinks(2, rate_mbit=10, tag="t") as links:
        assert _ours() == {links.hub, *links.peers}
        receiver = subprocess.Popen(links.exec_in(links.peers[1]) + [sys.executable, "-c", RECEIVER, links.addresses[1]],
                                    stdout=subprocess.PIPE, text=True)
        try:
            subprocess.run(links.exec_in(links.peers[0]) + [sys.executable, "-c", SENDER, links.addresses[1], str(size)],
                           check=True, timeout=30)
            out, _ = receiver.communicate(timeout=30)
        finally:
            if receiver.poll() is None:
                receiver.kill()
                receiver.wait()
        received, seconds = out.split()
        assert int(received) == size
        assert 0.5 < float(seconds) < 5, f"{size} bytes took {seconds} s through a 10 Mbit/s link"
    assert _ours() == set()
    assert _host_qdiscs() == qdiscs_before  # the host's own interfaces were never touched


@needs_root
def test_namespaces_are_deleted_when_the_body_fails():
    with pytest.raises(RuntimeError, match="boom"), SlowLinks(1, rate_mbit=10, tag="e") as links:
        assert _ours() == {links.hub, links.peers[0]}
        raise RuntimeError("boom")
    assert _ours() == set()


@needs_root
def test_only_leftovers_of_dead_runs_are_removed():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid names a run that no longer exists
    leftover, live = f"p2pdsl{dead.pid}-hub", f"p2pdsl{os.getppid()}-hub"  # our parent: alive
    if Path(f"/proc/{dead.pid}").exists():
        pytest.skip("the dead process's pid was reused at once (a rare race: running it again runs it)")
    try:
        for ns in (leftover, live):
            subprocess.run(["ip", "netns", "add", ns], check=True, timeout=10)
        removed = slowlink.remove_stale_namespaces()
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
        assert leftover in removed and leftover not in listed
        assert live not in removed and live in listed
    finally:
        for ns in (leftover, live):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
