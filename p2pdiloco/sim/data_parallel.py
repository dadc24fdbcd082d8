"""Lockstep data-parallel under failures: restarted from a checkpoint (`bench churn`'s baseline) or elastic.

Restarted (bench/baselines/data_parallel_churn.py): every step waits for the slowest rank; rank 0 checkpoints every
`checkpoint_every_steps`. A failure stops the job; the survivors notice after `dp_detect_s`, wait for the lost
rank's `down_s`, and every rank starts again (`dp_restart_s`) from the last checkpoint. Spent: each rank's
process time plus the survivors' wait (the dead rank's down time only with `count_down_time`). Reached: the steps
in the final model's history, at each rank's own step time (a fast rank's lockstep wait is spent). The run ends when it has as many steps as the swarm's `duration_s` at full speed, or gives up at `GIVE_UP` times
that wall time (failures faster than restarts: it never gets anywhere), with what its checkpoints hold.

Elastic: a failure stops every rank for `dp_detect_s` + `dp_restart_s` (a re-rendezvous), but nothing is rolled
back (the survivors hold the state) and nobody waits for the lost replica, which rejoins, at another re-rendezvous,
once repaired. The job runs with fewer replicas meanwhile; the run ends at the same number of replica-steps.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from p2pdiloco.sim.failures import Killer
from p2pdiloco.sim.scenario import Scenario

GIVE_UP = 20.0
"""A data-parallel run stops at this many times the swarm's wall time, with the progress it has."""


def step_seconds(scn: Scenario, steps: np.ndarray) -> float:
    """One lockstep step: the slowest rank's step plus the all-reduce time not hidden behind compute."""
    n, ranks = scn.network, len(steps)
    ring = 2 * (ranks - 1) / ranks * n.params * n.dp_bytes_per_value * 8 / (n.bandwidth_gbps * 1e9)
    comm = ring + 2 * (ranks - 1) * n.latency_s if ranks > 1 else 0.0
    return float(steps.max()) + (1 - n.dp_overlap) * comm


def dp_link_gbps(scn: Scenario, ranks: int, step_s: float) -> float:
    """Link rate a ring all-reduce of every step's gradients needs to hide behind one step, Gbit/s."""
    n = scn.network
    return 2 * (ranks - 1) / max(ranks, 1) * n.params * n.dp_bytes_per_value * 8 / step_s / 1e9


def simulate_data_parallel(scn: Scenario, steps: np.ndarray, killer: Killer) -> dict:
    """Goodput and progress of the restarted baseline (see the module docstring)."""
    f, p = scn.failures, scn.protocol
    ranks = len(steps)
    tau = step_seconds(scn, steps)
    target = max(1, round(scn.run.duration_s / scn.compute.step_s))
    C, ck = p.checkpoint_every_steps, p.checkpoint_s
    spawn, resume, done = 0.0, f.first_start_s, 0  # process start, first step, steps in the resumed state
    spent = reached_t = 0.0
    kills = 0
    all_ranks = np.arange(ranks)
    nk = killer.next_after(all_ranks, np.zeros(ranks))

    def at(n_steps: int) -> float:  # wall time after `n_steps` steps from `resume`, checkpoints included
        ckpts = (done + n_steps) // C - done // C
        return resume + n_steps * tau + ckpts * ck

    limit = GIVE_UP * (f.first_start_s + scn.duration)
    while True:
        victim = int(np.argmin(nk))
        t_fail = float(nk[victim])
        finish = at(target - done)
        if min(t_fail, finish) >= limit:  # never finishes at this failure rate: stop with the checkpointed steps
            n_by = max(0, int(math.floor((limit - resume) / tau + 1e-9)))
            target = (done + n_by) // C * C if n_by else done
            spent += ranks * (limit - spawn)
            reached_t = limit
            break
        if t_fail >= finish:
            spent += ranks * (finish - spawn + f.finish_s)
            reached_t = finish
            break
        kills += 1
        n_by = max(0, int(math.floor((t_fail - resume) / tau + 1e-9)))
        while n_by > 0 and at(n_by) > t_fail:
            n_by -= 1
        done = min(target, (done + n_by) // C * C if n_by else done)
        back = t_fail + max(f.dp_detect_s, f.down_s)
        stopped = t_fail + f.dp_detect_s
        spent += (t_fail - spawn) + (ranks - 1) * (max(stopped, back) - spawn)
        if f.count_down_time:
            spent += back - t_fail
        spawn, resume = back, back + f.dp_restart_s
        nk = killer.next_after(all_ranks, np.full(ranks, back))  # every rank is a fresh process
    reached = target * float(steps.sum())  # each rank's own step time: lockstep waiting is spent, not reached
    return {"spent_s": spent, "reached_s": reached, "goodput": reached / spent if spent else 0.0,
            "kills": kills, "wall_s": reached_t, "steps": target, "step_s": tau,
            "tokens_per_s": ranks * target * scn.compute.tokens_per_step / reached_t,
            "gave_up": reached_t >= limit, "link_gbps_needed": dp_link_gbps(scn, ranks, tau), "events": kills + 1}


def simulate_elastic(scn: Scenario, steps: np.ndarray, rng: np.random.Generator) -> dict:
    """Goodput of elastic data-parallel: `elastic_units` replicas (default: one per learner) sharing the failures."""
    f = scn.failures
    units = scn.protocol.elastic_units or len(steps)
    unit_mtbf = f.mtbf_s * units / len(steps)  # the same hardware cut into `units` failure domains
    tau = step_seconds(scn, steps)
    target = units * max(1, round(scn.run.duration_s / scn.compute.step_s))  # replica-steps
    pause = f.dp_detect_s + f.dp_restart_s
    t, up, done_rs, spent, kills = f.first_start_s, units, 0.0, units * f.first_start_s, 0
    returns: list[float] = []
    next_fail = t + rng.exponential(unit_mtbf / units) if math.isfinite(unit_mtbf) else math.inf
    limit = GIVE_UP * (f.first_start_s + scn.duration)
    while True:
        t_ret = returns[0] if returns else math.inf
        is_fail = next_fail <= t_ret
        t_next = max(min(next_fail, t_ret), t)  # what happened during a pause takes effect after it
        finish = t + (target - done_rs) / up * tau if up else math.inf
        down = units - up
        if t >= limit:  # never finishes at this failure rate
            target = done_rs
            break
        if finish <= t_next:
            spent += (finish - t) * (up + (down if f.count_down_time else 0))
            t = finish
            break
        done_rs += up * (t_next - t) / tau
        spent += (t_next - t) * (up + (down if f.count_down_time else 0))
        if is_fail:
            kills += 1
            up -= 1
            heapq.heappush(returns, t_next + f.down_s + f.dp_restart_s)
            next_fail = t_next + rng.exponential(unit_mtbf / max(up, 1)) if up else math.inf
        else:
            heapq.heappop(returns)
            up += 1
            if math.isinf(next_fail) and math.isfinite(unit_mtbf):
                next_fail = t_next + rng.exponential(unit_mtbf / up)
        spent += pause * (up + ((units - up) if f.count_down_time else 0))
        t = t_next + pause
    reached = target * float(steps.mean())
    return {"spent_s": spent, "reached_s": reached, "goodput": reached / spent if spent else 0.0, "kills": kills,
            "wall_s": t, "replica_steps": target, "step_s": tau, "gave_up": t >= limit,
            "tokens_per_s": target * scn.compute.tokens_per_step * len(steps) / units / t,
            "link_gbps_needed": dp_link_gbps(scn, units, tau), "events": 2 * kills + 1}
