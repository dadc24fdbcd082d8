"""Peers behind NAT merge, in the WAN lab's namespaces: two homes behind NAT routers (they can dial out, nobody can
dial in) and one reachable home, each running `p2pdiloco peer` against a bootstrap node in the hub. The NATed
peers learn that nobody can dial them and say so, never lead, and merge with the reachable peer and with each
other through it; all end on one global model. Root, iptables and NetfilterQueue (see tests/test_wanlab.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from p2pdiloco.bench.nsswarm import merge_rows, run_swarm
from p2pdiloco.bench.wanlab import HUB_ADDR, LAN, WanLab
from p2pdiloco.config import load_config, parse_set

pytestmark = [pytest.mark.integration, pytest.mark.lab]

SETS = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "data.batch_size=4",
        "data.max_bytes=200000", "emulate.min_step_s=0.2", "rounds.round_seconds=2", "merge.merge_window_s=6",
        "run.checkpoint_every=0", "run.eval_batches=2", "run.total_steps=60", "swarm.run_id=nat-merge"]


def _log(run: Path, i: int) -> str:
    return (run / "peers" / f"peer{i}" / f"peer{i}.log").read_text()


@pytest.mark.parametrize("codec", ["int4", "sparseloco"])
def test_peers_behind_nat_say_so_never_lead_and_merge_through_a_reachable_peer(tmp_path, codec):
    """int4's sliced all-reduce (the NATed peers own no slice) and sparseloco's all-gather (their parts reach each
    other through the reachable peer, checked against the notice's digests)."""
    sets = SETS + [f"codec.name={codec}", f"swarm.run_id=nat-merge-{codec}"]
    cfg = load_config(None, [parse_set(sets)])
    with WanLab([LAN, LAN, LAN], nat=[True, True, False], tag="natm") as lab:
        summary = run_swarm(lab.hub, HUB_ADDR, [(h.ns, h.addr) for h in lab.homes], cfg, sets, tmp_path,
                            timeout_s=240, bootstrap_port=31339)
    for i in (0, 1):  # behind NAT
        log = _log(tmp_path, i)
        assert "others cannot dial this peer" in log and "could not connect to" in log, log[-3000:]
        assert "leading merge group" not in log
    assert "reachable: " in _log(tmp_path, 2) and "others cannot dial" not in _log(tmp_path, 2)
    for i in (0, 1):
        merges = merge_rows(tmp_path / "peers" / f"peer{i}" / "metrics.jsonl")
        in_groups = [m for m in merges if m.get("group_size", 1) >= 2]
        assert len(in_groups) >= len(merges) // 2 >= 1, [m.get("group_size") for m in merges]
        # with the other NATed peer, which neither could ever dial: through the reachable one, as a group of 3
        assert any(m["group_size"] == 3 for m in in_groups)
    assert summary["global_models_identical"], json.dumps(summary)[:2000]
