"""The learner loop with an in-memory merger: no network, real model and optimizer."""

import dataclasses
import json
import threading
from concurrent.futures import Future

import pytest
import torch

from p2pdiloco.algorithm.outer import outer_step
from p2pdiloco.config import load_config, parse_set
from p2pdiloco.network.merger import Alone, Merged, MergeStats
from p2pdiloco.testing.inmemory import InMemoryMerger
from p2pdiloco.training import learner as learner_module
from p2pdiloco.training.checkpoint import load_latest
from p2pdiloco.training.evaluation import evaluate_model
from p2pdiloco.training.flat import load_flat_
from p2pdiloco.training.in_flight import LandWait
from p2pdiloco.training.learner import Learner
from p2pdiloco.training.model import build_model
from p2pdiloco.training.reporting import MetricsLog


def _cfg(**sets):
    items = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=16", "data.batch_size=4",
             "rounds.round_steps=5", "run.total_steps=20", "run.log_every=5", "inner.warmup_steps=2", "inner.lr=3e-3"]
    return load_config(None, [parse_set(items + [f"{k}={v}" for k, v in sets.items()])])


def _batches(seed):
    # a learnable pattern: repeating ramps, offset per peer
    g = torch.Generator().manual_seed(seed)

    def next_batch():
        start = torch.randint(0, 200, (4, 1), generator=g)
        seq = (start + torch.arange(17)) % 256
        return seq[:, :-1].long(), seq[:, 1:].long()

    return next_batch


def _learner(cfg, merger, tmp_path, seed):
    model = build_model(cfg.model)
    val = [_batches(99)() for _ in range(2)]
    metrics = MetricsLog(tmp_path / f"{merger.peer_id}.jsonl")
    return Learner(cfg, model, _batches(seed), val, merger, torch.device("cpu"), metrics)


def test_two_learners_merge_every_round_and_agree(tmp_path):
    # steps padded to 0.1 s: unpadded (a few ms each), p1's thread fell 15 steps behind p0's in CI under load; p0
    # reached its end with its first merge still waiting for p1, its last contribution met p1's second at step 11,
    # far from p1's end, so p1 went on alone, and the in-memory fake, which never times out, waited for a partner
    cfg = _cfg(**{"emulate.min_step_s": 0.1})
    hub = {"group_size": 2}
    learners = [_learner(cfg, InMemoryMerger(f"p{i}", hub), tmp_path, i) for i in range(2)]
    summaries = [None, None]

    def run(i):
        summaries[i] = learners[i].run()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(s is not None for s in summaries)
    for s in summaries:
        # decoupled: a round runs on while its merge is in flight, so a peer may reach its end in 3 rounds and
        # its mate, whose merge meets that last one, ends with it a little short of its end (`Learner.near_end`;
        # p0 at step 16 in CI at 56fb2c5). Every round is merged in the group of 2 all the same.
        assert s["inner_steps"] == 20 or (s["ended_with_swarm"] and s["inner_steps"] < 20), s
        assert 3 <= s["rounds"] <= 4 and s["merges"] == s["rounds"], s
        # the shared final model learned: 0.58-0.60 below the initial loss in 9 of 10 runs here, 0.475 in one run
        # under load where a peer ended with its mate at step 16 (0.494 in CI at 240a8e8, where 0.5 was asked)
        assert s["eval_loss_final"] < s["eval_loss_initial"] - 0.4
    assert max(s["inner_steps"] for s in summaries) == 20
    assert torch.equal(learners[0].global_params, learners[1].global_params)
    assert torch.equal(learners[0].momentum, learners[1].momentum)
    # the heartbeat record: what `status`, the dashboard and /metrics show of this peer
    record = learners[0].report.record()
    steps, rounds = summaries[0]["inner_steps"], summaries[0]["rounds"]
    assert record["step"] == steps and record["round"] == record["merges"] == rounds and record["tokens"] == steps * 4 * 16
    assert record["last_group_size"] == 2 and record["last_merge_time"] > 0 and record["tokens_per_s"] > 0
    assert record["eval_loss"] == summaries[0]["eval_loss_final"] and record["loss"] > 0


def test_apply_merge_does_outer_step_and_does_not_alias_global_params(tmp_path):
    cfg = _cfg()
    learner = _learner(cfg, InMemoryMerger("p0", {"group_size": 1}), tmp_path, 0)
    before = learner.global_params.clone()
    delta = torch.full_like(before, 0.01)
    learner.apply_merge(Merged(delta, 64.0))
    expected, _ = outer_step(before, torch.zeros_like(before), delta, 0.7, 0.9)
    assert torch.equal(learner.global_params, expected)
    assert learner.c.merges == 1 and learner.c.global_tokens == 64.0
    # inner steps must change the local model only; θg stays what the merge made it
    learner.inner_step()
    assert torch.equal(learner.global_params, expected)
    assert not torch.equal(learner._local_params(), expected)


def test_apply_merge_adopts_group_state_when_members_disagreed(tmp_path):
    cfg = _cfg()
    learner = _learner(cfg, InMemoryMerger("p0", {"group_size": 1}), tmp_path, 0)
    n = learner.global_params.numel()
    state = torch.cat([torch.full((n,), 0.5), torch.full((n,), 0.25)])
    zero = torch.zeros(n)
    learner.apply_merge(Merged(zero, 1.0, agreed_state=state))
    expected, m = outer_step(torch.full((n,), 0.5), torch.full((n,), 0.25), zero, 0.7, 0.9)
    assert torch.equal(learner.global_params, expected) and torch.equal(learner.momentum, m)


def test_load_flat_copies():
    model = torch.nn.Linear(2, 2)
    flat = torch.arange(6, dtype=torch.float32)
    load_flat_(model, flat)
    flat += 100
    assert model.weight.flatten().tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("keep", [None, 1.0])
def test_decoupled_apply_rebases_steps_taken_during_the_merge(tmp_path, keep):
    cfg = _cfg() if keep is None else _cfg(**{"outer.rebase_keep": keep})
    if keep is None:
        assert cfg.outer.rebase_keep == 0.5  # the default keeps half of them
    keep = cfg.outer.rebase_keep
    learner = _learner(cfg, InMemoryMerger("p0", {"group_size": 1}), tmp_path, 0)
    theta_g = learner.global_params.clone()
    at_submit = theta_g - 0.5  # the local model when Δ was taken
    now = at_submit + 0.25  # two more "inner steps" moved it by +0.25 meanwhile
    load_flat_(learner.model, now)
    learner.c.compute_in_round = 0.8  # those steps' seconds
    delta = torch.full_like(theta_g, 0.1)
    learner.apply_merge(Merged(delta, 1.0), at_submit)
    new_g, _ = outer_step(theta_g, torch.zeros_like(theta_g), delta, 0.7, 0.9)
    # θ ← θg' + keep·(θ − θ_at_submit) = θg' + keep·0.25
    torch.testing.assert_close(learner._local_params(), new_g + keep * 0.25)
    assert torch.equal(learner.global_params, new_g)
    assert learner.c.rebase_dropped_s == pytest.approx(0.8 * (1 - keep))  # what goodput does not count


def test_eager_update_moves_to_the_own_outer_step_at_submit_and_the_merge_by_the_difference(tmp_path):
    """Decoupled: at a submit θ jumps to outer_step(θg, m, Δ_own); the merge's rebase then moves it to θg_merged,
    with `outer.rebase_keep` of the steps taken meanwhile. --sync (and outer.eager=false) keep θ where the round ended."""
    cfg = _cfg()
    learner = _learner(cfg, InMemoryMerger("p0", {"group_size": 2}), tmp_path, 0)  # nobody else: stays in flight
    theta_g = learner.global_params.clone()
    for _ in range(3):
        learner.inner_step()
    own_delta = theta_g - learner._local_params()
    learner.submit_round()
    eager, _ = outer_step(theta_g, torch.zeros_like(theta_g), own_delta, 0.7, 0.9)
    assert torch.equal(learner._local_params(), eager) and learner.model_moved == 1
    assert torch.equal(learner.global_params, theta_g)  # θg itself waits for the merge
    load_flat_(learner.model, eager + 0.25)  # steps taken while the merge is in flight
    others = torch.full_like(theta_g, 0.02)
    merged = Merged((own_delta + others) / 2, 2.0)
    flight, learner.in_flight = learner.in_flight, None
    flight.future.cancel()
    learner.apply_merge(merged, flight.local_at_submit)
    new_g, _ = outer_step(theta_g, torch.zeros_like(theta_g), merged.average, 0.7, 0.9)
    torch.testing.assert_close(learner._local_params(), new_g + 0.25 * cfg.outer.rebase_keep)  # half of them, stale
    for sets in ({"rounds.sync": "true"}, {"outer.eager": "false"}):
        other = _learner(_cfg(**sets), InMemoryMerger("q0", {"group_size": 2}), tmp_path, 0)
        for _ in range(3):
            other.inner_step()
        at_end = other._local_params()
        other.submit_round()
        assert torch.equal(other._local_params(), at_end) and other.model_moved == 0
        other.in_flight.future.cancel()


def test_land_wait_lands_a_quick_merge_before_the_next_step_and_gives_up_on_a_slow_one(tmp_path):
    """Decoupled with `outer.land_wait`: a merge that lands within that share of a round is applied before the next
    step (no step in flight: θ is the new θg exactly, as in --sync); one that does not is waited for only that long."""
    # rounds of 5 steps of 0.05 s: wait ≤ ~0.13 s; a merge that never lands is waited for at the stop for only the
    # merge timeout, 2 s here (60 by default)
    cfg = _cfg(**{"outer.land_wait": "0.5", "emulate.min_step_s": "0.05", "merge.merge_timeout_s": "2"})
    quick = _learner(cfg, InMemoryMerger("p0", {"group_size": 1}), tmp_path, 0)  # merges alone, at once
    quick.should_stop = lambda: quick.c.step >= 5  # one round, its merge, then stop
    quick.run()
    assert quick.c.round == 1 and torch.equal(quick._local_params(), quick.global_params)
    off = _learner(_cfg(**{"emulate.min_step_s": "0.05", "outer.land_wait": "0"}), InMemoryMerger("q0", {"group_size": 1}),
                   tmp_path, 0)
    off.should_stop = lambda: off.c.step >= 5
    off.run()  # its merge, done at the submit, would have been applied at the next step's poll: it was not
    assert off.c.round == 0 and off.c.merge_wait_s == 0.0
    slow = _learner(cfg, InMemoryMerger("r0", {"group_size": 2}), tmp_path, 0)  # nobody else: it never lands
    slow.should_stop = lambda: slow.c.step >= 8
    slow.run()
    assert slow.c.round == 0 and slow.c.step == 8
    assert 0.5 * 0.2 <= slow.c.merge_wait_s <= 0.5 * slow.last_round_s + 1.0  # waited once, about half a round


class _SlowExchangeMerger(InMemoryMerger):
    """Each merge lands `exchange_s` after its submit, reported as a group merge whose exchange took that long
    (group formed at once): a merge slower than the wait's bound however well the round ends meet."""

    def __init__(self, peer_id, exchange_s):
        super().__init__(peer_id, {"group_size": 1})
        self.exchange_s, self.timers = exchange_s, []

    def submit(self, contribution):
        done, late = super().submit(contribution), Future()

        def land():
            merged = done.result()
            late.set_result(dataclasses.replace(merged, stats=dataclasses.replace(
                merged.stats, group=[self.peer_id, "mate"], match_s=0.0, duration_s=self.exchange_s)))

        timer = threading.Timer(self.exchange_s, land)
        self.timers.append(timer)
        timer.start()
        return late


def test_land_wait_is_not_spent_where_exchanges_take_longer_than_it_and_lands_every_merge_where_they_are_quick(
        tmp_path):
    """A peer whose group merges' exchanges take longer than `outer.land_wait` of a round waits only before it has
    seen one; one whose merges land at once waits (and lands) every round."""
    sets = {"outer.land_wait": "0.01", "emulate.min_step_s": "0.02", "run.total_steps": 150}  # bound ~1 ms a round
    # The bound is a share of the last round's length: 0.25 s exchanges stay longer than it unless a round of 5
    # steps takes 25 s, which no load on a test machine makes it do.
    slow = _learner(_cfg(**sets), _SlowExchangeMerger("slow", exchange_s=0.25), tmp_path, 0)
    try:
        slow.run()
    finally:
        for timer in slow.merger.timers:
            timer.cancel()
    assert slow.c.round >= 8 and slow.c.land_waits == 1 and slow.c.land_waits_landed == 0
    assert slow.c.merge_wait_s < 0.01 * 0.25 + 0.25 + 0.5  # the one wait (≤ its bound) and the last merge's in `finish`
    quick = _learner(_cfg(**sets), InMemoryMerger("quick", {"group_size": 1}), tmp_path, 0)
    quick.run()
    assert quick.c.land_waits == quick.c.land_waits_landed == quick.c.round == 30  # the last one too


def _group_merge(duration_s, match_s):
    return Merged(torch.zeros(1), 2.0, stats=MergeStats(group=["a", "b"], duration_s=duration_s, match_s=match_s))


def test_land_wait_is_due_while_the_median_recent_exchange_fits_its_bound_whatever_the_matchmaking():
    gate = LandWait(0.05, window=3)  # bound: 0.05 s of a 1 s round
    assert gate.due(1.0) and not gate.due(0.0) and not LandWait(0.0).due(1.0)
    gate.record(_group_merge(duration_s=1.03, match_s=1.0))  # a long wait for mates, a 0.03 s exchange
    assert gate.due(1.0)
    gate.record(_group_merge(duration_s=0.2, match_s=0.1))
    gate.record(_group_merge(duration_s=0.2, match_s=0.1))  # median of 0.03, 0.1, 0.1
    assert not gate.due(1.0) and gate.due(3.0)  # 0.1 s ≥ 0.05 s, < 0.15 s
    gate.record(Alone(stats=MergeStats(group=["a"], duration_s=5.0)))  # alone
    gate.record(_group_merge(duration_s=0.02, match_s=0.0))
    gate.record(_group_merge(duration_s=0.51, match_s=0.5))  # the window: 0.1, 0.02, 0.01
    assert gate.due(1.0)


def test_decoupled_learner_never_waits_for_a_slow_merge(tmp_path):
    """With a merge partner that never comes, inner steps go on; the round extends instead of blocking (past the
    default `outer.land_wait`, a few % of a round, once)."""
    cfg = _cfg(**{"run.total_steps": 30, "merge.merge_timeout_s": 2})  # the stop waits that long for it
    hub = {"group_size": 2}  # nobody else ever submits: the merge stays in flight
    learner = _learner(cfg, InMemoryMerger("p0", hub), tmp_path, 0)
    learner.should_stop = lambda: learner.c.step >= 30
    learner.run()
    assert learner.c.step == 30 and learner.c.round == 0 and learner.c.land_waits == 1  # before any exchange seen
    assert learner.c.merge_wait_s <= cfg.outer.land_wait * learner.last_round_s + 0.5


def test_joiner_with_fresh_moments_rewarms_its_lr_and_a_resumed_peer_does_not(tmp_path):
    from p2pdiloco.algorithm.outer import cosine_lr
    from p2pdiloco.network.state_sync import GlobalState

    cfg = _cfg(**{"run.total_steps": 100, "inner.warmup_steps": 4})
    donor = _learner(cfg, InMemoryMerger("donor", {"group_size": 1}), tmp_path, 0)
    state = GlobalState(donor.global_params.clone(), donor.momentum.clone(), round=6, step=30, global_tokens=1e4)

    def schedule(step):
        return cosine_lr(step, 3e-3, 4, 100, cfg.inner.min_lr_ratio)

    joiner = _learner(cfg, InMemoryMerger("joiner", {"group_size": 1}), tmp_path, 1)
    joiner.adopt_state(state)
    lrs = []
    for _ in range(6):
        lrs.append(joiner.inner_lr())
        joiner.inner_step()
    assert lrs[:4] == [schedule(30 + i) * (i + 1) / 4 for i in range(4)]  # ramps up again from where it joined
    assert lrs[4:] == [schedule(34), schedule(35)]  # then follows the run's schedule

    resumed = _learner(cfg, InMemoryMerger("resumed", {"group_size": 1}), tmp_path, 2)
    resumed.inner_step()  # has moments of its own, as a checkpoint would hold them
    from p2pdiloco.training.checkpoint import adam_state_flat

    tensors = {"global_params": state.global_params, "momentum": state.momentum,
               **adam_state_flat(resumed.opt, list(resumed.model.parameters()))}
    fresh = _learner(cfg, InMemoryMerger("fresh", {"group_size": 1}), tmp_path, 3)
    fresh.restore(tensors, {"round": 6, "step": 30, "global_tokens": 1e4})
    fresh.adopt_state(state)  # a resumed peer that finds the swarm ahead keeps its moments: no re-warm
    assert fresh.inner_lr() == schedule(30)
    starter = _learner(cfg, InMemoryMerger("starter", {"group_size": 1}), tmp_path, 4)
    starter.adopt_state(GlobalState(state.global_params, state.momentum, 0, 0, 0.0))
    assert starter.inner_lr() == schedule(0)  # at the start the run's own warmup applies, once


def test_a_peer_that_merges_with_a_finishing_peer_ends_on_the_same_global_model(tmp_path):
    # B has a longer step budget than A, but is within one round of its own end: once A's last contribution
    # reaches B in a group merge, the run is over for B too, instead of B drifting on alone (here it would never
    # find a partner again). Further from its end, B goes on (tests/test_insiders.py: "final" is only a claim).
    hub = {"group_size": 2}
    # steps padded to 0.05 s: unpadded, B (decoupled) could take its last 5 steps before A's final merge landed,
    # ending at 15 by its own budget (1 run in 3 failed so)
    pad = {"emulate.min_step_s": 0.05}
    a = _learner(_cfg(**{"run.total_steps": 10, **pad}), InMemoryMerger("a", hub), tmp_path, 0)
    b = _learner(_cfg(**{"run.total_steps": 15, **pad}), InMemoryMerger("b", hub), tmp_path, 1)
    summaries = {}
    threads = [threading.Thread(target=lambda p=p, n=n: summaries.__setitem__(n, p.run())) for p, n in ((a, "a"), (b, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert set(summaries) == {"a", "b"}
    assert summaries["a"]["step"] == 10 and not summaries["a"]["ended_with_swarm"]
    assert summaries["b"]["ended_with_swarm"] and 10 <= summaries["b"]["step"] < 15
    assert summaries["a"]["merges"] == summaries["b"]["merges"] == 2
    assert torch.equal(a.global_params, b.global_params) and torch.equal(a.momentum, b.momentum)
    assert summaries["a"]["eval_loss_final"] == summaries["b"]["eval_loss_final"]
    rows = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    merges = [r for r in rows if r["kind"] == "merge"]
    assert [r["final"] for r in merges] == [False, True]  # and nothing submitted after the final group


def test_a_learner_told_the_run_is_over_takes_no_step_and_submits_nothing(tmp_path):
    learner = _learner(_cfg(), InMemoryMerger("late", {"group_size": 2}), tmp_path, 0)  # nobody to merge with
    learner.ended_with_swarm = True  # what join_swarm_state does when the swarm finished without us
    summary = learner.run()
    assert summary["inner_steps"] == 0 and summary["rounds"] == 0 and learner.in_flight is None
    assert summary["eval_loss_final"] == summary["eval_loss_initial"]


def test_compute_cpu_s_counts_the_steps_cpu_and_not_their_padding(tmp_path):
    # 10 steps padded to 0.05 s: compute_s holds the sleep, compute_cpu_s only the training thread's work
    cfg = _cfg(**{"emulate.min_step_s": 0.05, "run.total_steps": 10})
    summary = _learner(cfg, InMemoryMerger("solo", {"group_size": 1}), tmp_path, 0).run()
    assert summary["compute_s"] >= 10 * 0.05
    assert 0 < summary["compute_cpu_s"] < summary["compute_s"] / 2


def test_the_global_model_is_evaluated_once_a_state_and_a_loss_handed_on_is_used_only_for_its_state(
        tmp_path, monkeypatch):
    """peer.py evaluates the built model while its DHT starts, and again (held) before it waits for the others; the
    last merge's eval is the final one's; a checkpoint keeps its θg's loss for a restart. Each only while θg is
    the state measured: a θg changed since (a joiner's download, a merge) is measured again."""
    measured = []
    real = learner_module.evaluate_flat
    monkeypatch.setattr(learner_module, "evaluate_flat", lambda *a: measured.append(1) or real(*a))
    cfg = _cfg(**{"run.total_steps": 5, "run.eval_every_rounds": 0})
    learner = _learner(cfg, InMemoryMerger("early", {"group_size": 1}), tmp_path, 0)
    early = evaluate_model(learner.model, learner.val_batches, torch.device("cpu"))
    assert early == real(learner.model, learner.g.params, learner.val_batches, torch.device("cpu"), "auto")
    learner.last_eval = (learner.g.digest(), early)  # as peer.py hands it on
    assert learner.evaluate_global() == early and measured == []
    learner.run()
    rows = [json.loads(line) for line in (tmp_path / "early.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in rows if r["kind"] == "eval"]
    assert evals[0] == early and len(measured) == 1  # the start's was the one handed on; the end's was measured
    assert learner.evaluate_global() == evals[-1] and len(measured) == 1

    stale = learner.evaluate_global()
    learner.g.adopt(learner.g.params + 0.05, torch.zeros_like(learner.g.params))  # a joiner's download, say
    moved = learner.evaluate_global()
    assert len(measured) == 2 and moved != stale

    learner.checkpoint_dir = tmp_path / "ckpt"
    learner.checkpoint(wait=True)
    tensors, meta, _ = load_latest(tmp_path / "ckpt")
    restarted = _learner(cfg, InMemoryMerger("restarted", {"group_size": 1}), tmp_path, 1)
    restarted.restore(tensors, meta)
    assert restarted.evaluate_global() == moved and len(measured) == 2  # the checkpoint's loss, for its θg
    meta.pop("eval")  # a checkpoint written before losses were kept
    restarted.restore(tensors, meta)
    assert restarted.evaluate_global() == pytest.approx(moved) and len(measured) == 3


def test_a_hung_merger_is_a_merge_alone_that_keeps_its_final(tmp_path):
    """Past its bound a merge is given up (`InFlight._hung`): the learner merges alone, on its own Δ, and a last
    contribution stays the last in its metrics line, as any merge alone (`merger.merged_alone`)."""
    learner = _learner(_cfg(), InMemoryMerger("p0", {"group_size": 2}), tmp_path, 0)  # nobody else: never lands
    learner.inner_step()
    learner.submit_round(final=True)
    learner.in_flight.bound_s = 0.0
    learner.poll_merge()
    learner.metrics.close()
    merge = [json.loads(line) for line in (tmp_path / "p0.jsonl").read_text().splitlines()][-1]
    assert merge["kind"] == "merge" and merge["failure"] == "merger hung" and merge["final"] is True
    assert merge["group_size"] == 1 and learner.c.merges == 0 and learner.c.round == 1


def test_told_to_stop_it_lands_a_group_merge_under_way_and_drops_one_that_found_no_group(tmp_path):
    """Leaving mid-merge failed its mates' merge on this peer's slice; a merge under way with mates is landed first
    (within the merge timeout), one that found no group is dropped (applied alone, it would leave this peer's last
    global model apart from its mates' for nothing)."""
    cfg = _cfg(**{"emulate.min_step_s": "0.02", "outer.land_wait": "0"})
    under_way = _learner(cfg, _SlowExchangeMerger("s0", exchange_s=0.3), tmp_path, 0)
    under_way.should_stop = lambda: under_way.in_flight is not None  # stopped right after its first submit
    before = under_way.global_params.clone()
    under_way.run()
    assert under_way.c.round == 1 and not torch.equal(under_way.global_params, before)  # landed, not cancelled
    nobody = _learner(cfg, InMemoryMerger("q0", {"group_size": 2, "window_s": 0.2}), tmp_path, 0)
    nobody.should_stop = lambda: nobody.in_flight is not None
    before = nobody.global_params.clone()
    nobody.run()
    assert nobody.c.round == 0 and torch.equal(nobody.global_params, before) and nobody.in_flight is None
