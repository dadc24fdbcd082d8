"""Round ends of a fixed step count brought together (network/phase.py, training/rounds.py): the README's run once
split into two pairs half a round apart that never met again (docs/benchmarks.md)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from p2pdiloco.config import Config, GuardConfig, RoundsConfig
from p2pdiloco.network.census import registered_now
from p2pdiloco.network.merger import Contribution
from p2pdiloco.network.phase import DEAD_ZONE, Phase, phase_of
from p2pdiloco.training.rounds import RoundClock
from tests.conftest import merge_config, running_mergers, wait_for

P = 12.8  # the README run's rounds: 50 steps of ~0.256 s


def test_a_mates_phase_is_taken_modulo_the_round_within_half_a_round_either_way():
    assert phase_of(106.0, 100.0, P) == pytest.approx(6.0)  # its round ended 6 s after ours
    assert phase_of(100.0 - P + 6.0, 100.0, P) == pytest.approx(6.0)  # the same, heard a round earlier
    assert phase_of(93.0, 100.0, P) == pytest.approx(5.8)  # 7 s before ours is nearer to 5.8 s after it
    assert phase_of(100.0 - 0.3, 100.0, P) == pytest.approx(-0.3)
    assert phase_of(100.0 - P + 0.3, 100.0, P) == pytest.approx(0.3)  # heard last round, 0.3 s behind us
    assert -P / 2 <= phase_of(100.0 + P / 2, 100.0, P) < P / 2


def two_round_ends(phase: Phase, now: float) -> None:
    phase._ends = [now - 2 * P, now - P]  # this peer's last round ends: its period is P


def test_two_pairs_half_a_round_apart_each_move_half_way_toward_the_other():
    a = Phase()  # peer A0; A1 ended with it; B2 and B3 ended 6 s later, last heard a round ago
    two_round_ends(a, 100.0)
    a.heard("a1", 100.1)
    a.heard("b2", 100.0 - P + 6.0)
    a.heard("b3", 100.0 - P + 6.2)
    # phases: A0 0, A1 +0.1, B2 +6.0, B3 +6.2: the median (0.1 + 6.0) / 2
    assert a.shift_s(P, now=100.0) == pytest.approx(3.05)
    b = Phase()  # peer B2, at its round end 6 s later
    two_round_ends(b, 106.0)
    b.heard("b3", 106.2)
    b.heard("a0", 100.0)
    b.heard("a1", 100.1)
    # phases: B2 0, B3 +0.2, A0 -6.0, A1 -5.9: the median (-5.9 + 0) / 2
    assert b.shift_s(P, now=106.0) == pytest.approx(-2.95)


def test_peers_that_meet_already_stay_put_and_a_lone_peer_never_moves():
    p = Phase()
    two_round_ends(p, 100.0)
    for i, t in enumerate((99.6, 100.3, 100.0 - P + 0.5)):  # within DEAD_ZONE * P = 0.8 s either way
        p.heard(f"m{i}", t)
    assert p.shift_s(P, now=100.0) == 0.0
    alone = Phase()
    two_round_ends(alone, 100.0)
    assert alone.shift_s(P, now=100.0) == 0.0
    assert Phase().shift_s(0.0, now=100.0) == 0.0  # no round length known: no shift


def test_one_peer_out_of_phase_among_four_does_not_move_the_others():
    p = Phase()
    two_round_ends(p, 100.0)
    p.heard("m1", 100.1)
    p.heard("m2", 99.9)
    p.heard("odd", 100.0 - P + 6.0)  # a slower peer, or one that lies about when it is looking
    assert p.shift_s(P, now=100.0) == 0.0  # median of [0, 0.1, -0.1, 6]: 0.05


def test_a_shifted_round_does_not_skew_the_round_length():
    p = Phase()
    p._ends = [0.0, P, 2 * P, 3 * P, 3 * P + P + 3.0]  # the last round was lengthened by 3 s
    assert p.period(fallback=99.0) == pytest.approx(P)
    now = 3 * P + P + 3.0 + P
    p.heard("m", now - P + 0.1)  # a mate last heard a round ago, 0.1 s after us
    assert p.shift_s(P + 3.0, now=now) == 0.0  # not +3 s as the shifted round's length would make it


def test_mates_not_heard_for_a_round_and_a_half_are_forgotten():
    p = Phase()
    two_round_ends(p, 100.0)
    p.heard("gone", 100.0 - 1.5 * P - 0.1)  # would read as a phase of -0.1 - P/2 ...
    p.heard("m", 100.0 - P + 5.0)
    assert p.shift_s(P, now=100.0) == pytest.approx(2.5)  # ... the median of [0, 5] alone


def simulate(rounds: int, shifts: bool, offsets=(0.0, 0.1, 6.0, 6.2), merge_s: float = 3.5) -> list[list[float]]:
    """Four equal-speed peers whose round ends start at `offsets`: each says it is looking when its round ends,
    takes its shift when its merge is over (`merge_s` later) and ends its next round a period (+ the shift) on.
    Returns each round's round ends."""
    phases = {i: Phase() for i in range(len(offsets))}
    ends = {i: 100.0 + o for i, o in enumerate(offsets)}
    history = []
    for i in phases:
        phases[i]._ends = [ends[i] - 2 * P, ends[i] - P]
    for _ in range(rounds):
        history.append(sorted(ends.values()))
        events = sorted([(t, "end", i) for i, t in ends.items()] + [(t + merge_s, "merged", i) for i, t in ends.items()])
        nxt = {}
        for t, kind, i in events:
            if kind == "end":
                for j in phases:
                    if j != i:
                        phases[j].heard(str(i), t)
            else:
                nxt[i] = ends[i] + P + (phases[i].shift_s(P, now=ends[i]) if shifts else 0.0)
        ends = nxt
    return history


def test_two_pairs_half_a_round_apart_meet_within_two_rounds_and_stay_together():
    split = simulate(8, shifts=False)
    assert all(r[-1] - r[0] == pytest.approx(6.2) for r in split)  # without the shift they never meet
    together = simulate(8, shifts=True)
    spread = [r[-1] - r[0] for r in together]
    assert spread[0] == pytest.approx(6.2)
    assert all(s <= DEAD_ZONE * P for s in spread[2:]), spread


def test_peers_together_are_not_set_ringing_by_each_others_jitter():
    history = simulate(10, shifts=True, offsets=(0.0, 0.3, -0.4, 0.6))
    assert all(r[-1] - r[0] == pytest.approx(1.0) for r in history)  # within the dead zone: nobody moves


def clock(round_steps: int = 50, round_seconds: float = 0.0) -> RoundClock:
    c = RoundClock(RoundsConfig(round_steps=round_steps, round_seconds=round_seconds), 0.0)
    c.start_round()
    return c


def test_a_shift_in_seconds_becomes_inner_steps_at_the_rounds_own_step_time():
    c = clock()
    c.round_started = time.monotonic() - 2.0  # 20 steps in 2 s: 0.1 s a step
    assert not c.round_over(20)
    c.shift(2.0)
    assert not c.round_over(69)
    assert c.round_over(70)  # 50 + 20
    c.start_round()  # the next round is the usual length again
    c.round_started = time.monotonic() - 1.0
    assert c.round_over(50)


def test_a_shift_is_at_most_half_a_round_either_way():
    c = clock()
    c.round_started = time.monotonic() - 1.0
    assert not c.round_over(10)
    c.shift(-100.0)
    assert not c.round_over(24)
    assert c.round_over(25)  # 50 - 25
    c.shift(+100.0)
    assert not c.round_over(74)
    assert c.round_over(75)


def test_timed_rounds_are_not_shifted():
    c = clock(round_seconds=3600.0)
    c.round_started = time.monotonic() - 1.0
    assert not c.round_over(10)
    c.shift(-3000.0)
    assert not c.round_over(10)  # still ends on the swarm-wide cadence, an hour of DHT time away


def drive(merger, cfg: Config, start_after: float, rounds: int, step_s: float, log: list) -> None:
    """A learner's round schedule without a model: a step every `step_s`, a round over per `RoundClock`, never
    while a merge is in flight, the merge's shift applied when its result lands (as Learner does)."""
    time.sleep(start_after)
    c = RoundClock(cfg.rounds, 0.0)
    c.start_round()
    steps, in_flight, submitted = 0, None, 0
    deadline = time.monotonic() + 120
    while len(log) < rounds and time.monotonic() < deadline:
        time.sleep(step_s)
        steps += 1
        if in_flight is not None and in_flight.done():
            result = in_flight.result()
            c.shift(merger.take_round_shift())
            log.append(len(result.stats.group))
            in_flight = None
        if in_flight is None and submitted < rounds and c.round_over(steps):
            in_flight = merger.submit(Contribution(
                pseudo_grad=torch.ones(64), weight=1.0, global_params=torch.zeros(64), momentum=torch.zeros(64),
                state_digest="same", state_weight=1.0, round=submitted, round_s=c.round_s()))
            submitted += 1
            c.start_round()
            steps = 0


@pytest.mark.integration
def test_real_peers_split_into_two_pairs_half_a_round_apart_merge_as_four_again(bootstrap_dht, net_loop):
    """Two pairs of real peers whose rounds end half a round apart, each waiting a quarter of a round for mates:
    without the shift each pair merges on its own for good (the README run's split); with it they are one group
    within a few rounds."""
    cfg = merge_config(run_id="phase", round_steps=20, window_fraction=0.25, min_window_s=0.2, merge_window_s=10,
                      merge_timeout_s=10, codec="none", group_size=8)
    logs: list[list[int]] = [[] for _ in range(4)]
    with running_mergers(bootstrap_dht, net_loop, 4, cfg, 64, guard=GuardConfig(aggregate="mean")) as mergers:
        # every census record stored (read through the bootstrap node: the mergers' own reads are counted)
        wait_for(lambda: len(net_loop.run(registered_now(bootstrap_dht, cfg.swarm.run_id, 5, cfg.merge.epoch_s), 10)) >= 4, 30,
                 what="every peer in the census")
        # rounds of 20 steps of 0.1 s: 2 s; windows of 0.5 s; the second pair starts 1 s after the first
        threads = [threading.Thread(target=drive, args=(m, cfg, 0.0 if i < 2 else 1.0, 14, 0.1, logs[i]))
                   for i, m in enumerate(mergers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=150)
    assert all(len(log) == 14 for log in logs), logs
    assert all(log[0] <= 2 for log in logs), logs  # split at first, as two pairs
    # then together (without the shift: pairs to the end, 0 of 4); a loaded machine may cost one round
    assert all(log[-4:].count(4) >= 3 for log in logs), logs
