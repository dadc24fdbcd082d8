"""An in-memory stand-in for the merger, for tests of the learner loop (no DHT, no sockets)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from p2pdiloco.algorithm.guards import bounded_weights
from p2pdiloco.algorithm.outer import weight_shares, weighted_average
from p2pdiloco.network.merger import Alone, Contribution, Merged, MergeOutcome, MergeStats


@dataclass
class _Rendezvous:
    expected: int
    contributions: dict[str, Contribution] = field(default_factory=dict)
    futures: dict[str, Future] = field(default_factory=dict)


class InMemoryMerger:
    """A fake merger for tests: peers in one process that share a `hub` dict merge once `group_size` arrive.

    It keeps the merger's contract (tests/test_merge_contract.py runs the same scenarios against it and `P2PMerger`):
    the weighted average of what the members send (`Contribution.compensated`, else Δ) and their total weight, their
    claims capped as a group caps them (`guards.bounded_weights`), where
    their global models differ the state-weighted average of their (θg, momentum) standing for the lower median of
    their state weights (`Group.agreed_state_weight`), and `final` if any member's contribution was its last.

    Args:
        peer_id: this peer's id.
        hub: a dict shared by all fakes of one test, with a "lock" and "group_size" entry, and optionally
            "window_s": a peer still waiting for its group after that many seconds merges `Alone` (default: it waits
            until the group is complete).
    """

    def __init__(self, peer_id: str, hub: dict):
        self.peer_id = peer_id
        self.hub = hub
        hub.setdefault("lock", threading.Lock())

    def submit(self, contribution: Contribution) -> Future[MergeOutcome]:
        future: Future[MergeOutcome] = Future()
        with self.hub["lock"]:
            rv = self.hub.setdefault("pending", _Rendezvous(self.hub["group_size"]))
            rv.contributions[self.peer_id] = contribution
            rv.futures[self.peer_id] = future
            if len(rv.contributions) < rv.expected:
                if self.hub.get("window_s") is not None:
                    timer = threading.Timer(self.hub["window_s"], self._alone, (rv,))
                    timer.daemon = True
                    timer.start()
                return future
            del self.hub["pending"]
        group = sorted(rv.contributions)
        members = [rv.contributions[p] for p in group]
        sent = [c.pseudo_grad if c.compensated is None else c.compensated for c in members]
        # claims as a group counts them (network/group.py)
        weights, state_weights = bounded_weights([c.weight for c in members]), bounded_weights([c.state_weight for c in members])
        avg = weighted_average(sent, weights)
        state, shares = None, [0.0] * len(members)
        if len({c.state_digest for c in members}) > 1:
            state = weighted_average([torch.cat([c.global_params, c.momentum]) for c in members], state_weights)
            shares = weight_shares(state_weights)
        total = float(sum(weights))
        claims = sorted(state_weights)
        state_weight = claims[(len(claims) - 1) // 2] if state is not None else 0.0
        final = any(c.final for c in members)
        for p, share, mine in zip(group, shares, sent, strict=True):
            rv.futures[p].set_result(Merged(
                average=avg, weight=total, agreed_state=state, state_weight=state_weight, final=final, sent=mine,
                stats=MergeStats(group=list(group), state_share=share)))
        return future

    def _alone(self, rv: _Rendezvous) -> None:
        """The window is over and this peer's group is not complete: it leaves it and merges alone."""
        with self.hub["lock"]:
            if self.hub.get("pending") is not rv:
                return  # its group completed meanwhile
            future = rv.futures.pop(self.peer_id, None)
            rv.contributions.pop(self.peer_id, None)
        if future is not None and future.set_running_or_notify_cancel():
            future.set_result(Alone(stats=MergeStats(group=[self.peer_id])))

    def take_round_shift(self) -> float:
        return 0.0

    def stop_looking(self) -> None:
        pass

    def close(self) -> None:
        pass
