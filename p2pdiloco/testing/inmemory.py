"""An in-memory stand-in for the merger, for tests of the learner loop (no DHT, no sockets)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from p2pdiloco.algorithm.outer import weight_shares, weighted_average
from p2pdiloco.network.merger import Contribution, MergeResult


@dataclass
class _Rendezvous:
    expected: int
    contributions: dict[str, Contribution] = field(default_factory=dict)
    futures: dict[str, Future] = field(default_factory=dict)


class InMemoryMerger:
    """A fake merger for tests: peers in one process that share a `hub` dict merge once `group_size` arrive.

    Args:
        peer_id: this peer's id.
        hub: a dict shared by all fakes of one test, with a "lock" and "group_size" entry.
    """

    def __init__(self, peer_id: str, hub: dict):
        self.peer_id = peer_id
        self.hub = hub
        hub.setdefault("lock", threading.Lock())

    def submit(self, contribution: Contribution) -> Future[MergeResult]:
        future: Future[MergeResult] = Future()
        with self.hub["lock"]:
            rv = self.hub.setdefault("pending", _Rendezvous(self.hub["group_size"]))
            rv.contributions[self.peer_id] = contribution
            rv.futures[self.peer_id] = future
            if len(rv.contributions) < rv.expected:
                return future
            del self.hub["pending"]
        group = sorted(rv.contributions)
        members = [rv.contributions[p] for p in group]
        avg = weighted_average([c.pseudo_grad for c in members], [c.weight for c in members])
        state, shares = None, [0.0] * len(members)
        if len({c.state_digest for c in members}) > 1:
            state = weighted_average(
                [torch.cat([c.global_params, c.momentum]) for c in members], [c.state_weight for c in members]
            )
            shares = weight_shares([c.state_weight for c in members])
        total = sum(c.weight for c in members)
        state_weight = max(c.state_weight for c in members)
        final = any(c.final for c in members)
        for p, share in zip(group, shares, strict=True):
            rv.futures[p].set_result(
                MergeResult(group=group, pseudo_grad=avg, total_weight=total, global_state=state, state_weight=state_weight,
                            final=final, state_share=share)
            )
        return future

    def close(self) -> None:
        pass
