"""A submitted round whose merge has not been applied yet (its future, what was submitted, its time bound), and when
a decoupled learner waits for one to land (`LandWait`)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

from p2pdiloco.network.merger import Contribution, MergeResult

logger = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A submitted round whose merge has not been applied yet."""

    future: Future
    local_at_submit: torch.Tensor
    contribution: Contribution
    submitted_at: float
    compute_s: float  # inner-step time that produced this contribution (lost if it never reaches a global model)
    peer_id: str
    bound_s: float  # no merge can legitimately take longer (`Learner.merge_bound`): past it the merger is hung

    def result(self) -> MergeResult | None:
        """The merge's result if it has finished, a merge alone if it hung, else None; never waits."""
        if self.future.done():
            return self.future.result()
        return self._hung() if self._overdue() else None

    def wait(self, should_stop: Callable[[], bool]) -> MergeResult | None:
        """Block until `result` has one; None (the merge cancelled) if `should_stop()` turns true first."""
        while True:
            try:
                return self.future.result(timeout=0.2)
            except FutureTimeout:
                if should_stop():
                    self.future.cancel()
                    return None
                if self._overdue():
                    return self._hung()

    def wait_up_to(self, seconds: float) -> float:
        """Block until the merge has finished or `seconds` have passed (never cancels it); returns the time waited."""
        t0 = time.monotonic()
        with contextlib.suppress(FutureTimeout, CancelledError):
            self.future.result(timeout=seconds)
        return time.monotonic() - t0

    def _overdue(self) -> bool:
        return time.monotonic() - self.submitted_at > self.bound_s

    def _hung(self) -> MergeResult:
        """A merger bug must not stop this peer from ever merging again: give up on it, keep our own update."""
        logger.error("[%s] merge did not finish in %.0f s; merging alone", self.peer_id[-6:], self.bound_s)
        self.future.cancel()
        c = self.contribution
        return MergeResult(group=[self.peer_id], pseudo_grad=c.pseudo_grad, total_weight=c.weight,
                           failure="merger hung")


@dataclass
class LandWait:
    """When a decoupled learner waits, after a submit, for that merge to land (`outer.land_wait`): while such waits pay.

    A wait that ends with the merge landed leaves no inner step in flight, which is what `--sync` gets per step; one
    that ends without it is wall time lost. A peer waits every round until `patience` waits in a row have missed;
    after k > `patience` misses in a row the next 2^(k - patience) - 1 rounds (at most `max_skip`) do not wait,
    then one does again. Where merges take longer than the bound (short rounds, slow links) a peer spends about one
    wait in `max_skip` + 1 rounds, and it waits every round again once one lands. Backing off on the first miss
    was measured to lock a swarm out of the wait (docs/benchmarks.md, parity): a peer that trains on while its
    mates merge slows their merges, which then miss more.
    """

    share: float  # of the last round's wall time; 0: never wait
    patience: int = 2
    max_skip: int = 31
    misses: int = 0  # missed waits in a row
    skip: int = 0  # rounds left without a wait

    def due(self) -> bool:
        """Whether to wait for the merge just submitted (call once a round)."""
        if self.share <= 0:
            return False
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def record(self, landed: bool) -> None:
        """The wait just done ended with the merge landed, or not."""
        self.misses = 0 if landed else self.misses + 1
        self.skip = min(2 ** max(0, self.misses - self.patience) - 1, self.max_skip)
