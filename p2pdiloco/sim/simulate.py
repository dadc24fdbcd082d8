"""One simulated run of every algorithm of a scenario, and the sweeps behind the plots.

Goodput is bench/goodput.py's rule applied to the simulated ledger, as far as the model goes: spent is each
incarnation's wall time from its process start to its end or kill; reached is the inner-step time of every round
merged in a group, plus rounds merged alone that a later group merge of the same incarnation carried along, plus
everything a learner that was never killed held at the end. Rounds whose merge had not returned when the learner
died are lost. The model has no guards and no state weights, so it counts every part as kept and carried rounds in
full, where the measured rule counts them by the learner's share of the later agreement (docs/simulation.md).
"""

from __future__ import annotations

import copy
import math
import time

import numpy as np

from p2pdiloco.sim.data_parallel import simulate_data_parallel, simulate_elastic
from p2pdiloco.sim.decoupled import simulate_decoupled
from p2pdiloco.sim.failures import Killer, step_times
from p2pdiloco.sim.scenario import ALGORITHMS, Scenario
from p2pdiloco.sim.swarm import Ledger, simulate_sync


def account(scn: Scenario, steps: np.ndarray, ledger: Ledger) -> dict:
    """Goodput, throughput, bytes and group sizes of a decoupled or sync run (see the module docstring)."""
    f = scn.failures
    L = ledger
    t0 = f.first_start_s
    survivors = L.inc_end[~L.inc_killed]
    end = float(survivors.max()) if len(survivors) else t0 + scn.duration
    duration = end - t0
    spent = float(np.sum(L.inc_end - L.inc_start)) + f.finish_s * int(np.sum(~L.inc_killed))
    if f.count_down_time:
        spent += float(np.sum(np.minimum(f.down_s, np.maximum(end - L.inc_end[L.inc_killed], 0.0))))
    order = np.lexsort((L.t_submit, L.inc))
    inc, comp, done = L.inc[order], L.compute[order], L.t_done[order]
    landed = L.landed[order]
    flush = L.ok[order] & landed
    m = len(order)
    reached_rows = np.zeros(m, bool)
    when = np.full(m, math.inf)
    if m:
        nxt = np.where(flush, np.arange(m), m)
        nxt = np.minimum.accumulate(nxt[::-1])[::-1]
        same = (nxt < m) & (inc[np.minimum(nxt, m - 1)] == inc)
        survived = ~L.inc_killed[inc]
        reached_rows = landed & (same | survived)
        when = np.where(same, done[np.minimum(nxt, m - 1)], np.maximum(end, done))
    reached = float(comp[reached_rows].sum())
    tokens = comp / steps[L.peer[order]] * scn.compute.tokens_per_step
    reached_tokens = float(tokens[reached_rows].sum())
    out = {
        "goodput": reached / spent if spent else 0.0, "spent_s": spent, "reached_s": reached,
        "tokens_per_s": reached_tokens / duration, "reached_tokens": reached_tokens,
        "kills": int(L.inc_killed.sum()), "rounds": int(m),
        "group_merges": int(len(L.group_sizes)), "failed_merges": int(L.failed_merges),
        "merges_alone": int(m - L.ok.sum()), "events": int(L.events),  # alone, or in a group that failed
    }
    budget = scn.run.token_budget
    if budget > 0:
        k = np.argsort(when[reached_rows], kind="stable")
        cum = np.cumsum(tokens[reached_rows][k])
        hit = int(np.searchsorted(cum, budget))
        out["time_to_budget_s"] = float(when[reached_rows][k][hit] - t0) if hit < len(cum) else None
    sizes = L.group_sizes
    out["group_size_mean"] = float(sizes.mean()) if len(sizes) else 0.0
    out["group_size_hist"] = {str(int(s)): int(c) for s, c in zip(*np.unique(sizes, return_counts=True), strict=True)}
    n = len(steps)
    out["bytes_per_learner"] = float(L.bytes_sent.mean())
    rounds_per_learner = m / n
    per_merge = out["bytes_per_learner"] / max(rounds_per_learner, 1)
    round_s = duration / max(rounds_per_learner, 1)
    out["link_gbps_mean"] = out["bytes_per_learner"] * 8 / duration / 1e9
    out["link_gbps_needed"] = per_merge * 8 / round_s / 1e9  # one merge's bytes within one round
    out.update(consensus(ledger, n, m, round_s))
    trained = L.extra.get("trained", L.compute)  # every step taken, the ones a rebase gave up included
    peer_steps = np.bincount(L.peer, weights=trained / steps[L.peer], minlength=n)
    out["steps_per_s"] = (peer_steps / np.maximum(L.train_end - t0, 1e-9)).tolist() if n <= 64 else None
    return out


def consensus(ledger: Ledger, n: int, rows: int, round_s: float) -> dict:
    """A decoupled run's bytes per learner per round (Δ exchange and agreement apart), its agreements by kind, and
    its consensus: rounds until a followed contribution reached every learner (median over those followed; None
    where none did within the run), distinct global models at each epoch's dealing (mean) and at the end."""
    x = ledger.extra
    if "delta_bytes" not in x:
        return {}
    per_round = max(rows / n, 1.0)
    mixing = [s for s in x["mixing_s"] if math.isfinite(s)]
    distinct = x["distinct_models"]
    return {
        "delta_bytes_per_learner_round": float(x["delta_bytes"].mean()) / per_round,
        "agreement_bytes_per_learner_round": float(x["agreement_bytes"].mean()) / per_round,
        "agreements": x["agreements"], "round_s": round_s,
        "mixing_rounds": float(np.median(mixing)) / round_s if mixing else None,
        "mixing_followed": len(x["mixing_s"]), "mixing_reached": len(mixing),
        "distinct_models_mean": float(np.mean(distinct)) if distinct else None, "final_models": x["final_models"],
        "in_group_share": float(ledger.ok.mean()) if rows else 0.0,
    }


def run_algorithm(scn: Scenario, name: str) -> dict:
    """One algorithm on the scenario, with its own seeded random stream (so the others do not shift it)."""
    rng = np.random.default_rng([scn.run.seed, ALGORITHMS.index(name)])
    steps = step_times(scn, np.random.default_rng([scn.run.seed, 99]))  # the same learners for every algorithm
    if name == "elastic_data_parallel":
        return simulate_elastic(scn, steps, rng)
    killer = Killer(scn, rng)
    if name == "data_parallel":
        return simulate_data_parallel(scn, steps, killer)
    if name == "decoupled":
        ledger = simulate_decoupled(scn, steps, killer, np.random.default_rng([scn.run.seed, 98]))
    else:
        ledger = simulate_sync(scn, steps, killer)
    return account(scn, steps, ledger)


def simulate(scn: Scenario) -> tuple[dict, dict]:
    """(results, timing) of every algorithm in `scn.run.algorithms`. Results depend only on the scenario and
    its seed; timing (wall seconds, events, events/s) is kept apart so that results are reproducible bit for bit."""
    scn.validate()
    results: dict = {"scenario": scn.to_dict(), "algorithms": {}}
    timing: dict = {}
    for name in scn.run.algorithms:
        t = time.perf_counter()
        r = run_algorithm(scn, name)
        wall = time.perf_counter() - t
        results["algorithms"][name] = r
        timing[name] = {"wall_s": wall, "events": r["events"], "us_per_event": 1e6 * wall / max(r["events"], 1)}
    return results, timing


def sweep(scn: Scenario, section: str, key: str, values: list[float]) -> list[dict]:
    """Goodput and link rates of every algorithm with `section.key` set to each of `values`."""
    rows = []
    for v in values:
        s = copy.deepcopy(scn)
        setattr(getattr(s, section), key, type(getattr(getattr(s, section), key))(v))
        res, _ = simulate(s)
        rows.append({key: v, **{a: {k: r.get(k) for k in ("goodput", "tokens_per_s", "link_gbps_needed",
                                                         "group_size_mean")}
                                for a, r in res["algorithms"].items()}})
    return rows
