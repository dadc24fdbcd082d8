"""Donors that two ids cannot fake: a joiner takes a state only if it predicts the joiner's own data better than
the joiner's own model, however many peers name it (docs/security.md, "Sybil donors").

The unit tests check the joiner's check and the counters' cap alone; the integration test mounts the attack against
real hivemind DHTs on loopback: one honest donor, two attacker ids serving the same forged state and naming it in
their signed heartbeat records, and a joiner that reads those records from the DHT."""

from __future__ import annotations

import json

import pytest
import torch
from hivemind.utils.timed_storage import get_dht_time
from rich.console import Console

from p2pdiloco.algorithm.outer import state_digest
from p2pdiloco.bench import byzantine
from p2pdiloco.config import SwarmConfig, load_config, parse_set
from p2pdiloco.network.state_sync import GlobalState, StateSync, bounded_counters
from p2pdiloco.network.swarm import live_records, peer_shard, peers_key, read_peers, start_dht, write_subkey
from p2pdiloco.network.wire import ByteCounter
from p2pdiloco.training.batches import BatchSampler
from p2pdiloco.training.evaluation import state_check
from p2pdiloco.training.flat import flat_params, load_flat_
from p2pdiloco.training.model import build_model
from tests.conftest import wait_for

CLAIM = 10**9
"""What the attackers claim for their state: round, step and tokens."""


@pytest.fixture(scope="module")
def swarm_model():
    """(a tiny model at its initial weights, a joiner's sampler of a learnable text, θg after 20 AdamW steps on
    it: the swarm's state)."""
    cfg = load_config(None, [parse_set(["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=16"])])
    model = build_model(cfg.model)
    init = flat_params(model).clone()
    text = (torch.arange(40_000) * 7 % 251).to(torch.uint8)  # a byte and the next: learnable
    trainer = BatchSampler(text, 16, 4, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(20):
        _, loss = model(*trainer.next_batch())
        opt.zero_grad()
        loss.backward()
        opt.step()
    trained = flat_params(model).clone()
    load_flat_(model, init)
    return model, BatchSampler(text, 16, 4, seed=1), trained


def _check(model, sampler: BatchSampler, own: torch.Tensor):
    probe = sampler.probe(4, torch.Generator().manual_seed(5))
    return state_check(model, own, probe, torch.device("cpu"))


def test_a_probe_draws_windows_of_the_shard_without_moving_the_samplers_order():
    text = torch.arange(10_000) % 256
    a, b = BatchSampler(text, 16, 4, seed=3, shard="1/2"), BatchSampler(text, 16, 4, seed=3, shard="1/2")
    probe = a.probe(3, torch.Generator().manual_seed(0))
    assert len(probe) == 3 and all(x.shape == y.shape == (4, 16) for x, y in probe)
    assert all(int(x.min()) >= 0 and torch.equal((x[:, 1:]), y[:, :-1]) for x, y in probe)
    assert all(torch.equal(u, v) for u, v in zip(a.next_batch(), b.next_batch(), strict=True))


def test_the_joiners_check_takes_a_trained_state_and_refuses_what_needs_no_training(swarm_model):
    model, sampler, trained = swarm_model
    init = flat_params(model).clone()
    check = _check(model, sampler, init)  # a fresh joiner: its own model is the initial one
    assert check(trained) is None
    other_init = flat_params(build_model(load_config(None, [parse_set(
        ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=16", "model.init_seed=99"])]).model))
    # not −θg: with layer norms and tied embeddings most sign flips cancel, and it predicts the data well here
    for forged in (trained * 30, init + 0.05 * torch.randn_like(init), other_init, init,
                   torch.full_like(init, float("nan"))):
        assert check(forged) is not None and "not below" in check(forged)
    assert torch.equal(flat_params(model), init)  # the joiner's model keeps its weights
    assert _check(model, sampler, trained)(trained) is not None  # a resumed peer keeps its own unless beaten


def test_holders_of_a_state_who_lie_about_its_counters_are_capped_by_its_honest_holder():
    state = GlobalState(torch.zeros(4), torch.zeros(4), CLAIM, CLAIM, float(CLAIM))
    honest = {"round": 7, "step": 70, "global_tokens": 700.0, "global_digest": "d"}
    liar = {"round": CLAIM, "step": CLAIM, "global_tokens": float(CLAIM), "global_digest": "d"}
    records = {"h": honest, "a1": liar, "a2": liar}
    assert bounded_counters(state, records, "me").step == CLAIM  # the lower median of three is a liar's
    capped = bounded_counters(state, records, "me", "d")
    assert (capped.round, capped.step, capped.global_tokens) == (7, 70, 700.0)


@pytest.mark.integration
def test_two_colluding_donors_naming_the_same_forged_state_cannot_make_a_joiner_take_it(swarm_model, net_loop):
    model, sampler, trained = swarm_model
    good = GlobalState(trained, torch.zeros_like(trained), 7, 70, 700.0)
    # both attackers serve the same bits: a model of their own init seed (no training), claiming step 10⁹
    forged_params = flat_params(build_model(load_config(None, [parse_set(
        ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=16", "model.init_seed=7"])]).model))
    forged = GlobalState(forged_params, torch.zeros_like(trained), CLAIM, CLAIM, float(CLAIM))
    digest, bad_digest = (state_digest(s.global_params, s.momentum) for s in (good, forged))
    cfg = SwarmConfig(run_id="sybil", host="127.0.0.1")
    dhts = [start_dht(cfg)]
    try:
        joined = SwarmConfig(**{**cfg.__dict__, "initial_peers": [str(m) for m in dhts[0].get_visible_maddrs()]})
        dhts += [start_dht(joined) for _ in range(4)]  # [honest donor, attacker 1, attacker 2, joiner, honest peer]
        n = trained.numel()
        syncs = [StateSync(d, "sybil", n, (lambda st=st: st), ByteCounter())
                 for d, st in zip(dhts[:4], [good, forged, forged, None], strict=True)]
        for s in syncs:
            net_loop.run(s.start(), 10)
        ids = [d.peer_id.to_base58() for d in dhts]
        honest = {"round": 7, "step": 70, "global_tokens": 700.0, "global_digest": digest}
        lie = {"round": CLAIM, "step": CLAIM, "global_tokens": float(CLAIM), "global_digest": bad_digest}

        def publish(i: int, record: dict) -> None:  # a heartbeat: signed by its writer, under its own id
            assert net_loop.run(write_subkey(dhts[i], peers_key("sybil", peer_shard(ids[i])), ids[i], record,
                                             get_dht_time() + 60), 10)

        for i, record in ((0, honest), (1, lie), (2, lie)):
            publish(i, record)
        joiner = syncs[3]
        check = _check(model, sampler, flat_params(model).clone())

        def read() -> dict[str, dict]:
            return live_records(net_loop.run(read_peers(dhts[3], "sybil"), 10))

        records = wait_for(lambda: r if len(r := read()) == 3 else None, 20, what="the three records")
        # two records name the forged state, one the honest: the forged one is tried first, and refused
        assert net_loop.run(joiner.fetch(records, ids[3], timeout=10, judge=check), 30) is None
        assert set(joiner.refused) == {bad_digest}
        # a second live peer holds the honest state (it merged with the donor): that one is taken, with its counters
        publish(4, {**honest, "step": 80})
        records = wait_for(lambda: r if len(r := read()) == 4 else None, 20, what="the four records")
        state, donor = net_loop.run(joiner.fetch(records, ids[3], timeout=10, judge=check), 30)
        assert donor == ids[0] and torch.equal(state.global_params, trained)
        assert (state.round, state.step, state.global_tokens) == (7, 70, 700.0)
        assert set(joiner.refused) <= {bad_digest}  # tried first again or not, never taken
    finally:
        for d in reversed(dhts):
            d.shutdown()


def test_bench_byzantine_runs_sybil_donor_against_a_clean_run_with_the_same_joiner(tmp_path, monkeypatch):
    calls = []

    def run_local(n, cfg, out, _join, sets, console=None, reraise_interrupt=False, peer_sets=None, chaos=None):
        calls.append((out.name, sorted(peer_sets or {}), type(chaos).__name__))
        hostile = "sybil" in out.name
        joiner = out / "peers" / f"peer{n - 1}"
        joiner.mkdir(parents=True)
        line = {"kind": "join", "donor": "id0" if hostile else "id2", "step": 10**9 if hostile else 40}
        (joiner / "metrics.jsonl").write_text(json.dumps(line) + "\n")
        peers = [{"name": f"peer{i}", "peer_id": f"id{i}", "step": 100, "merges": 20,
                  "eval_loss_final": 3.0 if hostile else 2.0, "guard": {"rejected": 0, "banned": []}} for i in range(n)]
        return {"peers": peers, "peers_finished": n}

    monkeypatch.setattr(byzantine, "run_local", run_local)
    results = byzantine.bench_byzantine(tmp_path, sizes=(5,), modes=("decoupled",), kinds=("sybil_donor",),
                                        console=Console(file=None, quiet=True))
    assert calls == [("clean_decoupled_5", [], "NoneType"), ("clean_join_decoupled_5", [], "JoinerRestart"),
                     ("sybil_donor_decoupled_5", [0, 1], "JoinerRestart")]
    run = results["runs"]["sybil_donor_decoupled_5"]
    assert run["ratio"] == pytest.approx(1.5)  # ÷ the clean run with the same joiner
    assert run["joiner"] == {"joined": "hostile", "join_step": 10**9, "refused_states": 0, "donor": "peer0",
                             "join_s": None, "download_s": None}  # no start line, no times
    assert results["runs"]["clean_join_decoupled_5"]["joiner"]["joined"] == "honest"
