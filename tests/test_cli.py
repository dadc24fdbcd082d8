"""The command line as a user meets it: help, clear one-line errors, a bootstrap node that keeps its address,
and the README's flow of a bootstrap node plus two peers started by hand."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from hivemind.utils.timed_storage import get_dht_time

from p2pdiloco.config import SwarmConfig, fingerprint_digest
from p2pdiloco.config.fingerprint import protocol_fields
from p2pdiloco.network.swarm import config_key, peer_shard, peers_key, start_dht, write_subkey
from tests.conftest import free_port, wait_for

CLI = [sys.executable, "-m", "p2pdiloco"]
TINY = ["--set", "model.n_layer=1", "--set", "model.d_model=32", "--set", "model.n_head=2",
        "--set", "model.seq_len=32", "--set", "data.batch_size=4", "--set", "run.eval_batches=2",
        "--set", "data.max_bytes=400000", "--set", "run.threads=1"]
UNREACHABLE = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWNoCmJBXGUxB4Eg1M4kzki6u8kU4UvVSqqc4fmisFGNPU"


def run_cli(*args, timeout=60):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("command", [[], ["bootstrap"], ["peer"], ["local"], ["status"], ["dashboard"], ["plot"],
                                     ["sample"], ["export"], ["simulate"], ["bench"], ["bench", "scale"],
                                     ["tokenizer", "train"]])
def test_help(command):
    out = run_cli(*command, "--help")
    assert out.returncode == 0 and "usage: p2pdiloco" in out.stdout


def _one_line_error(out, pattern):
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("p2pdiloco")]
    assert len(lines) == 1 and pattern in lines[0], out.stderr
    assert "Traceback" not in out.stderr


def test_unknown_config_key(tmp_path):
    _one_line_error(run_cli("peer", "--set", "model.n_layers=3", "--run-dir", str(tmp_path)),
                    "unknown config key 'model.n_layers'")
    cfg = tmp_path / "c.toml"
    cfg.write_text("[swarm]\nround_step = 3\n")
    _one_line_error(run_cli("local", "--config", str(cfg), "--run-dir", str(tmp_path)), "unknown config key 'swarm.round_step'")


def test_unreadable_data_path(tmp_path):
    _one_line_error(run_cli("peer", "--data", str(tmp_path / "nope.txt"), "--run-dir", str(tmp_path)), "does not exist")


def test_unreachable_initial_peer(tmp_path):
    out = run_cli("peer", "--initial-peers", UNREACHABLE, "--run-dir", str(tmp_path), *TINY,
                  "--set", "swarm.join_timeout_s=10")
    _one_line_error(out, "could not join the swarm")


def test_peer_with_different_model_is_refused(tmp_path, bootstrap_dht, net_loop):
    maddr = str(bootstrap_dht.get_visible_maddrs()[0])
    theirs = {"model": {"n_layer": 4}, "tokenizer": "bytes", **protocol_fields()}  # same protocol, other model
    record = {"fingerprint": theirs}
    other = start_dht(SwarmConfig(host="127.0.0.1", initial_peers=[maddr]))  # records are signed by their peer
    try:
        other_id = other.peer_id.to_base58()  # a live peer (its heartbeat, with its config's digest) whose config differs
        heartbeat = {"step": 1, "fingerprint": fingerprint_digest(theirs)}
        net_loop.run(write_subkey(other, peers_key("fp", peer_shard(other_id)), other_id, heartbeat,
                                  get_dht_time() + 60), 10)
        net_loop.run(write_subkey(other, config_key("fp"), other_id, record, get_dht_time() + 60), 10)
        out = run_cli("peer", "--initial-peers", maddr, "--run-id", "fp", "--run-dir", str(tmp_path), *TINY)
    finally:
        other.shutdown()
    _one_line_error(out, "config differs from the swarm")
    assert "model.n_layer: 1 here, 4 in the swarm" in out.stderr


def _start(args, log: Path) -> subprocess.Popen:
    return subprocess.Popen([*CLI, *args], stdout=log.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _stop(proc: subprocess.Popen, sig=signal.SIGINT, timeout=30) -> int:
    descendants = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(sig)
    rc = proc.wait(timeout=timeout)
    _, alive = psutil.wait_procs(descendants, timeout=10)
    assert not alive, f"left running after exit: {[p.name() for p in alive]}"
    return rc


def test_bootstrap_keeps_its_address_across_restarts(tmp_path):
    port = free_port()
    maddrs = []
    for attempt in range(2):
        maddr_file = tmp_path / f"maddr{attempt}"
        proc = _start(["bootstrap", "--host", "127.0.0.1", "--port", str(port), "--identity", str(tmp_path / "id.key"),
                       "--maddr-file", str(maddr_file)], tmp_path / f"boot{attempt}.log")
        try:
            wait_for(maddr_file.exists, 30, what="bootstrap address file")
            maddrs.append(maddr_file.read_text().split())
        finally:
            assert _stop(proc) == 0
    assert maddrs[0] == maddrs[1] and f"/tcp/{port}/p2p/" in maddrs[0][0]
    log = (tmp_path / "boot1.log").read_text()
    assert "reused identity" in log


def test_bootstrap_and_two_peers_by_hand_train_and_merge(tmp_path):
    maddr_file = tmp_path / "maddr"
    boot = _start(["bootstrap", "--host", "127.0.0.1", "--port", "0", "--identity", str(tmp_path / "id.key"),
                   "--maddr-file", str(maddr_file)], tmp_path / "boot.log")
    peers = []
    try:
        wait_for(maddr_file.exists, 30, what="bootstrap address file")
        maddr = maddr_file.read_text().split()[0]
        for i in range(2):
            peers.append(_start(["peer", "--initial-peers", maddr, "--host", "127.0.0.1", "--run-dir",
                                 str(tmp_path / f"p{i}"), "--steps", "40", "--set", "rounds.round_steps=10",
                                 # 40 tiny steps take about a second: without waiting for each other, each
                                 # peer can be done before it sees the other's record, and never merge
                                 "--set", "startup.wait_for_peers=2",
                                 # and even together, one peer's start can lag the other's by more than a
                                 # second on a loaded machine (CI once: 0 merges); paced, the run lasts 4 s
                                 "--set", "emulate.min_step_s=0.1",
                                 "--set", f"run.seed={i}", *TINY], tmp_path / f"p{i}.log"))
        for p in peers:
            assert p.wait(timeout=150) == 0
        summaries = [json.loads((tmp_path / f"p{i}" / "summary.json").read_text()) for i in range(2)]
        for s in summaries:
            (peer,) = s["peers"]
            # a peer still training when the other's last contribution reaches it ends there, with that merge
            assert peer["merges"] > 0 and (peer["inner_steps"] == 40 or peer["ended_with_swarm"])
            assert s["eval_loss_final"] < s["eval_loss_initial"]
            assert (tmp_path / f"p{summaries.index(s)}" / "loss.png").stat().st_size > 0
        ended = [s["peers"][0] for s in summaries]
        assert max(p["inner_steps"] for p in ended) == 40
        if any(p["ended_with_swarm"] for p in ended):
            assert ended[0]["global_digest"] == ended[1]["global_digest"]  # the same final global model
    finally:
        for p in peers:
            if p.poll() is None:
                _stop(p)
        assert _stop(boot) == 0


def test_ctrl_c_on_peer_exits_cleanly(tmp_path):
    proc = _start(["peer", "--host", "127.0.0.1", "--run-dir", str(tmp_path), "--steps", "100000", *TINY],
                  tmp_path / "peer.log")
    try:
        wait_for(lambda: (tmp_path / "metrics.jsonl").exists() and "train" in (tmp_path / "metrics.jsonl").read_text(),
                 60, what="first metrics")
    finally:
        rc = _stop(proc, signal.SIGINT, timeout=30)
    assert rc == 0
    assert json.loads((tmp_path / "summary.json").read_text())["peers"][0]["inner_steps"] > 0
