"""Merge groups as the shipped protocol forms them, what their merges cost, and the learners' global models.

- `Dealer`: every epoch (`merge.epoch_s`) the census is dealt into groups of at most `merge.group_size` in the
  order of `network/census.leader_rank`, round-robin into the fewest groups, as `census.my_group` deals them
  (tests/test_sim_groups.py checks the two agree).
- `merge_cost`: a group merge's seconds and bytes, the Δ exchange and the (θg, momentum) agreement apart. The
  agreement runs beside the Δ exchange (docs/architecture.md, "Agreement"), so the merge takes the longer of the two.
- `Models`: which global model every learner holds (an id: a group merge gives its members one new id, a merge
  alone its learner a new one of its own), the last `merge.state_anchors` it held (the anchors an agreement
  needs), how many distinct models the swarm holds, and how a contribution spreads from group to group.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter

import numpy as np

from p2pdiloco.sim.scenario import Scenario, bytes_per_value

RUN_ID = "sim"
"""The run id the simulated learners' ranks are hashed with (any fixed string: it only seeds the orders)."""


def leader_rank(run_id: str, peer: str, epoch: int) -> bytes:
    """`network/census.leader_rank`'s hash, the same bytes (tests/test_sim_groups.py checks it against that function
    and the groups against `census.my_group`): copied, not imported, because importing `network/census.py` imports
    hivemind, seconds of a simulation's start on 2 cores for one line of hashing."""
    return hashlib.blake2b(f"{run_id}\x00{peer}\x00{epoch}".encode(), digest_size=16).digest()


def deal(census: list[str], epoch: int, group_size: int, run_id: str = RUN_ID) -> list[list[str]]:
    """The groups of `epoch`: `census` in `leader_rank` order dealt round-robin into the fewest groups of at most
    `group_size` (`census.my_group` for every member at once); each group in leader order."""
    order = sorted(set(census), key=lambda p: leader_rank(run_id, p, epoch))
    n_groups = -(-len(order) // group_size) if order else 0
    return [order[i::n_groups] for i in range(n_groups)]


class Dealer:
    """Each epoch's groups of learners 0..n-1 (names `str(i)`), dealt when the epoch is first asked for.

    Args:
        n: learners.
        group_size: `merge.group_size`.
        epoch_s: `merge.epoch_s`.
    """

    def __init__(self, n: int, group_size: int, epoch_s: float):
        self.n, self.group_size, self.epoch_s = n, group_size, epoch_s
        self.epoch = -1
        self.groups: list[list[int]] = []
        self.group_of: dict[int, list[int]] = {}

    def mates(self, learner: int, t: float, census) -> list[int]:
        """`learner`'s group (itself included, in leader order) in the epoch of `t`; `census(epoch)` lists the
        learners registered for an epoch. A learner missing from it (joined during the epoch) merges with the
        group its rank would fall in, as the others read the census again when it announces itself."""
        epoch = int(t // self.epoch_s)
        if epoch != self.epoch:
            self.epoch = epoch
            self.groups = [[int(p) for p in g] for g in deal([str(i) for i in census(epoch)], epoch, self.group_size)]
            self.group_of = {p: g for g in self.groups for p in g}
        got = self.group_of.get(learner)
        if got is None:
            if self.groups:
                rank = int.from_bytes(leader_rank(RUN_ID, str(learner), epoch)[:4], "big")
                got = self.groups[rank % len(self.groups)]
                got.append(learner)
            else:
                got = [learner]
                self.groups.append(got)
            self.group_of[learner] = got
        return got


def delta_bytes(scn: Scenario, g: int) -> float:
    """Bytes each of `g` members sends in the Δ exchange: 2(g−1)/g of the payload through slice owners, or g − 1
    copies of its part for a gathered (sparse) codec (network/sparse_exchange.py)."""
    n = scn.network
    share = g - 1 if n.codec == "sparseloco" else 2 * (g - 1) / g
    return share * n.params * bytes_per_value(n.codec)


def agreement(scn: Scenario, models: list[int], anchors: list[list[int]]) -> tuple[str, list[float], int]:
    """How a group whose members hold `models` agrees on (θg, momentum), and the bytes each member sends.

    Returns:
        (kind, bytes per member, exchange phases): "none" where all hold one model; "catch_up" where more than
        half hold one (each other member fetches it, fp32, 8 bytes a parameter, from a holder dealt round-robin);
        "anchored" where all hold a common anchor (int8 differences from it, ~1 byte a value of θg and momentum);
        else "two_exchanges" (the states averaged int8, then the model's difference: 3 bytes a parameter in all).
    """
    g, p = len(models), scn.network.params
    top, count = Counter(models).most_common(1)[0]
    if count == g:
        return "none", [0.0] * g, 0
    share = 2 * (g - 1) / g
    if count > g / 2:
        holders = [i for i, m in enumerate(models) if m == top]
        sent = [0.0] * g
        fetchers = g - count
        for k in range(fetchers):
            sent[holders[k % len(holders)]] += 8.0 * p
        return "catch_up", sent, 1
    common = set(anchors[0]).intersection(*anchors[1:])
    if common:
        return "anchored", [share * 2 * p * bytes_per_value("int8")] * g, 1
    return "two_exchanges", [share * 3 * p * bytes_per_value("int8")] * g, 2


def merge_cost(scn: Scenario, models: list[int], anchors: list[list[int]]) -> tuple[float, float, list[float], str]:
    """(seconds, Δ bytes each member sends, agreement bytes per member, agreement kind) of one group merge: the
    fixed matchmaking cost, then the Δ exchange and the agreement side by side, each at the link's rate."""
    n = scn.network
    g = len(models)
    d = delta_bytes(scn, g)
    kind, agree, phases = agreement(scn, models, anchors)
    rate = n.bandwidth_gbps * 1e9 / 8
    delta_s = 2 * n.latency_s + d / rate
    agree_s = phases * 2 * n.latency_s + max(agree) / rate if phases else 0.0
    return n.matchmaking_s + max(delta_s, agree_s), d, agree, kind


class Models:
    """Every learner's global model (an id), its recent anchors, and the spread of sample contributions.

    Args:
        n: learners.
        anchors: `merge.state_anchors`.
        origins: when to start following a contribution (seconds; one per sample): the first group merge at or
            after each time is followed until every learner that is up holds it.
    """

    def __init__(self, n: int, anchors: int, origins: list[float]):
        self.model = [0] * n  # every learner starts from one initial model (`model.init_seed`)
        self.next_id = 0
        self.keep = max(anchors, 1)
        self.anchors = [[0] for _ in range(n)]
        self.origins = sorted(origins)
        self.reach: list[set[int]] = [set() for _ in origins]
        self.started = np.full(len(origins), math.nan)
        self.mixed = np.full(len(origins), math.nan)
        self.waiting = list(range(len(origins)))
        """Followed contributions not started yet, and those started that have not reached everyone."""
        self.following: list[int] = []

    def _hold(self, learner: int, model: int) -> None:
        self.model[learner] = model
        a = self.anchors[learner]
        if model not in a:
            a.append(model)
            if len(a) > self.keep:
                del a[0]

    def merged(self, members: list[int], t: float) -> None:
        """A group merge landed at `t`: its members hold one new model, with every contribution any of them held."""
        self.next_id += 1
        for q in members:
            self._hold(q, self.next_id)
        if self.waiting and t >= self.origins[self.waiting[0]]:  # the next followed contribution is this one
            k = self.waiting.pop(0)
            self.started[k] = t
            self.reach[k].update(members)
            self.following.append(k)
            return
        for k in list(self.following):
            held = self.reach[k]
            if any(q in held for q in members):
                held.update(members)
                if len(held) >= len(self.model):
                    self.mixed[k] = t
                    self.following.remove(k)

    def alone(self, learner: int) -> None:
        """`learner` merged alone (or its group failed): a model of its own."""
        self.next_id += 1
        self._hold(learner, self.next_id)

    def restarted(self, learner: int, donor: int) -> None:
        """`learner` came back and downloaded `donor`'s state."""
        self.anchors[learner] = []
        self._hold(learner, self.model[donor])
        for k in self.following:
            held = self.reach[k]
            if donor in held:
                held.add(learner)
            else:
                held.discard(learner)

    def distinct(self, learners: list[int] | None = None) -> int:
        """How many distinct global models `learners` (default: all) hold."""
        return len({self.model[q] for q in (range(len(self.model)) if learners is None else learners)})

    def mixing_s(self) -> list[float]:
        """Per followed contribution: seconds from its group merge until every learner held it (a restarted one
        holds what its donor held; nan: not within the run)."""
        return (self.mixed - self.started).tolist()
