"""The WAN lab: its delay daemon's holding rule (no root), and as root its namespaces, NAT, delay and cleanup.

Only addresses inside namespaces the lab creates (10.88.0.0/16) are dialled, every socket has a timeout of a
second or two, and every wait is on a condition with a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from p2pdiloco.bench import netns, wanlab
from p2pdiloco.bench.delayd import Holder
from p2pdiloco.bench.netns import NamespacesUnavailable
from p2pdiloco.bench.wanlab import HUB_ADDR, NS_PREFIX, Link, WanLab
from p2pdiloco.cli import main
from tests.conftest import wait_for

needs_lab = pytest.mark.lab
"""Root, iproute2, iptables and NetfilterQueue: without them the test skips saying which is missing (conftest.py)."""

DELAY = Link(delay_ms=20)
"""20 ms each way at the router: a home-to-hub round trip of 40 ms."""
PORT = 7001

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(4); s.settimeout(20)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(b"hi"); c.close()
"""
CLIENT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5) as c:
        c.settimeout(1.5)
        print(c.recv(2).decode())
except OSError as e:
    print(type(e).__name__)
"""


def _ours(tag: str = "") -> set[str]:
    return {ns for ns in netns.namespaces() if ns.startswith(f"{NS_PREFIX}{os.getpid()}{tag}")}


def _alive(pid: int) -> bool:
    return netns.running(pid)


def test_the_holder_keeps_order_delays_and_drops_at_the_rate_set():
    holder = Holder(delay_s=0.04, jitter_s=0.005, loss=0.1, seed=3)
    arrivals = [i * 0.0005 for i in range(20000)]  # 2,000 packets/s for 10 s
    held = [(t, d) for t in arrivals if (d := holder.due(now=t)) is not None]
    assert 0.09 < 1 - len(held) / len(arrivals) < 0.11
    assert [d for _, d in held] == sorted(d for _, d in held)  # jitter never reorders packets
    holds = [d - t for t, d in held]
    assert min(holds) >= 0
    assert abs(statistics.mean(holds) - 0.04) < 0.002  # order kept without adding to the delay set
    assert 0.003 < statistics.stdev(holds) < 0.006
    plain = Holder(delay_s=0.04)
    assert [plain.due(now=t) for t in (0.0, 0.5)] == [0.04, 0.54]


def test_profiles_cycle_over_the_homes():
    assert wanlab.profile_links("mixed", 4) == [wanlab.HOME, wanlab.INTERCONTINENTAL, wanlab.FIBER, wanlab.HOME]
    assert wanlab.profile_links("home", 2) == [wanlab.HOME] * 2
    assert wanlab.HOME == Link(up_mbit=20, down_mbit=100, delay_ms=40, loss=0.005)
    with pytest.raises(ValueError, match="profiles: lan, home"):
        wanlab.profile_links("moon", 1)


def test_without_root_bench_wan_exits_with_one_clear_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["bench", "wan", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("p2pdiloco bench: error: bench wan must run as root")
    assert not (tmp_path / "out").exists()


def test_without_netfilterqueue_the_lab_says_what_to_install(monkeypatch):
    monkeypatch.setattr(netns, "check_can_run", lambda what, tools: None)
    monkeypatch.setitem(sys.modules, "netfilterqueue", None)  # import fails
    with pytest.raises(NamespacesUnavailable, match=r"needs the NetfilterQueue package .*p2pdiloco\[lab\]"):
        wanlab.check_can_run("bench wan", [wanlab.HOME])
    wanlab.check_can_run("bench wan", [wanlab.LAN])  # rates alone need no daemon


@pytest.fixture
def lab():
    """Home 0 behind a NAT router, home 1 behind a router that only routes; 20 ms each way at both routers."""
    with WanLab([DELAY, DELAY], nat=[True, False], tag="f") as built:
        yield built
    assert _ours("f") == set()


def _run(ns: str, script: str, *args: str, timeout: float = 10) -> str:
    done = subprocess.run(netns.exec_in(ns) + [sys.executable, "-c", script, *args], capture_output=True,
                          text=True, timeout=timeout)
    return done.stdout.strip()


def _server(ns: str, addr: str) -> subprocess.Popen:
    proc = subprocess.Popen(netns.exec_in(ns) + [sys.executable, "-c", SERVER, addr, str(PORT)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    netns.wait_ready(proc, 10, "the test's TCP server")
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.communicate(timeout=10)


@needs_lab
def test_nat_lets_a_home_dial_out_and_drops_every_dial_in(lab):
    nat, routed = lab.homes
    servers = [_server(lab.hub, HUB_ADDR), _server(nat.ns, nat.addr), _server(routed.ns, routed.addr)]
    try:
        assert _run(nat.ns, CLIENT, HUB_ADDR, str(PORT)) == "hi"  # dial out through NAT
        assert _run(routed.ns, CLIENT, nat.addr, str(PORT)) == "TimeoutError"  # another home cannot dial in
        assert _run(lab.hub, CLIENT, nat.addr, str(PORT)) == "TimeoutError"  # nor can the internet
        assert _run(lab.hub, CLIENT, nat.router_wan, str(PORT)) == "TimeoutError"  # no port forward on the router
        assert _run(lab.hub, CLIENT, routed.addr, str(PORT)) == "hi"  # a routing router lets dials in
        assert _run(nat.ns, CLIENT, routed.addr, str(PORT)) == "hi"
    finally:
        for s in servers:
            _stop(s)


@needs_lab
def test_the_delay_daemon_gives_the_round_trip_set(lab):
    server = subprocess.Popen(netns.exec_in(lab.hub) + [sys.executable, "-m", "p2pdiloco.bench.wanprobe", "serve",
                                                        HUB_ADDR, str(PORT)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        netns.wait_ready(server, 10, "the probe server")
        out = _run(lab.homes[0].ns, "from p2pdiloco.bench.wanprobe import main; main()", "rtt", HUB_ADDR,
                   str(PORT), "--count", "100", "--interval-s", "0.005")
    finally:
        _stop(server)
    rtt = json.loads(out)
    assert rtt["echoed"] >= 95 and rtt["server_received"] >= 95
    assert 35 < rtt["rtt_ms_p50"] < 80, rtt  # set: 2 x 20 ms; a generous bound, this checks behaviour


@needs_lab
def test_namespaces_and_daemons_are_gone_after_a_failing_body():
    with pytest.raises(RuntimeError, match="boom"), WanLab([DELAY], nat=[True], tag="e") as lab:
        pids = [p.pid for p in lab.daemons.values()]
        assert _ours("e") == set(lab.namespaces) and len(pids) == 1 and _alive(pids[0])
        raise RuntimeError("boom")
    assert _ours("e") == set()
    assert not _alive(pids[0])


LAB_IN_A_CHILD = """
import json, sys, time
from p2pdiloco.bench.wanlab import Link, WanLab
with WanLab([Link(delay_ms=5)], nat=[True], tag="c") as lab:
    print(json.dumps({"namespaces": lab.namespaces, "daemons": [p.pid for p in lab.daemons.values()]}), flush=True)
    time.sleep(60)  # until the test signals it
"""


def _lab_child() -> tuple[subprocess.Popen, dict]:
    child = subprocess.Popen([sys.executable, "-c", LAB_IN_A_CHILD], stdout=subprocess.PIPE, text=True)
    return child, json.loads(child.stdout.readline())


@needs_lab
def test_sigterm_deletes_the_lab():
    child, made = _lab_child()
    try:
        assert set(made["namespaces"]) <= set(netns.namespaces())
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=20)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert not set(made["namespaces"]) & set(netns.namespaces())
    assert not any(_alive(pid) for pid in made["daemons"])


@needs_lab
def test_a_killed_lab_is_removed_at_the_next_start_and_a_live_one_is_not():
    child, made = _lab_child()
    live = f"{NS_PREFIX}{os.getppid()}-hub"  # our parent's: a creator that is alive
    subprocess.run(["ip", "netns", "add", live], check=True, timeout=10)
    try:
        child.kill()  # no cleanup runs: its namespaces stay
        child.wait(timeout=10)
        assert set(made["namespaces"]) <= set(netns.namespaces())
        # its daemon got the parent-death signal
        wait_for(lambda: not any(_alive(pid) for pid in made["daemons"]), 10, what="the orphaned daemon to exit")
        with WanLab([wanlab.LAN], nat=[False], tag="n"):
            left = set(netns.namespaces())
            assert not set(made["namespaces"]) & left
            assert live in left
    finally:
        subprocess.run(["ip", "netns", "del", live], capture_output=True, timeout=10)
        for ns in made["namespaces"]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


@needs_lab
def test_processes_left_in_a_dead_run_s_namespace_are_stopped_with_it(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    if Path(f"/proc/{dead.pid}").exists():
        pytest.skip("the dead process's pid was reused at once")
    leftover = f"{NS_PREFIX}{dead.pid}-h0"
    subprocess.run(["ip", "netns", "add", leftover], check=True, timeout=10)
    orphan = subprocess.Popen(netns.exec_in(leftover) + [sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        wait_for(lambda: orphan.pid in netns.pids_in(leftover), 10, what="the process to be in the namespace")
        assert leftover in netns.remove_stale_namespaces(NS_PREFIX)
        orphan.wait(timeout=10)
        assert leftover not in netns.namespaces()
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()
        subprocess.run(["ip", "netns", "del", leftover], capture_output=True, timeout=10)


@needs_lab
def test_the_request_probe_times_a_connection_and_each_request_and_leaves_no_namespace(tmp_path):
    from p2pdiloco.bench.rpcprobe import probe

    figures = probe("lan", samples=3, work=tmp_path, bulk_mb=0.5)
    assert figures["rtt_set_ms"] == 0 and figures["connect_ms"] > 0 and figures["bulk_mbit_s"] > 0
    assert len(figures["new_stream_ms"]) == 3 and len(figures["same_stream_ms"]) == 3
    assert all(ms > 0 for ms in figures["new_stream_ms"] + figures["same_stream_ms"])
    assert not [ns for ns in netns.namespaces() if ns.startswith(f"{NS_PREFIX}{os.getpid()}rp")]


@needs_lab
def test_the_lab_sets_the_homes_congestion_control_when_asked():
    def congestion_control(ns: str) -> str:
        return subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-n", "net.ipv4.tcp_congestion_control"],
                              capture_output=True, text=True, timeout=10, check=True).stdout.strip()

    with WanLab([Link()], nat=[False], tag="cc", tcp="reno") as lab:
        assert congestion_control(lab.homes[0].ns) == "reno" and congestion_control(lab.hub) == "reno"
    with WanLab([Link()], nat=[False], tag="cc") as lab:
        assert congestion_control(lab.homes[0].ns) != "reno"  # the host's default
