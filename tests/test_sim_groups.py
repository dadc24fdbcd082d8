"""`p2pdiloco simulate`'s decoupled model of the shipped protocol: its defaults, groups dealt per epoch, agreements,
`outer.land_wait` and `outer.rebase_keep`, merges longer than a round, and its consensus figures beside bench scale's."""

from __future__ import annotations

import dataclasses

import pytest

from p2pdiloco.config import Config
from p2pdiloco.network import census
from p2pdiloco.network.census import my_group
from p2pdiloco.sim.groups import RUN_ID, agreement, deal, leader_rank
from p2pdiloco.sim.presets import preset
from p2pdiloco.sim.scenario import Protocol, Scenario
from p2pdiloco.sim.simulate import run_algorithm

SHIPPED = {"round_seconds": ("rounds", "round_seconds"), "round_steps": ("rounds", "round_steps"),
           "window_fraction": ("merge", "window_fraction"), "min_window_s": ("merge", "min_window_s"),
           "merge_window_s": ("merge", "merge_window_s"), "group_size": ("merge", "group_size"),
           "epoch_s": ("merge", "epoch_s"), "state_anchors": ("merge", "state_anchors"),
           "land_wait": ("outer", "land_wait"), "rebase_keep": ("outer", "rebase_keep"), "eager": ("outer", "eager")}


def test_protocol_settings_default_to_the_shipped_config_and_the_volunteers_preset_keeps_them():
    cfg = Config()
    for scn in (Scenario(), preset("volunteers")):
        for key, (section, name) in SHIPPED.items():
            assert getattr(scn.protocol, key) == getattr(getattr(cfg, section), name), key
        assert scn.network.codec == cfg.codec.name
    assert set(SHIPPED) | {"sync_window_s", "record_ttl_s", "checkpoint_every_steps", "checkpoint_s",
                           "elastic_units"} == {f.name for f in dataclasses.fields(Protocol)}


def test_groups_are_dealt_as_census_my_group_deals_them():
    peers = [f"peer{i}" for i in range(37)]
    for epoch in (0, 1, 57):
        groups = deal(peers, epoch, 8)
        assert len(groups) == 5 and max(map(len, groups)) - min(map(len, groups)) <= 1
        for g in groups:
            for me in g:
                assert my_group(RUN_ID, me, [p for p in peers if p != me], epoch, 8) == g
    assert deal(peers, 0, 8) != deal(peers, 1, 8)  # redrawn every epoch


def test_the_simulators_leader_rank_is_the_census_one():
    for peer, epoch in (("0", 0), ("peer17", 3), ("12D3KooWabc", 123456)):
        assert leader_rank(RUN_ID, peer, epoch) == census.leader_rank(RUN_ID, peer, epoch)


def test_an_agreement_moves_only_what_differs():
    s = Scenario()
    p = s.network.params
    assert agreement(s, [3, 3, 3], [[3]] * 3) == ("none", [0.0] * 3, 0)
    kind, sent, phases = agreement(s, [3, 3, 3, 5], [[3], [3], [3], [5]])  # a majority: the other fetches its model
    assert (kind, phases, sum(sent), sum(x > 0 for x in sent)) == ("catch_up", 1, 8.0 * p, 1)
    kind, sent, _ = agreement(s, [1, 2, 3, 4], [[0, 1], [0, 2], [0, 3], [0, 4]])  # anchor 0: int8 differences
    assert kind == "anchored" and sent[0] == pytest.approx(2 * 3 / 4 * 2 * p, rel=1e-3)
    kind, sent, phases = agreement(s, [1, 2, 3, 4], [[1], [2], [3], [4]])  # no anchor: two int8 exchanges
    assert (kind, phases) == ("two_exchanges", 2) and sent[0] == pytest.approx(2 * 3 / 4 * 3 * p, rel=1e-3)


def pair(merge_s: float, land_wait: float, rebase_keep: float, round_seconds: float = 2.0) -> Scenario:
    """Two equal learners whose group merges take `merge_s` (all of it matchmaking: no bytes, no latency)."""
    s = Scenario()
    s.run.learners, s.run.duration_s, s.run.algorithms = 2, 60.0, ["decoupled"]
    s.failures.first_start_s = 0.0
    s.network.matchmaking_s, s.network.latency_s, s.network.bandwidth_gbps = merge_s, 0.0, 1e12
    s.protocol.round_seconds, s.protocol.round_steps = round_seconds, 10
    s.protocol.land_wait, s.protocol.rebase_keep = land_wait, rebase_keep
    return s.validate()


def test_land_wait_and_rebase_keep_cost_what_the_learner_gives_up():
    assert run_algorithm(pair(0.35, 0.0, 1.0), "decoupled")["goodput"] == pytest.approx(1.0)
    # A 0.35 s merge outlasts the 0.1 s wait (5 % of a 2 s round), then lands 3 steps of 0.1 s later: half of them
    # given up. Each round loses 0.1 + 0.15 s of its 2 s.
    r = run_algorithm(pair(0.35, 0.05, 0.5), "decoupled")
    assert r["goodput"] == pytest.approx(1 - 0.25 / 2, abs=0.01)
    # A 0.05 s merge lands within the wait: nothing is in flight, only the wait is lost.
    assert run_algorithm(pair(0.05, 0.05, 0.5), "decoupled")["goodput"] == pytest.approx(1 - 0.05 / 2, abs=0.01)


def test_a_merge_longer_than_a_round_lengthens_the_next_one():
    # step rounds of 10 × 0.1 s, merges of 2.5 s: no submit while one is in flight, so a round lasts 2.5 s
    r = run_algorithm(pair(2.5, 0.0, 1.0, round_seconds=0.0), "decoupled")
    assert r["rounds"] == pytest.approx(2 * 60 / 2.5, abs=2) and r["goodput"] == pytest.approx(1.0)
    half = run_algorithm(pair(2.5, 0.0, 0.5, round_seconds=0.0), "decoupled")
    assert half["goodput"] == pytest.approx(0.5, abs=0.03)  # every step is taken while a merge is in flight


def swarm(n: int, step_s: float, round_s: float, epoch_s: float, steps: int) -> Scenario:
    """bench scale's swarm: steps padded to `step_s`, timed rounds, 10 s windows, groups of 8."""
    s = Scenario()
    s.compute.step_s = step_s
    s.protocol.round_seconds, s.protocol.merge_window_s, s.protocol.epoch_s = round_s, 10.0, epoch_s
    s.run.learners, s.run.total_steps, s.run.algorithms = n, steps, ["decoupled"]
    return s.validate()


def test_consensus_one_group_mixes_in_a_round_and_dealt_groups_wait_for_the_next_epoch():
    one = run_algorithm(swarm(8, 0.1, 2.0, 30.0, 600), "decoupled")
    assert one["mixing_rounds"] == pytest.approx(1.0, abs=0.1) and one["distinct_models_mean"] == 1.0
    split = run_algorithm(swarm(32, 0.1, 2.0, 30.0, 600), "decoupled")  # 4 groups redrawn every 15 rounds
    assert 2 <= split["mixing_rounds"] <= 16 and split["distinct_models_mean"] > 1
    often = run_algorithm(swarm(32, 0.1, 2.0, 2.0, 600), "decoupled")  # redrawn every round
    assert often["mixing_rounds"] < split["mixing_rounds"] and often["mixing_rounds"] <= 4
    assert one["final_models"] == split["final_models"] == 1  # the closing merges take everyone


# bench scale as docs/benchmarks.md records it. 1 s steps, 10 s rounds, 120 s epochs, 300 steps, at 7c7eb70: 4 peers
# 124 of 124 peer-merges in groups (100 %), 32 peers 99.5 %, identical final models, merge bytes a peer a round
# (sent + received) 377 kB at 32 and 377 / 1.93 = 195 kB at 4. The default setting (0.3 s steps, 3 s rounds, 30 s
# epochs, 350 steps): 8 peers at 56fb2c5 100 %, identical final models, 229.7 kB; 16 peers at d20f1e2 98.8 %, one
# final model.
BENCH_SCALE = [((4, 1.0, 10.0, 120.0, 300), 1.0, 195e3), ((32, 1.0, 10.0, 120.0, 300), 0.995, 377e3),
               ((8, 0.3, 3.0, 30.0, 350), 1.0, 229.7e3), ((16, 0.3, 3.0, 30.0, 350), 0.988, None)]


@pytest.mark.parametrize(("setting", "in_groups", "merge_bytes"), BENCH_SCALE)
def test_consensus_lands_near_bench_scale(setting, in_groups, merge_bytes):
    """Tolerances: merges in a group within 0.05, one final model, and merge bytes within 15 %."""
    r = run_algorithm(swarm(*setting), "decoupled")
    assert abs(r["in_group_share"] - in_groups) <= 0.05 and r["final_models"] == 1, r
    if merge_bytes is not None:  # a peer sends what it receives, summed over the swarm
        sent = r["delta_bytes_per_learner_round"] + r["agreement_bytes_per_learner_round"]
        assert abs(2 * sent / merge_bytes - 1) <= 0.15, sent
