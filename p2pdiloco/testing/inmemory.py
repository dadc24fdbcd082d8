"""An in-memory stand-in for the merger, for tests of the learner loop (no DHT, no sockets)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from p2pdiloco.algorithm.outer import weight_shares, weighted_average
from p2pdiloco.network.merger import Contribution, Merged, MergeOutcome, MergeStats


@dataclass
class _Rendezvous:
    expected: int
    contributions: dict[str, Contribution] = field(default_factory=dict)
    futures: dict[str, Future] = field(default_factory=dict)


class InMemoryMerger:
    """A fake merger for tests: peers in one process that share a `hub` dict merge once `group_size` arrive.

    It keeps the merger's contract (tests/test_merge_contract.py runs the same scenarios against it and `P2PMerger`):
    the weighted average of what the members send (`Contribution.compensated`, else Δ), their total weight, where
    their global models differ the state-weighted average of their (θg, momentum) standing for the lower median of
    their state weights (`Group.agreed_state_weight`), and `final` if any member's contribution was its last.

    Args:
        peer_id: this peer's id.
        hub: a dict shared by all fakes of one test, with a "lock" and "group_size" entry.
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
                return future
            del self.hub["pending"]
        group = sorted(rv.contributions)
        members = [rv.contributions[p] for p in group]
        sent = [c.pseudo_grad if c.compensated is None else c.compensated for c in members]
        avg = weighted_average(sent, [c.weight for c in members])
        state, shares = None, [0.0] * len(members)
        if len({c.state_digest for c in members}) > 1:
            state = weighted_average(
                [torch.cat([c.global_params, c.momentum]) for c in members], [c.state_weight for c in members]
            )
            shares = weight_shares([c.state_weight for c in members])
        total = sum(c.weight for c in members)
        claims = sorted(c.state_weight for c in members)
        state_weight = claims[(len(claims) - 1) // 2] if state is not None else 0.0
        final = any(c.final for c in members)
        for p, share, mine in zip(group, shares, sent, strict=True):
            rv.futures[p].set_result(Merged(
                average=avg, weight=total, agreed_state=state, state_weight=state_weight, final=final, sent=mine,
                stats=MergeStats(group=list(group), state_share=share)))
        return future

    def take_round_shift(self) -> float:
        return 0.0

    def close(self) -> None:
        pass
