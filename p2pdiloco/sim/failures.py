"""When each simulated learner fails: a Poisson process per learner, `bench churn`'s chaos schedule, or both."""

from __future__ import annotations

import math

import numpy as np

from p2pdiloco.sim.scenario import Scenario


class Killer:
    """The next failure of any learner after a given time.

    Poisson failures are memoryless, so the next one after `t` is drawn when asked (`t` + an exponential of
    mean `mtbf_s`). The chaos schedule is fixed up front as `bench churn`'s `Chaos` runs it: every
    `kill_every_s` seconds one learner, uniformly among those whose process is running (not inside its
    `down_s`), is killed, and never the last one running.

    Args:
        scn: the scenario (learners, failures, duration).
        rng: the simulation's random generator (draws happen in a fixed order, so a seed gives one run).
    """

    def __init__(self, scn: Scenario, rng: np.random.Generator):
        f, n = scn.failures, scn.run.learners
        self.rng, self.mtbf = rng, f.mtbf_s
        self.chaos: list[np.ndarray] = [np.empty(0)] * n
        self.has_chaos = False
        if f.kill_every_s > 0:
            horizon = 3 * (f.first_start_s + scn.duration)  # slower algorithms run longer
            times: list[list[float]] = [[] for _ in range(n)]
            back = np.zeros(n)  # when each learner's process is running again
            for k in range(1, int(horizon / f.kill_every_s) + 1):
                t = k * f.kill_every_s
                running = np.flatnonzero(back <= t)
                if len(running) < 2:
                    continue
                victim = int(running[rng.integers(len(running))])
                times[victim].append(t)
                back[victim] = t + f.down_s
            self.chaos = [np.asarray(ts, dtype=float) for ts in times]
        self.has_chaos = any(len(s) for s in self.chaos)

    def next_after(self, peers: np.ndarray, t: np.ndarray) -> np.ndarray:
        """The next failure time of each of `peers` strictly after its `t` (inf: none)."""
        out = np.full(len(peers), math.inf)
        if math.isfinite(self.mtbf):
            out = t + self.rng.exponential(self.mtbf, len(peers))
        if not self.has_chaos:
            return out
        for k, (p, tk) in enumerate(zip(peers, t, strict=True)):
            sched = self.chaos[p]
            if len(sched):
                i = np.searchsorted(sched, tk, side="right")
                if i < len(sched):
                    out[k] = min(out[k], sched[i])
        return out


def step_times(scn: Scenario, rng: np.random.Generator) -> np.ndarray:
    """Each learner's inner-step time, seconds: `speeds` per learner or as a mix, times a lognormal jitter."""
    c, n = scn.compute, scn.run.learners
    if len(c.speeds) == n:
        mult = np.asarray(c.speeds, dtype=float)
    else:
        shares = np.asarray(c.speed_fractions or [1.0] * len(c.speeds), dtype=float)
        counts = np.floor(shares / shares.sum() * n).astype(int)
        counts[0] += n - counts.sum()
        mult = np.repeat(np.asarray(c.speeds, dtype=float), counts)
    if c.jitter > 0:
        mult = mult * rng.lognormal(0.0, c.jitter, n)
    return c.step_s * mult
