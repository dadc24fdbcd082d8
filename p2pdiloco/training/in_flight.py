"""A submitted round whose merge has not been applied yet (its future, what was submitted, its time bound), and when
a decoupled learner waits for one to land (`LandWait`)."""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import torch

from p2pdiloco.network.merger import Alone, Contribution, Merged, MergeOutcome, Merger, MergeStats
from p2pdiloco.network.peer_tag import PeerLog

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

    def result(self) -> MergeOutcome | None:
        """The merge's result if it has finished, a merge alone if it hung, else None; never waits."""
        if self.future.done():
            return self.future.result()
        return self._hung() if self._overdue() else None

    def wait(self, should_stop: Callable[[], bool]) -> MergeOutcome | None:
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

    def at_stop(self, merger: Merger, seconds: float) -> Merged | None:
        """This peer was told to stop: its searches end (`Merger.stop_looking`), and a merge whose group formed is
        waited for up to `seconds`, so that its mates' merge does not fail on this peer's leaving. Returns that
        merge to apply; None (the merge cancelled) if it found no group or did not finish in time: applied alone, its
        Δ would leave this peer's last global model apart from its mates' for nothing."""
        merger.stop_looking()
        self.wait_up_to(seconds)
        outcome = self.future.result() if self.future.done() and not self.future.cancelled() else None
        if isinstance(outcome, Merged) and len(outcome.stats.group) > 1:
            return outcome
        self.future.cancel()
        return None

    def _overdue(self) -> bool:
        return time.monotonic() - self.submitted_at > self.bound_s

    def _hung(self) -> Alone:
        """A merger bug must not stop this peer from ever merging again: give up on it, keep our own update."""
        PeerLog(logger, self.peer_id).error("merge did not finish in %.0f s; merging alone", self.bound_s)
        self.future.cancel()
        return Alone("merger hung", MergeStats(group=[self.peer_id]))


@dataclass
class LandWait:
    """When a decoupled learner waits, after a submit, for that merge to land (`outer.land_wait`): where it can.

    A wait that ends with the merge landed leaves no inner step in flight, which is what `--sync` gets per step; one
    that ends without it is wall time lost. A merge cannot land before its exchange is done, however well the
    members' round ends meet, so a peer waits only while its recent group merges' exchanges (result less
    matchmaking: the median of the last `window`) took less than the bound: where merges are slower than it
    (short rounds, slow links) it does not wait at all. Its misses are no signal: a peer that submits before its
    mates waits through their matchmaking and misses, and only its waiting moves its round ends onto theirs;
    backing off on misses was measured to leave such peers out of the wait for good (docs/experiments.md,
    "`outer.land_wait`: when to wait").
    """

    share: float  # of the last round's wall time; 0: never wait
    window: int = 5
    exchanges: deque = field(init=False)  # seconds of the last `window` group merges' exchanges

    def __post_init__(self) -> None:
        self.exchanges = deque(maxlen=self.window)

    def bound_s(self, round_s: float) -> float:
        return self.share * round_s

    def due(self, round_s: float) -> bool:
        """Whether to wait for the merge just submitted, in a round of `round_s`."""
        if self.share <= 0 or round_s <= 0:
            return False
        return not self.exchanges or statistics.median(self.exchanges) < self.bound_s(round_s)

    def record(self, outcome: MergeOutcome) -> None:
        """A merge landed (waited for or not); a group merge's exchange time goes into the window."""
        if isinstance(outcome, Alone):
            return
        self.exchanges.append(max(0.0, outcome.stats.duration_s - outcome.stats.match_s))
