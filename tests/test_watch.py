"""Watching a running swarm: `status`, the dashboard of `local --dashboard`, the peers' /metrics, and the
dashboard rendered by a headless Chromium. One 3-peer `p2pdiloco local` swarm serves every test here."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.conftest import chromium, free_port, interrupt_and_reap, wait_for
from tests.test_cli import CLI, TINY, run_cli
from tests.test_telemetry import check_exposition, parse_families

pytestmark = pytest.mark.integration

RUN_ID = "watch"
N_PEERS = 3
CHROMIUM = chromium()


class Swarm:
    def __init__(self, proc: subprocess.Popen, run_dir: Path, maddr: str, dashboard: str, metrics_port: int):
        self.proc, self.run_dir, self.maddr, self.dashboard, self.metrics_port = proc, run_dir, maddr, dashboard, metrics_port

    def api(self, path: str = "api/state") -> dict:
        with urllib.request.urlopen(self.dashboard + path, timeout=10) as response:
            return json.loads(response.read())

    def status(self, *extra: str) -> subprocess.CompletedProcess:
        return run_cli("status", "--initial-peers", self.maddr, "--run-id", RUN_ID, "--timeout", "20", *extra,
                       timeout=90)


def _live_with_points(swarm: Swarm, n_points: int) -> dict | None:
    state = swarm.api()
    live = [p for p in state["peers"] if p["state"] == "live"]
    with_loss = [p for p in live if sum(1 for pt in p["points"] if pt[state["point_fields"].index("loss")] is not None)
                 >= n_points]
    return state if len(with_loss) == N_PEERS else None


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """`p2pdiloco local --dashboard` with 3 peers that train until the module is done, each serving /metrics.

    Ready once the dashboard shows all 3 peers live: by then every peer has started its DHT and p2p daemon, so
    the per-test `reap_children` fixture counts them as existing before each test and leaves them alone."""
    run_dir = tmp_path_factory.mktemp("watch")
    metrics_port = free_port()
    log = (run_dir / "local.log").open("w")
    proc = subprocess.Popen(
        [*CLI, "local", "--peers", str(N_PEERS), "--steps", "1000000", "--run-dir", str(run_dir), "--run-id", RUN_ID,
         "--dashboard", "--dashboard-port", "0", "--set", f"run.metrics_port={metrics_port}",
         "--set", "rounds.round_steps=20", "--set", "emulate.min_step_s=0.02", *TINY],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )
    try:
        url = wait_for(lambda: (m := re.search(r"dashboard at (http://\S+/)", (run_dir / "local.log").read_text()))
                       and m.group(1), 60, what="the dashboard's address")
        maddr = wait_for(lambda: (run_dir / "bootstrap.maddr").exists() and (run_dir / "bootstrap.maddr").read_text().strip(),
                         30, what="bootstrap.maddr")
        s = Swarm(proc, run_dir, maddr, url, metrics_port)
        wait_for(lambda: _live_with_points(s, 1), 150, interval=1.0, what="3 live peers on the dashboard")
        yield s
    finally:
        interrupt_and_reap(proc, timeout=60)
        log.close()


def _steps(status: dict) -> dict[str, tuple[int, int]]:
    return {p["name"]: (p["step"], p["tokens"]) for p in status["peers"]}


def test_status_sees_all_three_peers_with_advancing_counters(swarm):
    def three_peers():
        out = swarm.status("--json")
        assert out.returncode in (0, 1), out.stderr
        status = json.loads(out.stdout)
        return status if status["totals"]["peers"] == N_PEERS else None

    first = wait_for(three_peers, 90, interval=1.0, what="status --json to list 3 peers")
    assert sorted(_steps(first)) == [f"peer{i}" for i in range(N_PEERS)]
    for p in first["peers"]:
        assert p["device"] == "cpu" and p["version"] and p["maddrs"] and p["age_s"] is not None
    assert first["totals"]["tokens_per_s"] > 0 and first["totals"]["loss"] is not None

    def advanced():
        later = three_peers()
        if later is None:
            return None
        before, after = _steps(first), _steps(later)
        return later if all(after[n][0] > before[n][0] and after[n][1] > before[n][1] for n in before) else None

    later = wait_for(advanced, 90, interval=1.0, what="every peer's steps and tokens to advance")
    assert later["totals"]["round"] >= first["totals"]["round"]

    def dialed_back():  # on loopback every peer is reachable: another node dialed each back and said so
        now = three_peers()
        return now if now is not None and all(p["reachable"] is True for p in now["peers"]) else None

    wait_for(dialed_back, 60, interval=1.0, what="every peer's record to say another node dialed it back")

    table = swarm.status()  # the human-readable table
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].startswith("peer ") and all(any(line.startswith(f"peer{i} ") for line in lines) for i in range(N_PEERS))
    assert lines[-1].startswith(f"swarm '{RUN_ID}': {N_PEERS} peers,")
    assert lines[0].split()[4] == "reach" and all(line.split()[4] == "yes" for line in lines[1:1 + N_PEERS])


def test_dashboard_serves_page_and_api_with_live_data(swarm):
    with urllib.request.urlopen(swarm.dashboard, timeout=10) as response:
        page = response.read().decode()
    assert response.headers["Content-Type"].startswith("text/html") and 'id="chart-loss"' in page
    state = wait_for(lambda: _live_with_points(swarm, 3), 90, interval=1.0, what="3 readings of every peer")
    assert state["run_id"] == RUN_ID and state["status"]["totals"]["peers"] == N_PEERS
    # a peer's name comes from its config record, which the dashboard may read a poll or more after its first heartbeat
    names = [f"peer{i}" for i in range(N_PEERS)]
    wait_for(lambda: sorted(e["name"] for e in swarm.api()["events"] if e["event"] == "joined") == names, 30,
             interval=1.0, what="every peer's name on its joined event")
    fields = state["point_fields"]
    for peer in state["peers"]:
        steps = [pt[fields.index("step")] for pt in peer["points"]]
        assert steps == sorted(steps) and steps[-1] > steps[0]  # successive heartbeats, advancing
    tps = [pt[state["swarm_fields"].index("tokens_per_s")] for pt in state["swarm"]]
    assert max(tps) > 0
    wait_for(lambda: sorted(p["name"] for p in swarm.api("api/status")["peers"]) == names, 30, interval=1.0,
             what="every peer's name in /api/status")


def test_every_peer_serves_prometheus_metrics(swarm):
    def scrape(i: int) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{swarm.metrics_port + i}/metrics", timeout=10) as response:
            assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            text = response.read().decode()
        info = parse_families(text)["p2pdiloco_peer_info"].samples[0].labels
        return check_exposition(text, {"peer_id": info["peer_id"], "name": f"peer{i}"})

    first = [scrape(i) for i in range(N_PEERS)]
    for families in first:
        assert families["p2pdiloco_peer_info"].samples[0].labels["run_id"] == RUN_ID
        assert families["p2pdiloco_tokens"].samples[0].value > 0

    def steps(families):
        return families["p2pdiloco_inner_steps"].samples[0].value

    wait_for(lambda: all(steps(scrape(i)) > steps(first[i]) for i in range(N_PEERS)), 60, what="counters to advance")
    merged = wait_for(lambda: [f for i in range(N_PEERS) if (f := scrape(i))["p2pdiloco_merges"].samples[0].value > 0],
                      90, interval=1.0, what="a group merge")
    assert merged[0]["p2pdiloco_bytes_sent"].samples[0].value > 0
    assert merged[0]["p2pdiloco_last_merge_group_size"].samples[0].value >= 1


def test_dashboard_command_follows_the_swarm_and_stops_on_ctrl_c(swarm, tmp_path):
    log = tmp_path / "dashboard.log"
    with log.open("w") as out:
        proc = subprocess.Popen([*CLI, "dashboard", "--initial-peers", swarm.maddr, "--run-id", RUN_ID, "--port", "0",
                                 "--refresh", "1"], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        url = wait_for(lambda: (m := re.search(r"(http://127\.0\.0\.1:\d+/)", log.read_text())) and m.group(1), 60,
                       what="the dashboard's address")

        def three_live():
            with urllib.request.urlopen(url + "api/status", timeout=10) as response:
                return json.loads(response.read())["totals"]["peers"] == N_PEERS

        wait_for(three_live, 60, interval=0.5, what="the dashboard command to see 3 peers")
        descendants = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, log.read_text()[-2000:]
        _, alive = psutil.wait_procs(descendants, timeout=10)
        assert not alive, f"left running: {[p.name() for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _chromium(url: str, out_dir: Path, *mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-extensions",
         "--disable-dev-shm-usage", f"--user-data-dir={out_dir / 'profile'}", "--window-size=1400,1500",
         "--virtual-time-budget=8000", *mode, url],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )


@pytest.mark.browser
def test_headless_chromium_renders_the_charts_with_data(swarm, tmp_path):
    wait_for(lambda: _live_with_points(swarm, 3), 90, interval=1.0, what="3 readings of every peer")
    out = _chromium(swarm.dashboard, tmp_path, "--dump-dom")
    dom = out.stdout
    assert 'data-renders="' in dom and 'data-renders="0"' not in dom, out.stderr[-2000:]

    def chart(chart_id: str) -> str:
        m = re.search(rf'<svg[^>]*id="{chart_id}"[^>]*>(.*?)</svg>', dom, re.S)
        assert m, f"{chart_id} missing from the rendered page"
        points = re.search(r'data-points="(\d+)"', m.group(0))
        assert points and int(points.group(1)) > 0, f"{chart_id} drew no data points"
        return m.group(1)

    loss = chart("chart-loss")
    peers_drawn = set(re.findall(r'<polyline[^>]*data-series="(12D3\w+)"', loss))
    assert len(peers_drawn) == N_PEERS  # one training-loss line per peer
    assert all(int(n) >= 2 for n in re.findall(r'<polyline[^>]*data-series="12D3\w+"[^>]*data-n="(\d+)"', loss))
    assert re.search(r"<circle[^>]*data-v=", loss)
    assert "<polyline" in chart("chart-tps")
    assert 'data-series="event"' in chart("chart-peers")  # the joins
    assert len(re.findall(r'<rect[^>]*data-what="sent"', chart("chart-bytes"))) == N_PEERS
    rows = re.search(r'<table id="peers">.*?</table>', dom, re.S).group(0)
    assert all(f"peer{i}" in rows for i in range(N_PEERS)) and rows.count("state-live") == N_PEERS

    shot = _chromium(swarm.dashboard, tmp_path, f"--screenshot={tmp_path / 'dashboard.png'}")
    assert (tmp_path / "dashboard.png").stat().st_size > 20_000, shot.stderr[-2000:]
