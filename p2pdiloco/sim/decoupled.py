"""Decoupled DiLoCo as p2pdiloco ships it, simulated event by event (training/learner.py, network/matchmaking.py).

A learner's round ends at the first step past the next multiple of `round_seconds` (timed rounds) or after
`round_steps` steps, but never while its last merge is in flight (`Learner.round_done`): a merge longer than a
round lengthens the next one. After a submit it waits up to `land_wait` of the round for that merge to land where
its recent group merges' exchanges fit that bound (`LandWait`); a merge that lands later finds inner steps taken
meanwhile, of which its rebase keeps `rebase_keep` (all of them after a merge alone, with eager updates): the rest
are given up, and taken off the next round's compute as bench/goodput.py takes `rebase_dropped_s` off.

Groups: the earliest waiting contribution leads. Its mates are its group of the epoch (`groups.Dealer`); the group
is the mates ready within its window (`window_fraction` of its recent rounds within [`min_window_s`,
`merge_window_s`], doubled after each merge alone), formed as soon as every live mate is ready. A run's closing
merges (within 1.5 rounds of the end) wait `merge_window_s` for anyone, as `find_group` lets them. A member that
dies before the merge ends fails the group: everyone merges alone that round. Merges cost `groups.merge_cost`,
the agreement included when members' models differ; a restarted learner downloads a random learner's model.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque

import numpy as np

from p2pdiloco.sim.failures import Killer
from p2pdiloco.sim.groups import Dealer, Models, merge_cost
from p2pdiloco.sim.scenario import Scenario
from p2pdiloco.sim.swarm import EPS, Incarnations, Ledger

FOLLOWED = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
"""Where in the run (share of its duration) the contributions whose spread is followed start."""


def _median(values) -> float:
    h = sorted(values)
    m = len(h) // 2
    return h[m] if len(h) % 2 else 0.5 * (h[m - 1] + h[m])


class DecoupledSwarm:
    """The learners of one decoupled simulation (see the module docstring); `run()` returns the ledger."""

    def __init__(self, scn: Scenario, steps: np.ndarray, killer: Killer, rng: np.random.Generator):
        self.scn, self.p, self.f, self.killer, self.rng = scn, scn.protocol, scn.failures, killer, rng
        n = self.n = len(steps)
        self.steps = steps.tolist()
        t0 = self.t0 = self.f.first_start_s
        self.end = t0 + scn.duration
        self.incs = Incarnations(n, t0)
        # one entry a learner: its incarnation, process start, last death, next failure (nk), its pending submit
        # (pend, inf: none; ver invalidates its older heap entries), that round's net and gross compute, the previous
        # submit, whether the round is its last and whether it is within its closing rounds, the inner-step seconds
        # its last merge's rebase gave up, the EMA of its round times and its merges alone in a row (the window),
        # its last group merges' exchange times (`LandWait`), and whether it left the run
        self.inc = list(range(n))
        self.proc_start, self.last_death = [0.0] * n, [-math.inf] * n
        self.nk = killer.next_after(np.arange(n), np.zeros(n)).tolist()
        self.pend, self.ver = [math.inf] * n, [0] * n
        self.comp, self.trained = [0.0] * n, [0.0] * n
        self.prev, self.final, self.closing = [t0] * n, [False] * n, [False] * n
        self.dropped, self.ema, self.streak = [0.0] * n, [0.0] * n, [0] * n
        self.exchanges = [deque(maxlen=5) for _ in range(n)]
        self.gone = [False] * n
        self.n_gone = 0
        self.heap: list[tuple[float, int, int]] = []
        self.dealer = Dealer(n, self.p.group_size, self.p.epoch_s)
        self.models = Models(n, self.p.state_anchors, [t0 + k * scn.duration for k in FOLLOWED])
        self.rows: list[tuple] = []
        self.sizes: list[int] = []
        self.failed = self.kills = 0
        self.delta_sent, self.agree_sent = [0.0] * n, [0.0] * n
        self.kinds: Counter = Counter()
        self.distinct: list[int] = []

    def run(self) -> Ledger:
        for q in range(self.n):
            self._next_round(q, self.t0, self.t0, -math.inf)
        while self.heap:
            ts, q, ver = heapq.heappop(self.heap)
            if ver != self.ver[q]:
                continue
            members, t_form = self._form(q, ts)
            self._merge(members, t_form)
        return self._ledger()

    # ---- a learner's rounds ----

    def _next_round(self, q: int, s_prev: float, resume: float, landed: float) -> None:
        """Schedule `q`'s next submit: its round starts (steps resume) at `resume`, its clock's round at `s_prev`,
        and it cannot end before the merge that lands at `landed`."""
        p, step, end = self.p, self.steps[q], self.end
        last = resume + math.floor((end - resume) / step + EPS) * step
        if last <= resume + EPS:
            return self._finish(q)
        if p.round_seconds > 0:
            tick = (math.floor(s_prev / p.round_seconds + EPS) + 1) * p.round_seconds
            e = resume + max(math.ceil((tick - resume) / step - EPS), 1) * step
        else:
            e = resume + p.round_steps * step
        if landed > resume:  # no submit while the last merge is in flight: the round goes on until it lands
            e = max(e, resume + math.ceil((landed - resume) / step - EPS) * step)
        final = e >= last - EPS
        submit = max(last, landed) if final else e
        if self.nk[q] < submit:
            return self._kill(q)
        trained = (last if final else e) - resume
        round_s = submit - s_prev
        self.ema[q] = round_s if self.ema[q] == 0 else 0.5 * self.ema[q] + 0.5 * round_s
        self.trained[q], self.comp[q] = trained, max(trained - self.dropped[q], 0.0)
        self.final[q], self.closing[q] = final, end - submit <= 1.5 * round_s
        self.pend[q] = submit
        self.ver[q] += 1
        heapq.heappush(self.heap, (submit, q, self.ver[q]))

    def _finish(self, q: int) -> None:
        self.incs.close(np.asarray([self.inc[q]]), np.asarray([self.end]), killed=False)
        self.pend[q], self.gone[q] = math.inf, True
        self.n_gone += 1
        self.ver[q] += 1

    def _kill(self, q: int) -> None:
        """`q` dies at its next failure; its process starts again `down_s` later and trains after `restart_s`
        from another learner's global model (drawn at random), unless the run has ended by then."""
        t = self.nk[q]
        self.kills += 1
        self.incs.close(np.asarray([self.inc[q]]), np.asarray([t]), killed=True)
        self.last_death[q], self.pend[q] = t, math.inf
        self.ver[q] += 1
        start = t + self.f.down_s
        train = start + self.f.restart_s
        if train >= self.end:
            self.gone[q] = True
            self.n_gone += 1
            return
        self.inc[q] = int(self.incs.new(np.asarray([q]), np.asarray([start]), np.asarray([train]))[0])
        self.proc_start[q] = start
        self.nk[q] = float(self.killer.next_after(np.asarray([q]), np.asarray([start]))[0])
        donor = int(self.rng.integers(max(self.n - 1, 1)))  # any other learner
        self.models.restarted(q, donor + (donor >= q and self.n > 1))
        self.streak[q], self.ema[q], self.dropped[q], self.prev[q] = 0, 0.0, 0.0, train
        self.exchanges[q].clear()
        self._next_round(q, train, train, -math.inf)

    def _land(self, q: int, s: float, landed: float, ok: bool, exchange_s: float) -> None:
        """`q`'s merge of the round submitted at `s` landed at `landed`: wait for it where `LandWait` would, give
        up the stale share of the steps taken while it was in flight, and schedule the next round."""
        p, step = self.p, self.steps[q]
        round_s = s - self.prev[q]
        bound = p.land_wait * round_s
        hist = self.exchanges[q]
        due = p.land_wait > 0 and round_s > 0 and (not hist or _median(hist) < bound)
        if ok:
            hist.append(exchange_s)
        resume = s + (min(bound, max(landed - s, 0.0)) if due else 0.0)
        keep = p.rebase_keep if ok or not p.eager else 1.0
        in_flight = math.ceil((landed - resume) / step - EPS) if landed > resume + EPS else 0
        self.dropped[q] = in_flight * step * (1.0 - keep)
        self.streak[q] = 0 if ok else self.streak[q] + 1
        self.prev[q] = s
        if self.final[q]:
            return self._finish(q)
        self._next_round(q, s, resume, landed)

    # ---- groups ----

    def _alive(self, q: int, t: float) -> bool:
        return not self.gone[q] and self.proc_start[q] <= t < self.nk[q]

    def _census(self, epoch: int) -> list[int]:
        """Learners registered for `epoch`: running in it or the one before (a registration stands for two)."""
        lo, hi = (epoch - 1) * self.p.epoch_s, (epoch + 1) * self.p.epoch_s
        alive = [q for q in range(self.n) if not self.gone[q] and (self.proc_start[q] <= hi or self.last_death[q] >= lo)]
        self.distinct.append(self.models.distinct(alive))
        return alive

    def _form(self, lead: int, ts: float) -> tuple[list[int], float]:
        """The group `lead`'s contribution (ready at `ts`, the earliest waiting) merges in, and when it forms."""
        p = self.p
        if self.closing[lead]:  # a run's last merges wait the whole window and take every mate they can reach
            deadline = ts + p.merge_window_s
            ready = [lead]
            while self.heap and self.heap[0][0] <= deadline:
                t, q, ver = heapq.heappop(self.heap)
                if ver == self.ver[q]:
                    ready.append(q)
            # every learner still in the run ready: count who of them is up (else some are not ready: wait)
            live = sum(1 for q in range(self.n) if self._alive(q, ts)) if len(ready) >= self.n - self.n_gone \
                else len(ready) + 1
        else:
            mates = self.dealer.mates(lead, ts, self._census)
            window = max(p.min_window_s, p.window_fraction * self.ema[lead]) * 2 ** min(self.streak[lead], 8)
            deadline = ts + min(p.merge_window_s, window)
            ready = [lead] + [q for q in mates if q != lead and self.pend[q] <= deadline]
            live = sum(1 for q in mates if self._alive(q, ts))
        if len(ready) >= live:
            return ready, max(self.pend[q] for q in ready)
        return ready, deadline if live > 1 else ts

    def _merge(self, members: list[int], t_form: float) -> None:
        """The group `members` merges from `t_form`; every member's merge lands and its next round is scheduled."""
        submits = [self.pend[q] for q in members]
        for q in members:
            self.pend[q] = math.inf
            self.ver[q] += 1
        ok, done, exchange_s = False, t_form, 0.0
        if len(members) > 1:
            models = [self.models.model[q] for q in members]
            seconds, d, agree, kind = merge_cost(self.scn, models, [self.models.anchors[q] for q in members])
            done = t_form + seconds
            for q, a in zip(members, agree, strict=True):
                self.delta_sent[q] += d
                self.agree_sent[q] += a
            ok = not any(self.nk[q] <= done for q in members)  # a member died mid-merge: nobody applies it
            self.failed += not ok
            if ok:
                self.kinds[kind] += 1
                self.sizes.append(len(members))
                self.models.merged(members, done)
            exchange_s = seconds - self.scn.network.matchmaking_s
        for q, s in zip(members, submits, strict=True):
            self.rows.append((q, self.inc[q], s, self.comp[q], ok, done, self.nk[q], self.trained[q]))
            if not ok:
                self.models.alone(q)
            self._land(q, s, done, ok, exchange_s)

    def _ledger(self) -> Ledger:
        peer, inc, ts, comp, ok, done, kill_after, trained = (np.asarray(c) for c in zip(*self.rows, strict=True)) \
            if self.rows else (np.empty(0),) * 8
        incs = self.incs
        ledger = Ledger(peer.astype(int), inc.astype(int), ts, comp, ok.astype(bool), done, done < kill_after,
                        np.asarray(incs.peer), np.asarray(incs.start), np.minimum(np.asarray(incs.end), self.end),
                        np.asarray(incs.killed), np.asarray(self.sizes, int), self.failed,
                        np.add(self.delta_sent, self.agree_sent), np.full(self.n, self.end), events=len(ts) + self.kills)
        survivors = [q for q in range(self.n) if not self.incs.killed[self.inc[q]]]
        ledger.extra.update({
            "end": self.end, "trained": trained, "delta_bytes": np.asarray(self.delta_sent),
            "agreement_bytes": np.asarray(self.agree_sent),
            "agreements": dict(self.kinds), "mixing_s": self.models.mixing_s(), "distinct_models": self.distinct,
            "final_models": self.models.distinct(survivors)})
        return ledger


def simulate_decoupled(scn: Scenario, steps: np.ndarray, killer: Killer, rng: np.random.Generator) -> Ledger:
    """Decoupled rounds as shipped (see the module docstring)."""
    return DecoupledSwarm(scn, steps, killer, rng).run()
