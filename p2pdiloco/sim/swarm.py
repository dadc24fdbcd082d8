"""Synchronous DiLoCo as p2pdiloco implements it, simulated with numpy, all learners at once, and the ledger that
both it and decoupled DiLoCo (decoupled.py) produce.

Sync (--sync): every learner runs `round_steps` steps, then waits until every live learner is ready (a dead
one's record counts as live for `record_ttl_s`; a restarted one counts from its first step) or
`sync_window_s` has passed, merges, and starts the next round when the merge is done.

Both produce a `Ledger`; `account` turns it into goodput by bench/goodput.py's rule, as far as the model goes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from p2pdiloco.sim.failures import Killer
from p2pdiloco.sim.scenario import Scenario, bytes_per_value

EPS = 1e-9


@dataclass
class Ledger:
    """What happened to every contribution (one row a submitted round) and every incarnation of every learner."""

    peer: np.ndarray
    inc: np.ndarray
    """Incarnation id of the row (global, 0..): a restarted learner is a new incarnation."""
    t_submit: np.ndarray
    compute: np.ndarray
    """Inner-step seconds of the round."""
    ok: np.ndarray
    """Merged in a group that succeeded."""
    t_done: np.ndarray
    """When the merge (or merge alone) returned."""
    landed: np.ndarray
    """The result reached the learner before it died."""
    inc_peer: np.ndarray
    inc_start: np.ndarray
    """Process start of each incarnation."""
    inc_end: np.ndarray
    inc_killed: np.ndarray
    group_sizes: np.ndarray
    """Size of every successful group merge."""
    failed_merges: int
    bytes_sent: np.ndarray
    """Merge bytes each learner sent."""
    train_end: np.ndarray
    """When each learner's training loop ended (steps/s = steps ÷ (train_end − its first step))."""
    events: int = 0
    extra: dict = field(default_factory=dict)


def merge_cost(scn: Scenario, g: int, state: bool) -> tuple[float, float]:
    """(seconds, bytes each member sends) of one group merge of `g` members; `state`: (θg, momentum) too.

    Reduce-scatter plus all-gather through slice owners: each member sends 2(g−1)/g of the payload; a sparse
    codec's parts are all-gathered instead: g − 1 copies of its part (network/sparse_exchange.py). (θg, momentum)
    travel as int8 differences from a state all members hold (`Group.anchor`; a fork is rarely deeper than
    `merge.state_anchors` merges).
    """
    n = scn.network
    share = 2 * (g - 1) / g
    pseudo_grad_share = g - 1 if n.codec == "sparseloco" else share
    state_bytes = share * 2 * n.params * bytes_per_value("int8") if state else 0.0
    sent = pseudo_grad_share * n.params * bytes_per_value(n.codec) + state_bytes
    phases = 2 if state else 1
    seconds = n.matchmaking_s + phases * 2 * n.latency_s + sent * 8 / (n.bandwidth_gbps * 1e9)
    return seconds, sent


class Incarnations:
    """Growing arrays of incarnations: who, process start, first step, end, killed."""

    def __init__(self, n: int, train: float):
        """`n` first incarnations, whose processes start at 0 and first step at `train`."""
        self.peer, self.start = list(range(n)), [0.0] * n
        self.train, self.end, self.killed = [train] * n, [math.inf] * n, [False] * n

    def new(self, peers: np.ndarray, starts: np.ndarray, trains: np.ndarray) -> np.ndarray:
        first = len(self.peer)
        self.peer += peers.tolist()
        self.start += starts.tolist()
        self.train += trains.tolist()
        self.end += [math.inf] * len(peers)
        self.killed += [False] * len(peers)
        return np.arange(first, first + len(peers))

    def close(self, ids: np.ndarray, ends: np.ndarray, killed: bool) -> None:
        for i, e in zip(ids.tolist(), ends.tolist(), strict=True):
            self.end[i], self.killed[i] = e, killed

    def live_counter(self, ttl: float):
        """live(t): learners whose record is up at t (first step ≤ t < death + ttl)."""
        ups = np.sort(np.asarray(self.train))
        downs = np.sort(np.where(self.killed, np.asarray(self.end) + ttl, math.inf))
        return lambda t: int(np.searchsorted(ups, t, "right") - np.searchsorted(downs, t, "right"))


def simulate_sync(scn: Scenario, steps: np.ndarray, killer: Killer) -> Ledger:
    """--sync rounds: one group formation per iteration, all learners vectorized."""
    swarm = _SyncSwarm(scn, steps, killer)
    while swarm.active.any():
        r, final, act = swarm.kill_before_ready()
        if not act.size:
            break
        t_form, r, final, act = swarm.wait_for_records(r, final, act)
        members = act[r[act] <= t_form + EPS]
        if members.size:
            swarm.merge(members, r, final, t_form)
    return swarm.ledger()


class _SyncSwarm:
    """The learners of a --sync simulation, one array entry each (see `simulate_sync`)."""

    def __init__(self, scn: Scenario, steps: np.ndarray, killer: Killer):
        self.f, self.p, self.steps, self.killer = scn.failures, scn.protocol, steps, killer
        self.scn = scn
        n = self.n = len(steps)
        t0 = self.f.first_start_s
        self.budget = math.ceil(scn.run.total_steps / self.p.round_steps) if scn.run.total_steps else 0
        self.end = end = math.inf if self.budget else t0 + scn.run.duration_s
        self.rnd = np.zeros(n, int)  # rounds in each learner's global model; a joiner adopts the swarm's
        self.rs = np.full(n, t0)  # start of the current round (first step of the incarnation after a restart)
        self.inc = np.arange(n)
        self.incs = Incarnations(n, t0)
        self.nk = killer.next_after(np.arange(n), np.zeros(n))
        self.expiry = np.full(n, -math.inf)  # the dead incarnation's record is live until then
        self.died = np.full(n, math.inf)
        self.active = np.ones(n, bool)
        self.train_end = np.full(n, end if math.isfinite(end) else t0)
        self.diverged = np.zeros(n, bool)
        self.sent = np.zeros(n)
        self.rows: list[tuple[np.ndarray, ...]] = []
        self.sizes: list[int] = []
        self.failed = self.kills = 0

    def ready(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """When each learner's round is ready (inf: inactive), whether it is its last, and the active learners."""
        last = self.rs + np.floor((self.end - self.rs) / self.steps + EPS) * self.steps
        r = self.rs + self.p.round_steps * self.steps
        return np.where(self.active, np.minimum(r, last), math.inf), r >= last - EPS, np.flatnonzero(self.active)

    def kill(self, who: np.ndarray) -> None:
        """Kill `who` at their next death; each comes back after `down_s + restart_s` if the run has not ended."""
        f, p = self.f, self.p
        self.kills += len(who)
        kt = self.nk[who]
        self.incs.close(self.inc[who], kt, killed=True)
        self.died[who], self.expiry[who] = kt, kt + p.record_ttl_s
        ps = kt + f.down_s
        resume = ps + f.restart_s
        back = resume < self.end
        self.active[who[~back]] = False
        who, ps, resume = who[back], ps[back], resume[back]
        self.inc[who] = self.incs.new(who, ps, resume)
        self.rs[who] = resume
        self.rnd[who] = self.rnd.max()
        self.diverged[who] = False
        self.nk[who] = self.killer.next_after(who, ps)

    def kill_before_ready(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Kill the learners that die before their round ends; then `ready()`."""
        r, final, act = self.ready()
        while (dying := act[self.nk[act] < r[act]]).size:
            self.kill(dying)
            r, final, act = self.ready()
        return r, final, act

    def wait_for_records(self, r: np.ndarray, final: np.ndarray,
                         act: np.ndarray) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
        """Wait for every learner whose record is live, at most `sync_window_s`; returns when the group forms
        and `ready()` after the deaths meanwhile."""
        t_min = r[act].min()
        deadline = t_min + self.p.sync_window_s
        t_form = t_min
        while True:
            has_record = (self.rs <= t_form + EPS) & self.active
            block = max(r[has_record].max(initial=t_min),
                        self.expiry[(self.died <= t_form) & (self.expiry > t_form)].max(initial=t_form))
            new = min(max(t_form, block), deadline)
            dying = act[(self.nk[act] < new) & (r[act] <= new)]  # died while waiting: its record still counts
            if dying.size:
                self.kill(dying)
                r, final, act = self.ready()
                continue
            if new <= t_form + EPS:
                return t_form, r, final, act
            t_form = new

    def merge(self, members: np.ndarray, r: np.ndarray, final: np.ndarray, t_form: float) -> None:
        """The group `members` merges from `t_form`: a merge fails if one of them dies before it is done."""
        g = len(members)
        if g > 1:
            seconds, nbytes = merge_cost(self.scn, g, bool(self.diverged[members].any()))
            self.sent[members] += nbytes
        else:
            seconds = 0.0
        done = t_form + seconds
        good = g > 1 and not (self.nk[members] <= done).any()
        self.failed += int(g > 1 and not good)
        if good:
            self.sizes.append(g)
        self.diverged[members] = not good
        self.rows.append((members, self.inc[members], r[members], r[members] - self.rs[members], np.full(g, good),
                          np.full(g, done), self.nk[members]))
        self.rnd[members] = self.rnd[members].max() + 1
        if self.budget and self.rnd[members].max() >= self.budget:  # the step budget is reached: everyone stops
            final = np.ones(self.n, bool)
            members = np.flatnonzero(self.active)
        fin = members[final[members]]
        in_loop = members[~final[members]]
        self.train_end[in_loop] = np.maximum(self.train_end[in_loop], done)
        if self.budget:
            self.train_end[fin] = np.maximum(self.train_end[fin], done)
        self.active[fin] = False
        end = self.end
        self.incs.close(self.inc[fin], np.full(len(fin), max(done, end if math.isfinite(end) else done)), killed=False)
        self.rs[members] = done

    def ledger(self) -> Ledger:
        """What happened, for `goodput`."""
        incs = self.incs
        peer, rinc, ts, comp, ok, t_done, kill_after = (np.concatenate(c) for c in zip(*self.rows, strict=True))
        return Ledger(peer.astype(int), rinc.astype(int), ts, comp, ok.astype(bool), t_done, t_done < kill_after,
                      np.asarray(incs.peer), np.asarray(incs.start), np.asarray(incs.end),
                      np.asarray(incs.killed), np.asarray(self.sizes, int), self.failed, self.sent,
                      self.train_end, events=len(ts) + self.kills)
