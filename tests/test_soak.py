"""`bench soak` in small: a few minutes of a 3-peer swarm under churn (bench/soak.py). After each kill (SIGKILL of a
peer and all it started, restart with --resume) and each stop (SIGTERM, resume), the peer's processes hold as many
file descriptors, threads and child processes as before, and no socket file of a dead daemon is left; after the
run nothing of it is left.

A few minutes long: marked `soak`, skipped in the default run and run by .ci/run in a step of its own."""

import os
import random
from types import SimpleNamespace

import pytest
from rich.console import Console

from p2pdiloco.bench.soak import EVENTS, Schedule, Soak, bench_soak
from p2pdiloco.bench.soakprobe import (
    COUNT_LIMIT,
    flatness,
    floor_points,
    robust_slope_per_hour,
    slope_per_hour,
)

P2PD_SLACK = {"p2pd.threads": 4, "p2pd.fds": 4}
"""p2pd's counts move with its traffic. It is a Go program: the runtime starts an OS thread for each goroutine blocked
in a system call and keeps idle ones a while. Each open stream to a client is a socket of its own, so a sample taken
during a merge holds a few more descriptors than one taken between merges (30 against 22 in 60-minute soaks)."""


@pytest.mark.soak
@pytest.mark.timeout(900)
def test_counts_return_to_their_level_after_each_kill_and_stop(tmp_path):
    quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115 - closed with the test process
    r = bench_soak(tmp_path, minutes=2, peers=3, event_s=20, sample_s=8, console=quiet)
    cycles = [lv for lv in r["levels"] if "growth" in lv]
    assert {lv["event"] for lv in cycles} == {"kill", "term"}, r["levels"]  # each kind came back at least once
    for lv in cycles:
        for key, growth in lv["growth"].items():
            # A leak is growth: a count lower after the restart than in the sample before it (taken, say, while a
            # merge held streams open) has returned to its level.
            assert growth <= P2PD_SLACK.get(key, COUNT_LIMIT), (lv["event"], key, lv["before"], lv["after"])
        assert lv["after"]["sockets_ours_stale"] == 0, lv  # the restart removed what the killed daemon left
    assert r["after"]["processes"] == []
    assert (r["after"]["ours"], r["after"]["ours_stale"]) == (0, 0)
    assert r["after"]["shm"] <= r["before"]["shm"]
    assert r["final_models_identical_at_end"] and r["unscheduled_exits"] == {}, r["unscheduled_exits"]
    assert (tmp_path / "soak.json").exists() and (tmp_path / "soak-pss.png").exists()


def test_a_peer_that_ends_outside_the_schedule_is_noted_once_and_counted_as_gone():
    def peer(name, returncode, restart_at=None):
        return SimpleNamespace(name=name, proc=SimpleNamespace(poll=lambda: returncode), restart_at=restart_at)

    soak = Soak.__new__(Soak)  # only the bookkeeping: no swarm
    soak.t0, soak.stopping, soak.events = 0.0, {"peer3": 1.0}, [{"event": "leave", "peer": "peer4", "at_s": 1.0}]
    soak.peers = [peer("peer0", None), peer("peer1", -9, restart_at=5.0), peer("peer2", -9), peer("peer3", 0),
                  peer("peer4", 0)]  # running, killed by the schedule, killed from outside, stopping, left
    soak._unscheduled_exits()
    soak._unscheduled_exits()
    assert [(e["event"], e["peer"], e.get("returncode")) for e in soak.events[1:]] == [("exit", "peer2", -9)]


def test_an_hour_of_events_has_several_leaves_each_of_a_live_joiner_and_still_kills_stops_and_joins():
    schedule = Schedule.for_minutes(60)
    n_events = int(schedule.total_s // schedule.event_s) - 1  # the first at one event_s, none at the end
    hour = [EVENTS[k % len(EVENTS)] for k in range(n_events)]
    live_joiners = 0
    for kind in hour:
        if kind == "leave":
            assert live_joiners > 0, hour  # a leave stops a joiner, never nothing
        live_joiners += {"join": 1, "leave": -1}.get(kind, 0)
    assert hour.count("leave") >= 4 and hour.count("kill") >= 2 and "term" in hour, hour
    assert {"kill", "term"} <= set(EVENTS[:4])  # the 2-minute soak's 4 events bring back a kill and a stop


def test_the_robust_slope_ignores_a_few_spikes_and_its_interval_covers_the_true_slope_of_swinging_memory():
    line = [(t * 30.0, 200 + t * 30 / 3600 + (30 if t in (80, 90, 95) else 0)) for t in range(100)]  # 1 MB/h
    assert robust_slope_per_hour(line)["theil_sen"] == pytest.approx(1.0, abs=1e-6)
    assert abs(slope_per_hour(line) - 1.0) > 0.1  # the spikes move the least-squares slope

    rng = random.Random(7)
    covered = naive_covered = 0
    for _ in range(200):  # memory that swings and stays up or down a while: lag-1 autocorrelation 0.8
        e, pts = 0.0, []
        for t in range(100):
            e = 0.8 * e + rng.gauss(0, 5)
            pts.append((t * 30.0, 200 + 2.0 * t * 30 / 3600 + e))
        r = robust_slope_per_hour(pts)
        covered += abs(slope_per_hour(pts) - 2.0) <= r["ci95"]
        naive_covered += abs(slope_per_hour(pts) - 2.0) <= r["ci95"] * ((1 - r["lag1"]) / (1 + r["lag1"])) ** 0.5
    assert covered >= 0.88 * 200, covered  # 9 in 10 or more hold the true slope (r read from 100 points is a little low)
    assert naive_covered < 0.8 * 200, naive_covered  # unwidened they would hold it far less often
    assert robust_slope_per_hour(line[:3]) is None


def test_the_limit_judges_the_floor_a_sawing_process_returns_to_and_still_catches_a_leak_under_the_saw():
    """A peer's main process: 100 MB between merges, up to 135 while a merge's buffers are held (half the samples),
    sampled every 30 s for 50 minutes at whatever point of the saw. Every sample's least-squares slope reads the saw's phase; the
    slope of the 5-minute low-water marks reads the floor: flat, or growing with a leak of 3 MB/h beneath it."""
    rng = random.Random(3)
    for leak in (0.0, 3.0):
        samples, worst_all = [], 0.0
        for run in range(20):
            pts = [(t, 100 + leak * t / 3600 + (rng.uniform(0, 35) if rng.random() < 0.5 else 0.0))
                   for t in range(600, 3600, 30)]
            worst_all = max(worst_all, abs(slope_per_hour(pts) - leak))
            floor = slope_per_hour(floor_points(pts))
            assert floor == pytest.approx(leak, abs=1.0), (leak, run, floor)
            samples = pts
        assert worst_all > 4.0  # some runs' every-sample slopes were off by twice the limit
    assert len(floor_points(samples)) == 10 and floor_points(samples[:-6]) == floor_points(samples)[:-1]  # a window 4/10 full: left out

    def proc(mb):
        return {"pid": 1, "pss": mb * 1e6, "uss": mb * 1e6, "anon": mb * 1e6, "fds": 20, "threads": 9, "children": 1}

    sawing = [{"elapsed_s": t, "trees": {"peer0": {"main": proc(v)}}} for t, v in samples]  # the last run: leaking
    row = flatness(sawing, 600)[0]
    assert row["pss_floor_mb_per_h"] == pytest.approx(3.0, abs=1.0) and row["ok"] is False


def test_a_process_restarted_late_is_judged_after_its_own_warm_up():
    """A resumed peer's new process loads and faults in its pages as the first one did: its warm-up is its own, not
    the run's, or a restart 20 minutes into an hour reads as a leak of 20+ MB/h."""

    def proc(pid, mb):
        return {"pid": pid, "pss": mb * 1e6, "uss": mb * 1e6, "anon": mb * 1e6, "fds": 20, "threads": 9, "children": 1}

    def warming(t, born):  # 100 MB flat, after 40 MB taken over its first 10 minutes
        return 100 + min(t - born, 600) / 600 * 40

    samples = [{"elapsed_s": t, "trees": {"peer0": {"main": proc(1, warming(t, 0))},
                                          "peer2": {"main": proc(2 if t < 1200 else 3, warming(t, 0 if t < 1200 else 1200))}}}
               for t in range(0, 3600, 30)]
    rows = {r["tree"]: r for r in flatness(samples, 600)}
    assert rows["peer0"]["from_s"] == 600 and rows["peer2"]["from_s"] == 1800
    for r in rows.values():
        assert r["judged"] and r["ok"] and r["pss_mb_per_h"] == pytest.approx(0.0, abs=1e-9), r
    run_wide = [(t, v / 1e6) for t, v in ((s["elapsed_s"], s["trees"]["peer2"]["main"]["pss"]) for s in samples)
                if t >= 1200]  # the same process from the run's warm-up on, its own included
    assert slope_per_hour(run_wide) > 20
