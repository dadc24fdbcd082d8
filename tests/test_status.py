"""`p2pdiloco status`: peer records in, table and totals out; and its one-line errors (the dashboard's too).

A live swarm seen by `status` is in test_watch.py."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import time

import psutil
import pytest

from p2pdiloco.observe.status import format_status, human, swarm_status
from tests.test_cli import CLI, UNREACHABLE, _one_line_error, run_cli


def _record(name, step, loss, tps, **extra):
    return {"name": name, "device": "cpu", "version": "0.1.0", "step": step, "round": step // 10, "tokens": step * 64,
            "tokens_per_s": tps, "loss": loss, "eval_loss": None, "merges": 2, "bytes_sent": 2_500_000,
            "bytes_received": 2_400_000, "last_group_size": 3, "last_merge_s": 0.25, "last_merge_time": 990.0,
            "maddrs": ["/ip4/127.0.0.1/tcp/1/p2p/x"], "time": 999.0, **extra}


def test_status_lists_live_peers_and_totals_and_tolerates_junk():
    records = {
        "12D3KooWbbbbbbbbbb": _record("bob", 40, 3.0, 100.0),
        "12D3KooWaaaaaaaaaa": _record("alice", 60, 2.0, 300.0, eval_loss=2.5),
        "12D3KooWgone": {"left": True, "time": 998.0},
        # a stranger's record with nonsense in every field must not break the table
        "12D3KooWjunk": {"name": ["x"], "step": "many", "loss": float("nan"), "tokens_per_s": True, "maddrs": "x",
                         "time": 1e99, "round": float("inf")},
    }
    status = swarm_status(records, "run", now=1000.0)
    assert [p["name"] for p in status["peers"]] == ["alice", "bob", ""]  # named first, the nameless last
    junk = status["peers"][2]
    assert junk["step"] == 0 and junk["loss"] is None and junk["maddrs"] == [] and junk["round"] == 0
    t = status["totals"]
    assert t["peers"] == 3 and t["tokens_per_s"] == 400.0 and t["round"] == 6 and t["tokens"] == 100 * 64
    assert t["loss"] == 2.5 and t["eval_loss"] == 2.5
    assert status["peers"][0]["age_s"] == 1.0
    json.loads(json.dumps(status, allow_nan=False))  # what --json prints is strict JSON

    table = format_status(status)
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["peer", "id", "device", "version"]
    assert lines[1].startswith("alice") and "aaaaaaaa" in lines[1] and "2.000" in lines[1] and "2.5 MB" in lines[1]
    assert "10 s ago, 3 peers, 0.2 s" in lines[1]
    assert lines[-1] == ("swarm 'run': 3 peers, 400 tokens/s, 6.4k tokens, latest round 6, loss 2.500, "
                         "eval loss 2.500")


def test_human_numbers():
    assert [human(0), human(1.5), human(999), human(1234), human(2_500_000, "B"), human(512, "B")] == \
        ["0", "1.5", "999", "1.2k", "2.5 MB", "512 B"]


@pytest.mark.integration
def test_status_errors_are_one_line():
    _one_line_error(run_cli("status", "--initial-peers", UNREACHABLE, "--timeout", "8"), "could not join the swarm")
    _one_line_error(run_cli("dashboard", "--initial-peers", UNREACHABLE, "--port", "0"), "could not join the swarm")


@pytest.mark.integration
def test_status_of_an_empty_swarm_and_a_busy_port(bootstrap_dht):
    maddr = str(bootstrap_dht.get_visible_maddrs()[0])
    out = run_cli("status", "--initial-peers", maddr, "--run-id", "nobody-here", "--timeout", "3")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("p2pdiloco")]
    assert "no live peers in swarm 'nobody-here'" in line
    with listening_port() as port:
        _one_line_error(run_cli("dashboard", "--initial-peers", maddr, "--port", str(port)),
                        f"cannot serve the dashboard on 127.0.0.1:{port}")


@contextlib.contextmanager
def listening_port():
    """A port some other program is already listening on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_status_shows_mfu_where_the_peer_knows_its_device_peak():
    records = {"12D3KooWgpu": _record("gpu", 10, 2.0, 5000.0, mfu=0.412, device="cuda"),
               "12D3KooWcpu": _record("cpu", 10, 2.0, 50.0),  # a CPU peer sends mfu None (peak unknown)
               "12D3KooWbad": _record("bad", 10, 2.0, 50.0, mfu="lots")}
    status = swarm_status(records, "run", now=1000.0)
    assert [p["mfu"] for p in status["peers"]] == [None, None, 0.412]  # sorted by name: bad, cpu, gpu
    lines = format_status(status).splitlines()
    assert lines[0].split()[8:10] == ["tok/s", "MFU"]
    assert "41.2%" in lines[3] and "%" not in lines[1] + lines[2]


@pytest.mark.integration
def test_status_watch_keeps_reading_until_stopped_and_leaves_no_process(bootstrap_dht):
    maddr = str(bootstrap_dht.get_visible_maddrs()[0])
    proc = subprocess.Popen([*CLI, "status", "--watch", "0.5", "--json", "--initial-peers", maddr, "--run-id",
                             "nobody-here", "--timeout", "10"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, text=True)
    try:
        readings = []
        deadline = time.monotonic() + 40
        while len(readings) < 3 and time.monotonic() < deadline:
            line = proc.stdout.readline()  # the watcher prints a line every 0.5 s; the test's timeout bounds it
            if not line:
                break
            readings.append(json.loads(line))
        children = psutil.Process(proc.pid).children(recursive=True)
        assert [r["run_id"] for r in readings] == ["nobody-here"] * 3 and all(r["peers"] == [] for r in readings)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert children and not alive
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
