"""A submitted round whose merge has not been applied yet: its future, what was submitted, and its time bound."""

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
