"""A round handed to the merger: its merge in flight (`InFlight`), and its Δ taken only when its merge group forms
(`OpenRound`, `outer.train_until_matched`).

A decoupled peer whose round ends looks for a group, and its mates' rounds end a little later: at 4 peers in
`bench parity` (H = 50) a merge took 0.18 s, of which 0.06 s waiting for the last mate and 0.03 s forming the
group, then 0.10 s exchanging. Steps taken meanwhile are stale: they start from a model the merge does not land
on, and half of their progress is given up when it lands (`outer.rebase_keep`). The first two parts need no Δ:
only who is ready. So the peer trains on *in the same round* while it looks, and Δ is taken from the last step it
finished when the group forms: the waiting steps are in the merged Δ instead of stale (the "dynamic local
updates" of Async Local-SGD, arXiv 2401.09135: a peer that is ahead does more local steps, not idle ones).

Two threads meet here: the learner's, which records each finished step's Δ, and the merger's loop, which takes the
latest one when it needs it (`Contribution.fix`). Taking never waits for a step in progress: a merge group waits
for no member's step, and the step in progress is then one of those taken while the merge is in flight.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

from p2pdiloco.network.merger import Contribution, MergeResult

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundEnd:
    """Where a round stood at a step the learner finished: what its contribution is, if taken there."""

    pseudo_grad: torch.Tensor
    """Δ = θg − θ after that step."""
    tokens: int
    """Tokens of the round's steps up to it (the contribution's weight)."""
    compute_s: float
    """Inner-step time of those steps."""
    steps: int
    """Steps of the round up to it."""
    round_s: float
    """Wall time of the round up to it."""


class OpenRound:
    """A submitted round that the learner goes on training: `step_done` after each step, `take` once, from any thread.

    Args:
        contribution: what was submitted; `take` sets its `pseudo_grad`, `weight` and `round_s`.
        end: where the round stood when it was submitted.
    """

    def __init__(self, contribution: Contribution, end: RoundEnd):
        self.contribution = contribution
        self._lock = threading.Lock()
        self._latest = end
        self.taken: RoundEnd | None = None
        """Where the round was taken (None: not yet); set once, by `take`."""
        contribution.take = self.take

    def open(self) -> bool:
        """Whether its Δ can still grow: not taken yet."""
        return self.taken is None

    def step_done(self, end: RoundEnd) -> None:
        """The learner finished a step of this round (learner thread)."""
        with self._lock:
            if self.taken is None:
                self._latest = end

    def take(self) -> None:
        """Fix the contribution at the last finished step; later calls change nothing (merger thread, or any)."""
        with self._lock:  # held until the contribution is set: a second caller must not read it half set
            if self.taken is None:
                self.taken = end = self._latest
                c = self.contribution
                c.pseudo_grad, c.weight, c.round_s = end.pseudo_grad, float(end.tokens), end.round_s


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
    open_round: OpenRound | None = None  # the round trained on until its group forms (in_flight.py); None once closed

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

    def _overdue(self) -> bool:
        return time.monotonic() - self.submitted_at > self.bound_s

    def _hung(self) -> MergeResult:
        """A merger bug must not stop this peer from ever merging again: give up on it, keep our own update."""
        logger.error("[%s] merge did not finish in %.0f s; merging alone", self.peer_id[-6:], self.bound_s)
        self.future.cancel()
        c = self.contribution
        c.fix()
        return MergeResult(group=[self.peer_id], pseudo_grad=c.pseudo_grad, total_weight=c.weight,
                           failure="merger hung")
