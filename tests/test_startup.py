"""A peer's start-up (app/startup.py): the progress lines a person and `local` read, the DHT started beside the data
and model, a `startup` breakdown that adds up, the modules a headless peer imports before it trains, and a restart
that reads its tokens from the cache."""

from __future__ import annotations

import json
import multiprocessing
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2pdiloco.app.local import PeerProc, StartupLines
from p2pdiloco.app.startup import StartupClock, stage_of, start_in_thread
from p2pdiloco.training.tokenizer import train_bpe
from tests.test_cli import TINY
from tests.test_tokenizer import corpus

UNWANTED = ("matplotlib", "aiohttp", "bitsandbytes", "rich", "prometheus_client", "scipy.optimize._optimize", "torch._dynamo",
            "sympy")
"""Modules a headless peer must not have imported when it starts training (plots, dashboard, 8-bit optimizer,
display, /metrics, and the scipy that hivemind imports for a load balancer p2pdiloco never runs)."""


def test_stage_of_reads_the_progress_lines_of_a_peer_log():
    assert stage_of("07:42:01 INFO p2pdiloco.app.startup: start-up: importing torch and hivemind") == "importing"
    assert stage_of("07:42:04 INFO p2pdiloco.app.startup: start-up: DHT up in 0.6 s: peer 12D3KooW") == "DHT up"
    assert stage_of("07:42:08 INFO p2pdiloco.training.reporting: [7LNUqb] start-up: first inner step after 8.0 s") \
        == "training"
    assert stage_of("07:42:04 INFO p2pdiloco.app.startup: start-up: loaded data and model in 0.1 s") is None
    assert stage_of("07:42:08 INFO p2pdiloco.app.peer: [7LNUqb] 3 of 3 peers live; starting") is None


class _Proc:
    def __init__(self, returncode: int | None = None):
        self.returncode = returncode

    def poll(self) -> int | None:
        return self.returncode


def _peer(stage: str, returncode: int | None = None) -> PeerProc:
    peer = PeerProc("peer", Path("."), _Proc(returncode), None)
    peer.stage = stage
    return peer


def test_local_prints_what_its_peers_do_until_they_all_train():
    lines = StartupLines()
    peers = [_peer("importing"), _peer("importing")]
    assert lines.update(peers) == "peers starting: 2/2 importing"
    assert lines.update(peers) is None  # nothing new
    peers[0].stage = "DHT up"
    assert lines.update(peers) == "peers starting: 1/2 importing, 1/2 DHT up"
    peers[1].stage = peers[0].stage = "training"
    assert lines.update(peers) == "peers started: 2/2 training"  # once, to say the start-up is over
    peers[0].proc = _Proc(0)
    assert lines.update(peers) is None  # a peer that finished is no start-up news
    peers[0].proc, peers[0].stage = _Proc(None), "starting"  # restarted (local --chaos)
    assert lines.update(peers) == "peers starting: 1/2 starting, 1/2 training"
    # a short run: both trained and ended between two looks, one of them never seen training
    quick = StartupLines()
    peers = [_peer("waiting"), _peer("training")]
    assert quick.update(peers) == "peers starting: 1/2 waiting, 1/2 training"
    peers[0].proc, peers[0].stage, peers[1].proc = _Proc(0), "training", _Proc(0)
    assert quick.update(peers) == "peers started: 2/2 training"


def _fork_and_wait(seconds: float) -> None:
    """What the DHT's start does: fork its process, then wait for it."""
    child = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,))
    child.start()
    child.join(10)
    time.sleep(seconds)


def test_side_by_side_overlaps_its_parts_and_laps_each_one():
    clock = StartupClock(time.monotonic())

    def dht():
        _fork_and_wait(0.6)
        return "dht"

    def data():
        time.sleep(0.6)  # stands for loading data
        return "data"

    done, built = clock.side_by_side("both", ("dht", dht), {"data": data, "model": lambda: "model"},
                                     undo=lambda _: None)
    assert done == "dht" and built == {"data": "data", "model": "model"}
    lap = clock.laps["both"]
    assert set(lap) == {"wall", "dht", "data", "model"}
    assert max(lap["dht"], lap["data"]) <= lap["wall"] < lap["dht"] + lap["data"]  # at the same time, not in turn


def test_a_failed_part_raises_after_the_other_is_finished_and_undone():
    clock = StartupClock(time.monotonic())
    undone = []

    def broken():
        raise ValueError("no such data")

    with pytest.raises(ValueError, match="no such data"):
        clock.side_by_side("both", ("dht", lambda: "dht"), {"data": broken}, undo=undone.append)
    assert undone == ["dht"]  # a DHT that started is shut down, not left running

    def unreachable():
        raise RuntimeError("could not join")

    with pytest.raises(RuntimeError, match="could not join"):
        clock.side_by_side("both", ("dht", unreachable), {"data": lambda: "data"}, undo=undone.append)
    assert undone == ["dht"] and "both" not in clock.laps


def test_start_in_thread_returns_once_the_thread_has_forked():
    """The caller's own work must not run while the background thread forks (the child would inherit its locks)."""
    marks = {}

    def background() -> str:
        time.sleep(0.3)  # work before the fork, as the DHT's start has
        marks["fork"] = time.monotonic()
        _fork_and_wait(1.0)  # after the fork, the caller goes on meanwhile
        return "done"

    future = start_in_thread(background, "test-fork")
    assert time.monotonic() >= marks["fork"] and not future.done()
    assert future.result(timeout=20) == "done"
    # a thread that never forks is waited for to its end: nothing to overlap safely
    assert start_in_thread(lambda: "quick", "test-no-fork").done()


def test_a_headless_peer_imports_no_plots_dashboard_display_or_unused_scipy():
    code = f"""
import json, sys
import p2pdiloco.cli  # what `p2pdiloco peer` imports before its command runs
early = [m for m in ("torch", "hivemind") if m in sys.modules]
from p2pdiloco.app.startup import defer_unused_imports
defer_unused_imports()
import p2pdiloco.app.peer, p2pdiloco.app.summary
loaded = [m for m in {UNWANTED!r} if m in sys.modules]
from hivemind.averaging.load_balancing import load_balance_peers  # uses scipy.optimize: it loads when used
print(json.dumps({{"early": early, "loaded": loaded, "balanced": sum(load_balance_peers(100, [1.0, 3.0]))}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr[-2000:]
    # no torch before the command: the peer's first progress line comes before those seconds, not after
    assert json.loads(out.stdout.splitlines()[-1]) == {"early": [], "loaded": [], "balanced": 100}


FIRST_STEP_MODULES = f"""
import json, sys
from p2pdiloco.app.startup import defer_unused_imports
defer_unused_imports()  # as cmd_peer does, before what follows imports hivemind
import p2pdiloco.training.reporting as reporting
training_starts = reporting.Reporter.training_starts
def snapshot(self, eval_loss):
    print("modules at the first inner step: " + json.dumps([m for m in {UNWANTED!r} if m in sys.modules]),
          file=sys.stderr, flush=True)
    training_starts(self, eval_loss)
reporting.Reporter.training_starts = snapshot
from p2pdiloco.cli import main
sys.exit(main(sys.argv[1:]))
"""
"""`p2pdiloco peer ARGS` that also prints which of `UNWANTED` it had imported when it began training."""

PHASES = ("start-up: importing torch and hivemind", "start-up: loading data and building the model",
          "start-up: loaded data and model", "start-up: DHT up", "start-up: merger ready",
          "start-up: joining the swarm", "start-up: first inner step after")


def _in_order(text: str, needles: tuple[str, ...]) -> bool:
    at = 0
    for needle in needles:
        at = text.find(needle, at)
        if at < 0:
            return False
    return True


@pytest.mark.integration
def test_a_peer_says_each_phase_imports_little_and_a_restart_reads_the_token_cache(tmp_path):
    tok = train_bpe([p.read_text() for p in sorted(corpus(tmp_path / "data").iterdir())], 300,
                    tmp_path / "tokenizer.json", progress=lambda _: None)
    # the default codec (int4, plain torch): neither bitsandbytes nor torch._dynamo on the way to the first step
    args = ["peer", "--host", "127.0.0.1", "--run-dir", str(tmp_path / "run"), "--steps", "10", "--in-local",
            "--data", str(tmp_path / "data"), "--set", f"data.tokenizer={tok.path}", "--set", "model.vocab_size=300",
            "--set", f"data.cache_dir={tmp_path / 'cache'}",
            "--set", "run.checkpoint_every=1", "--set", "rounds.round_steps=5", *TINY]
    runs = []
    for extra in ([], ["--resume"]):
        out = subprocess.run([sys.executable, "-c", FIRST_STEP_MODULES, *args, *extra], capture_output=True,
                             text=True, timeout=150, stdin=subprocess.DEVNULL)
        assert out.returncode == 0, out.stderr[-3000:]
        assert _in_order(out.stderr, PHASES), out.stderr[-3000:]
        (modules,) = [line.split(": ", 1)[1] for line in out.stderr.splitlines() if "modules at the first" in line]
        assert json.loads(modules) == []
        runs.append(out)
    first, restart = runs
    assert "tokenizing" in first.stderr and "tokens from the cache" in restart.stderr  # keyed alike: a hit
    assert "resumed from" in restart.stdout

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    starts = [i for i, r in enumerate(rows) if r["kind"] == "start"]
    assert len(starts) == 2
    first_evals = []
    for i in starts:
        start, first_eval = rows[i], next(r for r in rows[i:] if r["kind"] == "eval")
        laps = start["startup"]
        assert list(laps) == ["interpreter_and_imports", "device_and_tokenizer", "dht_with_data_and_model", "merger",
                              "learner"]
        side = laps["dht_with_data_and_model"]
        assert set(side) == {"wall", "dht", "data_and_model"}
        assert max(side["dht"], side["data_and_model"]) <= side["wall"] + 1e-6
        # the phases in turn (a parallel one by its wall time) add up to the time before the start line
        in_turn = sum(v["wall"] if isinstance(v, dict) else v for v in laps.values())
        assert in_turn <= start["process_s"] < in_turn + 1.0
        assert first_eval["process_s"] >= start["process_s"]  # the whole start-up, to the first inner step
        first_evals.append(first_eval)
    summary = json.loads((tmp_path / "run" / "peer_summary.json").read_text())  # the restart's
    assert summary["first_step_s"] == pytest.approx(first_evals[-1]["process_s"])
    # the restart kept its peer id (its identity file, private), so peers that judged its parts still know it
    ids = [rows[i]["peer_id"] for i in starts]
    assert ids[0] == ids[1]
    assert stat.S_IMODE((tmp_path / "run" / "identity.key").stat().st_mode) == 0o600
    fresh = subprocess.run([sys.executable, "-m", "p2pdiloco", *args], capture_output=True, text=True, timeout=150,
                           stdin=subprocess.DEVNULL)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    fresh_ids = [r["peer_id"] for r in rows if r["kind"] == "start"]
    assert len(fresh_ids) == 1 and fresh_ids[0] != ids[0]  # a fresh run: a fresh id


@pytest.mark.integration
def test_local_peers_waiting_for_each_other_list_a_folder_not_the_census(bootstrap_dht, net_loop, tmp_path,
                                                                          monkeypatch):
    """`local`'s peers wait for each other through a shared folder (together.wait_for_peers): a peer whose census
    stored its registration says so with a file, with no read, and reads the census only once every peer has; the
    census, not the folder, says how many are live. Without the folder the census is read all along.

    Census reads take one node's copy (`near`) where a walk is not needed: a count whose copy holds every awaited
    peer; a copy short of the folder is counted again by a walk. The count and the peers it found are handed to the
    peer's matchmaking census: its view of the epoch, so that its first search there reads nothing."""
    import threading

    from hivemind.utils.timed_storage import get_dht_time

    from p2pdiloco.app import together
    from p2pdiloco.config import Config
    from p2pdiloco.network.census import epoch_of
    from tests.conftest import merge_config, running_mergers, wait_for

    reads = []
    real = together.read_census

    async def counted(*args, **kwargs):
        reads.append((time.monotonic(), kwargs.get("near", False)))
        return await real(*args, **kwargs)

    monkeypatch.setattr(together, "read_census", counted)
    swarm = merge_config(run_id="barrier", wait_for_peers=3, wait_for_peers_s=8)
    with running_mergers(bootstrap_dht, net_loop, 2, swarm, 8) as mergers:  # 2 of the 3 awaited are registered
        me = mergers[0]
        out = {}

        census = me.matchmaker.census
        assert census.size == 0  # no read yet

        def wait(cfg: Config, barrier: Path | None) -> None:
            out["live"] = together.wait_for_peers(net_loop, me.dht, cfg, me.peer_id, lambda: False, barrier, census)

        thread = threading.Thread(target=wait, args=(swarm, tmp_path), daemon=True)
        thread.start()
        wait_for(lambda: (tmp_path / me.peer_id).exists(), 20, what="the peer's file in the folder")
        told_after = len(reads)
        assert told_after == 0  # its registration was stored: nothing read to say so
        time.sleep(1.5)  # the window observed: the folder holds 1 file of 3
        assert thread.is_alive() and len(reads) == told_after, reads  # waiting, and not reading the census
        for other in ("second", "third"):
            (tmp_path / other).touch()
        thread.join(timeout=60)  # the census holds 2 peers, not 3: polled until the wait's deadline
        assert not thread.is_alive() and out["live"] == 2 and len(reads) > told_after
        kinds = [near for _, near in reads]
        assert kinds == [True, False] * (len(kinds) // 2), kinds  # copy short: walked
        assert census.size == 2  # the walks' count, handed over
        members = net_loop.run(census.members(epoch_of(get_dht_time(), swarm.merge.epoch_s)), 10)
        assert members == {m.peer_id for m in mergers} and census.counts()["walks"] == 0  # the walk's view, or a copy

        # two awaited, both registered: one node's copy that holds both decides, with no walk
        other, folder = mergers[1], tmp_path / "whole"
        folder.mkdir()
        (folder / me.peer_id).touch()
        reads.clear()
        epoch = epoch_of(get_dht_time(), swarm.merge.epoch_s)
        live = together.wait_for_peers(net_loop, other.dht, _startup(swarm, wait_for_peers=2),
                                       other.peer_id, lambda: False, folder, other.matchmaker.census)
        assert live == 2 and [near for _, near in reads] == [True] and other.matchmaker.census.size == 2
        # and the commitments it read, which the leader order of the next epoch is drawn from (leaders.py)
        assert other.matchmaker.census.commit(me.peer_id, epoch + 1) is not None
        counted = other.matchmaker.census.counts()["reads"]
        assert net_loop.run(other.matchmaker.census.members(epoch), 10) == {m.peer_id for m in mergers}
        if epoch == epoch_of(get_dht_time(), swarm.merge.epoch_s):  # the wait's read is the epoch's view
            assert other.matchmaker.census.counts()["reads"] == counted

        short = _startup(swarm, wait_for_peers_s=2.0)
        for folder in (None, tmp_path / "removed"):  # no folder, or one that is gone: the census all along the 2 s
            reads.clear()
            wait(short, folder)
            assert out["live"] == 2 and len(reads) >= 3, (folder, reads)


def _startup(cfg, **values):
    """`cfg` with the `[startup]` values given."""
    return cfg.model_copy(update={"startup": cfg.startup.model_copy(update=values)})


@pytest.mark.integration
def test_a_local_peer_does_not_start_before_its_own_file_is_in_the_folder(bootstrap_dht, net_loop, tmp_path):
    """A census read that holds every other awaited peer, but not this peer's own registration (still on its way),
    must not let it start: the others wait for its file in the folder. It starts once it has read itself there
    and said so (together.wait_for_peers)."""
    import threading

    from hivemind.utils.timed_storage import get_dht_time

    from p2pdiloco.app import together
    from p2pdiloco.network.census import Census, epoch_of
    from tests.conftest import merge_config, running_mergers, start_local_dht, wait_for

    swarm = merge_config(run_id="late-self", wait_for_peers=3, wait_for_peers_s=30)
    with running_mergers(bootstrap_dht, net_loop, 2, swarm, 8) as mergers:  # the 2 others are registered
        for m in mergers:
            (tmp_path / m.peer_id).touch()
        me = start_local_dht([str(a) for a in bootstrap_dht.get_visible_maddrs()])
        try:
            me_id, out = me.peer_id.to_base58(), {}
            thread = threading.Thread(daemon=True, target=lambda: out.setdefault("live", together.wait_for_peers(
                net_loop, me, swarm, me_id, lambda: False, tmp_path)))
            thread.start()
            time.sleep(1.5)  # the window observed: the census holds both others (3 with this peer), not this peer
            assert thread.is_alive() and not (tmp_path / me_id).exists()
            net_loop.run(Census(me, swarm.swarm.run_id, me_id, swarm.merge.epoch_s).register(epoch_of(get_dht_time(), swarm.merge.epoch_s)),
                         10)
            wait_for(lambda: not thread.is_alive(), 20, what="the wait's end once this peer is registered")
            assert out["live"] == 3 and (tmp_path / me_id).exists()
        finally:
            me.shutdown()
