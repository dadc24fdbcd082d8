"""How well a WAN lab does what it was set to: round trips, rates and loss measured against the settings.

Before a run, `measure` starts a probe server (`wanprobe serve`) in the hub and, for each distinct link of the
lab, probes from the first home that has it: 2,000 UDP round trips, one every 0.5 ms (p50, p99 against twice
the delay; loss home to hub against the link's loss), then one TCP transfer up and one down of 20 round trips,
2 to 5 s (TCP payload reaching the receiver per second over its last two thirds, counted by its kernel,
against the tbf rate). Headers keep it at ~96 % of the rate (1448 of 1514 bytes a packet); a long round trip
keeps it lower (BBR's start-up, and Linux's default 4 MB send buffer against a path of 200 Mbit/s x 200 ms).
A few seconds per distinct link.
"""

from __future__ import annotations

import json
import subprocess
import sys

from rich.console import Console

from p2pdiloco.bench import netns
from p2pdiloco.bench.wanlab import HUB_ADDR, Home, Link, WanLab

PROBE_PORT = 5201
PROBE_TIMEOUT_S = 30.0
SERVER_START_S = 10.0
UNLIMITED_TRANSFER_S = 0.3


def _probe(home: Home, *args: str) -> dict:
    cmd = netns.exec_in(home.ns) + [sys.executable, "-m", "p2pdiloco.bench.wanprobe", *args, HUB_ADDR,
                                    str(PROBE_PORT)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]}
    return json.loads(done.stdout)


def transfer_seconds(link: Link) -> float:
    """How long a rate probe of `link` runs: 20 round trips (BBR's start-up takes ~10 to fill a long path),
    at least 2 s, at most 5 s."""
    return min(5.0, max(2.0, 20 * 2 * link.delay_ms / 1e3))


def measure_home(home: Home, transfer_s: float | None = None, count: int = 2000) -> dict:
    """The probes of one home against the hub (a probe server must be running there), beside what was set.

    Args:
        home: the home to probe from.
        transfer_s: length of each TCP transfer, seconds (default: `transfer_seconds` of its link).
        count: UDP round trips.
    """
    link = home.link
    transfer_s = transfer_s or transfer_seconds(link)
    rtt = _probe(home, "rtt", "--count", str(count), "--interval-s", "0.0005")
    # an unlimited direction only shows that the lab does not limit it: a short transfer does (saves CPU)
    up = _probe(home, "up", "--seconds", f"{transfer_s if link.up_mbit else UNLIMITED_TRANSFER_S:g}")
    down = _probe(home, "down", "--seconds", f"{transfer_s if link.down_mbit else UNLIMITED_TRANSFER_S:g}")
    received = rtt.get("server_received")
    return {
        "home": home.index, "link": link.describe(), "count": count,
        "rtt_ms_set": 2 * link.delay_ms, "rtt_ms_p50": rtt.get("rtt_ms_p50"), "rtt_ms_p99": rtt.get("rtt_ms_p99"),
        "loss_set": link.loss,
        "loss_up": 1 - received / count if received is not None else None,
        "loss_round_trip_set": 1 - (1 - link.loss) ** 2,
        "loss_round_trip": 1 - rtt["echoed"] / count if "echoed" in rtt else None,
        "up_mbit_set": link.up_mbit, "up_mbit": up.get("mbit"),
        "down_mbit_set": link.down_mbit, "down_mbit": down.get("mbit"),
        "errors": {k: v["error"] for k, v in (("rtt", rtt), ("up", up), ("down", down)) if "error" in v},
    }


def measure(lab: WanLab, transfer_s: float | None = None) -> list[dict]:
    """`measure_home` for the first home of each distinct link of `lab`, one after the other."""
    server = subprocess.Popen(
        netns.exec_in(lab.hub) + [sys.executable, "-m", "p2pdiloco.bench.wanprobe", "serve", HUB_ADDR,
                                  str(PROBE_PORT)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        netns.wait_ready(server, SERVER_START_S, f"the probe server in {lab.hub}")
        seen, results = set(), []
        for home in lab.homes:
            if home.link not in seen:
                seen.add(home.link)
                results.append(measure_home(home, transfer_s))
        return results
    finally:
        server.kill()
        server.communicate(timeout=PROBE_TIMEOUT_S)


def _fmt(value: float | None, unit: str, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}%}" if unit == "%" else f"{value:.{digits}f}{unit}"


def print_accuracy(rows: list[dict], console: Console) -> None:
    """One line per measured link: each figure beside what was set."""
    for r in rows:
        up_set = f"{r['up_mbit_set']:g}" if r["up_mbit_set"] else "∞"
        down_set = f"{r['down_mbit_set']:g}" if r["down_mbit_set"] else "∞"
        console.print(
            f"  home {r['home']} ({r['link']}): RTT to hub p50 {_fmt(r['rtt_ms_p50'], ' ms')} / p99 "
            f"{_fmt(r['rtt_ms_p99'], ' ms')} (set {r['rtt_ms_set']:g} ms); up {_fmt(r['up_mbit'], '')} of "
            f"{up_set} Mbit/s, down {_fmt(r['down_mbit'], '')} of {down_set} Mbit/s; loss home to hub "
            f"{_fmt(r['loss_up'], '%')} (set {r['loss_set']:.1%}), round trip {_fmt(r['loss_round_trip'], '%')} "
            f"(expected {r['loss_round_trip_set']:.1%}) of {r['count']} UDP datagrams"
            + (f"; probe errors: {r['errors']}" if r["errors"] else ""))
