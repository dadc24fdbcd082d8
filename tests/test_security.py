"""Private swarms, config fingerprints and guards, with real hivemind DHTs and p2p daemons on loopback."""

from __future__ import annotations

import json
import logging
import stat
import subprocess
import sys

import pytest
import torch
from hivemind.utils.timed_storage import get_dht_time

from p2pdiloco.algorithm.guards import DIRECTION, NONFINITE, NORM
from p2pdiloco.algorithm.outer import weighted_average
from p2pdiloco.cli import main
from p2pdiloco.config import GuardConfig, load_config, parse_set
from p2pdiloco.network.merger import Contribution
from p2pdiloco.network.p2p_merger import P2PMerger
from p2pdiloco.network.state_sync import GlobalState, StateError, StateSync
from p2pdiloco.network.swarm import (
    SwarmError,
    check_fingerprint,
    peers_key,
    read_subkeys,
    start_dht,
    swarm_auth,
    write_subkey,
)
from p2pdiloco.network.swarm_key import SwarmKeyError, load_key, write_new_key
from p2pdiloco.network.wire import ByteCounter, WireError
from p2pdiloco.testing.hostile import corrupt
from tests.conftest import flat, interrupt_and_reap, merge_config, wait_for, with_swarm

pytestmark = pytest.mark.integration
N = 1001
BIG = 20_001
"""Long enough that pure noise's cosine to the median (~1/sqrt(slice length)) is far below guard.min_cosine."""


def _contribution(vec: torch.Tensor, weight: float = 1.0) -> Contribution:
    return Contribution(pseudo_grad=vec, weight=weight, global_params=vec * 10, momentum=vec * 100,
                        state_digest="same", state_weight=1.0)


def test_keygen_writes_a_private_key_and_never_overwrites(tmp_path):
    path = tmp_path / "swarm.key"
    assert main(["keygen", str(path)]) == 0  # in-process: a subprocess would spend seconds importing hivemind
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(load_key(path)) == 32
    with pytest.raises(SwarmKeyError, match="refusing to overwrite"):
        write_new_key(path)
    (tmp_path / "bad.key").write_text("not a key")
    with pytest.raises(SwarmKeyError, match="not a swarm key"):
        load_key(tmp_path / "bad.key")


def test_keygen_where_no_file_can_be_written_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "a-file").write_text("x")
    assert main(["keygen", str(tmp_path / "a-file" / "swarm.key")]) == 2  # its parent is a file, not a folder
    err = capsys.readouterr().err
    assert "cannot write a swarm key to" in err and "Traceback" not in err and err.count("\n") == 1


@pytest.fixture
def keyed_swarm(tmp_path, net_loop):
    """A keyed bootstrap node, two keyed peers (mergers + state servers) and one stranger without the key."""
    key = str(write_new_key(tmp_path / "swarm.key"))
    keyed = merge_config(run_id="priv", host="127.0.0.1", swarm_key=key, merge_window_s=8, merge_timeout_s=4)
    boot = start_dht(keyed.swarm)
    maddrs = [str(m) for m in boot.get_visible_maddrs()]
    joined = with_swarm(keyed, initial_peers=maddrs)
    stranger_cfg = with_swarm(joined, swarm_key="")
    dhts = [start_dht(joined.swarm), start_dht(joined.swarm), start_dht(stranger_cfg.swarm)]
    auths = [swarm_auth(joined.swarm), swarm_auth(joined.swarm), swarm_auth(stranger_cfg.swarm)]
    cfgs = [joined, joined, stranger_cfg]
    mergers = [P2PMerger(d, c, net_loop, N, auth=a) for d, c, a in zip(dhts, cfgs, auths, strict=True)]
    state = GlobalState(torch.arange(N, dtype=torch.float32), torch.ones(N), 3, 30, 300.0)
    syncs = [StateSync(d, "priv", N, lambda: state, ByteCounter(), auth=a) for d, a in zip(dhts, auths, strict=True)]
    for s in syncs:
        net_loop.run(s.start(), 10)
    try:
        yield {"dhts": dhts, "mergers": mergers, "syncs": syncs, "state": state}
    finally:
        for m in mergers:
            m.close()
        for d in [*dhts, boot]:
            d.shutdown()


def test_peer_without_the_swarm_key_cannot_merge_fetch_state_or_write_records(keyed_swarm, net_loop, caplog):
    dhts, mergers, syncs = keyed_swarm["dhts"], keyed_swarm["mergers"], keyed_swarm["syncs"]
    a, b, stranger = mergers
    ids = [m.peer_id for m in mergers]
    # DHT records: the stranger's heartbeat is refused by every keyed node; keyed ones are seen
    for d, i in zip(dhts, ids, strict=True):
        net_loop.run(write_subkey(d, peers_key("priv"), i, {"step": 1}, get_dht_time() + 60), 10)
    seen = wait_for(lambda: (r := net_loop.run(read_subkeys(dhts[1], peers_key("priv")), 10)).keys() >= set(ids[:2]) and r,
                    timeout=20, what="both keyed records")
    assert ids[2] not in seen
    # state: refused to the stranger, served to a keyed peer (bit-exact)
    with pytest.raises((WireError, StateError)):
        net_loop.run(syncs[2].fetch_from(ids[0], timeout=5), 10)
    got = net_loop.run(syncs[1].fetch_from(ids[0], timeout=5), 10)
    assert torch.equal(got.global_params, keyed_swarm["state"].global_params)
    # a keyed peer does not take state from a stranger either (its reply carries no valid tag)
    with pytest.raises((WireError, StateError)):
        net_loop.run(syncs[0].fetch_from(ids[2], timeout=5), 10)
    # merges: the stranger's requests are refused outright (the keyed peer says so, and sends no reply); keyed
    # peers merge together
    def refused(op: str) -> bool:
        return any(f"refused a {op} request from {ids[2][-8:]}: no valid swarm key" in r.getMessage()
                   for r in caplog.records)

    with caplog.at_level(logging.WARNING, logger="p2pdiloco.network.rpc"):
        with pytest.raises(WireError, match="stream closed mid-message"):
            net_loop.run(stranger.rpc.call(ids[0], "invite", {"group_id": "x"}), 10)
        wait_for(lambda: refused("invite"), timeout=10, what="the invite refused")
        with pytest.raises(WireError, match="stream closed mid-message"):
            net_loop.run(stranger.rpc.call(ids[0], "part", {"group_id": "x", "tag": "d", "index": 0}, b"\0" * 8), 10)
        wait_for(lambda: refused("part"), timeout=10, what="the part refused")
    vecs = [torch.full((N,), float(i + 1)) for i in range(3)]
    futures = [m.submit(_contribution(v)) for m, v in zip(mergers, vecs, strict=True)]
    results = [flat(f.result(timeout=60)) for f in futures]
    assert sorted(results[0].group) == sorted(ids[:2]) and results[0].failure == ""
    assert torch.equal(results[0].pseudo_grad, results[1].pseudo_grad)
    torch.testing.assert_close(results[0].pseudo_grad, torch.full((N,), 1.5))
    assert results[2].alone


def test_peer_with_a_different_codec_or_outer_lr_is_refused_naming_it():
    mine = load_config(None, [parse_set(["codec.name=int8"])]).fingerprint()
    theirs = load_config(None, [parse_set(["outer.lr=0.5"])]).fingerprint()
    with pytest.raises(SwarmError) as e:
        check_fingerprint(mine, {"peerXYZ": {"fingerprint": theirs}})
    assert "codec.codec: 'int8' here, 'int4' in the swarm" in str(e.value)
    assert "outer.lr: 0.7 here, 0.5 in the swarm" in str(e.value)


@pytest.fixture
def four_mergers(bootstrap_dht, net_loop):
    from tests.conftest import running_mergers

    # fp32, no error feedback: each kind below is judged on what it sends in that round alone
    cfg = merge_config(run_id="g", merge_window_s=8, merge_timeout_s=4, codec="none")
    with running_mergers(bootstrap_dht, net_loop, 4, cfg, BIG, guard=GuardConfig(ban_after=0, min_cosine=0.1)) as ms:
        yield ms


def test_each_hostile_kind_is_rejected_in_a_real_merge_and_the_members_agree(four_mergers):
    gen = torch.Generator().manual_seed(0)
    common = torch.randn(BIG, generator=gen)
    hostile = four_mergers[3]
    for kind in ["nan", "scale", "noise", "signflip"]:
        honest = [common + 0.5 * torch.randn(BIG, generator=gen) for _ in range(3)]
        sent = [*honest, corrupt(common, kind, gen)]
        before = [m.book.report()["rejected"] for m in four_mergers[:3]]
        futures = [m.submit(_contribution(v)) for m, v in zip(four_mergers, sent, strict=True)]
        results = [flat(f.result(timeout=60)) for f in futures]
        assert hostile.peer_id in results[0].group and len(results[0].group) == 4
        for r in results:
            assert r.failure == "" and torch.equal(r.pseudo_grad, results[0].pseudo_grad)  # every member agrees
        # each honest owner left the hostile part of its slice out, and counted it
        got = [m.book.report()["rejected"] - b for m, b in zip(four_mergers[:3], before, strict=True)]
        assert got == [1, 1, 1], (kind, got, [m.book.report() for m in four_mergers])
        assert sum(r.rejected for r in results[:3]) >= 3
        # and told each member whether its own part counted: the hostile part entered at most its own owner's
        # slice (5001 of the 20,001 values), every honest part all of them
        assert [r.own_kept for r in results[:3]] == [1.0, 1.0, 1.0]
        assert results[3].own_kept <= 5001 / BIG
        avg = results[0].pseudo_grad
        assert torch.isfinite(avg).all()
        assert float(torch.nn.functional.cosine_similarity(avg, weighted_average(honest, [1, 1, 1]), dim=0)) > 0.99
    for m in four_mergers[:3]:
        assert set(m.book.report()["rejected_by_reason"]) == {NONFINITE, NORM, DIRECTION}


def test_local_swarm_with_a_hostile_peer_still_learns(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "p2pdiloco", "local", "--peers", "3", "--hostile", "0:scale", "--steps", "20",
           "--run-dir", str(run_dir), "--sync", "--set", "rounds.round_steps=5", "--set", "model.d_model=32",
           "--set", "model.n_layer=1", "--set", "model.seq_len=32", "--set", "data.batch_size=4",
           "--set", "data.max_bytes=1000000", "--set", "run.eval_every_rounds=0", "--set", "run.eval_batches=4",
           "--set", "run.checkpoint_every=0", "--set", "guard.ban_after=0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert proc.wait(timeout=150) == 0
    finally:
        interrupt_and_reap(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    honest = [p for p in summary["peers"] if p["name"] != "peer0"]
    for p in honest:
        assert p["eval_loss_final"] < p["eval_loss_initial"] - 0.3
        assert p["guard"]["rejected_by_reason"].get(NORM, 0) >= 3  # one per merge at least, counted
        assert p["merges"] >= 3
