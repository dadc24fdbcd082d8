"""Decoupled merging in real swarms: a frozen peer does not stall the others; a peer killed mid-merge
leaves no survivor with a partial average."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from p2pdiloco.bench.proctree import local_peers
from tests.conftest import interrupt_and_reap, wait_for
from tests.test_cli import TINY

pytestmark = pytest.mark.integration

# ~20 steps/s per peer whatever the core count, so rounds of 10 steps take ~0.5 s
PACED = [*TINY, "--set", "emulate.min_step_s=0.05", "--set", "rounds.round_steps=10", "--set", "run.eval_every_rounds=0",
         "--set", "swarm.heartbeat_s=1", "--set", "merge.merge_timeout_s=5"]


def merges(run_dir: Path, peer: str) -> list[dict]:
    path = run_dir / "peers" / peer / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if row.get("kind") == "merge":
            rows.append(row)
    return rows


def last_step(run_dir: Path, peer: str) -> int:
    path = run_dir / "peers" / peer / "metrics.jsonl"
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.endswith("}")]
    return max(steps, default=0)


def start_local(run_dir: Path, n: int, steps: int, extra=(), env=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "p2pdiloco", "local", "--peers", str(n), "--steps", str(steps), "--run-dir",
         str(run_dir), *PACED, *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=env,
    )


def peer_tree(local: subprocess.Popen, name: str) -> list[psutil.Process]:
    """The peer process `name` started by `local` (forked by its fork server), and everything it started (DHT
    process, p2pd)."""
    pid = local_peers(local.pid).get(name)
    if pid is None:
        raise AssertionError(f"no process for {name}")
    peer = psutil.Process(pid)
    return [peer, *peer.children(recursive=True)]


def test_frozen_peer_does_not_stall_the_others(tmp_path):
    local = start_local(tmp_path, 3, 100000)
    frozen: list[psutil.Process] = []
    try:
        wait_for(lambda: all(any(m["group_size"] == 3 for m in merges(tmp_path, f"peer{i}")) for i in range(3)),
                 90, what="a first merge of all three peers")
        frozen = peer_tree(local, "peer2")
        for p in frozen:
            p.suspend()  # SIGSTOP: the peer, its DHT process and its p2p daemon
        frozen_merges = len(merges(tmp_path, "peer2"))
        before = {i: (last_step(tmp_path, f"peer{i}"), len(merges(tmp_path, f"peer{i}"))) for i in range(2)}

        def others_progress_and_merge_in_pairs():
            for i in range(2):
                new = merges(tmp_path, f"peer{i}")[before[i][1]:]
                if sum(1 for m in new if m["group_size"] == 2 and not m["failure"]) < 3:
                    return False
            return True

        wait_for(others_progress_and_merge_in_pairs, 90, what="peers 0 and 1 merging as a pair while peer2 is frozen")
        for i in range(2):
            assert last_step(tmp_path, f"peer{i}") >= before[i][0] + 30  # their inner steps kept advancing
        assert len(merges(tmp_path, "peer2")) == frozen_merges  # it really was frozen
        for p in frozen:
            p.resume()
        frozen = []
        wait_for(lambda: any(m["group_size"] >= 2 and not m["failure"]
                             for m in merges(tmp_path, "peer2")[frozen_merges + 1:]),
                 90, what="peer2 merging with others again after SIGCONT")
    finally:
        for p in frozen:
            p.resume()
        interrupt_and_reap(local)


def test_peer_killed_mid_merge_leaves_no_partial_average(tmp_path):
    # peer2 SIGKILLs itself inside the all-reduce of its first group merge from round 3 on: it has received parts
    # from others and sent them nothing back, so both survivors are missing its averaged slice (round 3 exactly
    # missed once in a loaded suite: peer2 merged alone then, received no part, and every peer finished)
    env = {**os.environ, "P2PDILOCO_FAULTS": "peer2@serve_part:3+:kill"}
    local = start_local(tmp_path, 3, 120, env=env)
    try:
        assert local.wait(timeout=150) == 1  # one peer did not finish
    finally:
        interrupt_and_reap(local)
    survivors = [merges(tmp_path, f"peer{i}") for i in range(2)]
    for rows in survivors:
        (failed,) = [m for m in rows if m["failure"]]
        assert failed["group_size"] == 1 and not failed["adopted_state"]  # own update only, nothing partial
    # each survivor applied its own update, so their global models differ...
    failed_rounds = [next(m for m in rows if m["failure"]) for rows in survivors]
    assert failed_rounds[0]["global_digest"] != failed_rounds[1]["global_digest"]
    # ...until their next merge together, which averages the global models and makes them agree again
    after = [[m for m in rows if m["round"] > failed_rounds[k]["round"] and m["group_size"] == 2]
             for k, rows in enumerate(survivors)]
    assert after[0] and after[1]
    assert after[0][0]["adopted_state"] and after[0][0]["group_id"] == after[1][0]["group_id"]
    assert after[0][0]["global_digest"] == after[1][0]["global_digest"]


def test_a_fault_planned_from_a_round_on_fires_once_at_the_first_chance(monkeypatch):
    from p2pdiloco.testing.faults import faults_from_env

    monkeypatch.setenv("P2PDILOCO_FAULTS", "peer2@serve_part:3+:kill,peer2@exchange:5:stall,peer1@exchange:1:kill")
    faults = faults_from_env("peer2")
    assert faults == {("serve_part", "3+"): "kill", ("exchange", 5): "stall"}
    assert faults._onward("serve_part", 2) == ""  # before round 3
    assert faults._onward("exchange", 7) == ""  # an exact round is not "from round 5 on"
    assert faults._onward("serve_part", 4) == "kill"  # round 3 was missed (a merge alone): the next one
    assert faults._onward("serve_part", 5) == ""  # once
