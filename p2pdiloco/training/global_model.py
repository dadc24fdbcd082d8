"""This peer's view of the swarm's model: θg and the outer momentum, stepped once per merge.

The tensors are replaced, never mutated in place, so a reference handed to the network thread (a state
download, a contribution) stays valid while training goes on.
"""

from __future__ import annotations

from collections import deque

import torch

from p2pdiloco.algorithm.outer import STATE_REACH, OuterRound, alone_lr, outer_round, state_digest
from p2pdiloco.config import OuterOptConfig
from p2pdiloco.network.merger import Merged
from p2pdiloco.network.state_sync import GlobalState


class GlobalModel:
    """θg and the outer Nesterov momentum (DiLoCo, arXiv 2311.08105).

    Args:
        params: flat fp32 θg to start from (the swarm's initial weights).
        outer: the outer optimizer's settings.
    """

    def __init__(self, params: torch.Tensor, outer: OuterOptConfig, anchors: int = 0):
        self.params = params
        self.momentum = torch.zeros_like(params)
        self.outer = outer
        self.keep_anchors = anchors
        self._digest: tuple[torch.Tensor, int, torch.Tensor, int, str] | None = None
        """The digest of the (params, momentum) tensors at their versions (see `digest`)."""
        self._steps: deque[float] = deque(maxlen=int(STATE_REACH))
        """Lengths of this peer's last outer steps: the unit of `state_within_reach`."""
        self._anchors: dict[str, torch.Tensor] = {}
        """The last `anchors` states this peer held, (θg, momentum) concatenated, by digest, oldest first: a merge
        group whose members' global models differ exchanges only their differences from one they all hold."""
        self._remember()

    def _remember(self) -> None:
        if self.keep_anchors <= 0:
            return
        digest = self.digest()
        self._anchors.pop(digest, None)
        self._anchors[digest] = torch.cat([self.params, self.momentum])
        while len(self._anchors) > self.keep_anchors:
            del self._anchors[next(iter(self._anchors))]

    @property
    def alone_lr(self) -> float:
        """The outer lr of steps on this peer's own Δ alone (a merge alone, an eager update): `outer.alone_lr`,
        or `outer.lr` where that is 0."""
        return alone_lr(self.outer)

    def anchor(self, digest: str) -> torch.Tensor | None:
        """The state with `digest`, (θg, momentum) concatenated, if it is one of the last `anchors` this peer held."""
        return self._anchors.get(digest)

    def anchors(self) -> dict[str, torch.Tensor]:
        """The states this peer can rebuild exactly, by digest, newest first (see `Contribution.anchors`)."""
        return dict(reversed(list(self._anchors.items())))

    def merge(self, result: Merged, own_weight: float = 1.0, alone: bool = False) -> bool:
        """Adopt the group's averaged (θg, momentum) if members disagreed, then take the outer step on Δ̄
        (`outer.outer_round`, without a local model).

        Args:
            result: the merge (`merged_alone` for a merge alone).
            own_weight: tokens this peer's θg has absorbed. With none (a fresh peer) the group's state is adopted
                whatever it is; otherwise only within reach of this peer's own (see `state_within_reach`).
            alone: the step is on this peer's own Δ alone (it takes `alone_lr`).

        Returns:
            False if the group's state was refused (this peer steps its own θg instead), else True.
        """
        done = outer_round(self.params, self.momentum, result.average, self.outer, alone=alone,
                           agreed_state=result.agreed_state, own_weight=own_weight,
                           longest_recent=self.longest_recent)
        self.take(done)
        return done.adopted

    @property
    def longest_recent(self) -> float:
        """The longest of this peer's last outer steps: the unit of `state_within_reach`."""
        return max(self._steps, default=0.0)

    def take(self, done: OuterRound) -> None:
        """Hold the (θg, momentum) an `outer_round` stepped to, and remember its step's length."""
        self.params, self.momentum = done.params, done.momentum
        self._steps.append(done.step)
        self._remember()

    def adopt(self, params: torch.Tensor, momentum: torch.Tensor) -> None:
        """Continue from another (θg, momentum): a group's average, a donor's state or a checkpoint's."""
        if params.numel() != self.params.numel() or momentum.numel() != self.params.numel():
            raise ValueError("state does not fit this model")
        self.params, self.momentum = params.clone(), momentum.clone()
        self._remember()

    def digest(self) -> str:
        """Hash of (θg, momentum): members compare digests to see whether their global models agree.

        Hashed once per state, not once per caller: a merge asked for it three times (anchors, the counters, the
        next contribution), each a pass over 8 bytes per parameter in the training thread. The cache holds
        the tensors themselves (so no new tensor can take an old one's id) and their in-place versions."""
        p, m, cached = self.params, self.momentum, self._digest
        if cached is None or cached[0] is not p or cached[2] is not m or cached[1] != p._version \
                or cached[3] != m._version:
            cached = self._digest = (p, p._version, m, m._version, state_digest(p, m))
        return cached[4]


class HeldStates:
    """The last global states a peer held, by digest, as a joiner may ask for them: a donor's record names the
    state it held at its last heartbeat, which it may have left a round or two ago; it serves that state from its
    anchors (`GlobalModel.anchor`) with the counters it had then. The joiner checks what it gets against the
    digest, so a state served here under the wrong digest only fails that download.

    Args:
        g: the peer's global model (its anchors hold the tensors; only counters are kept here).
    """

    def __init__(self, g: GlobalModel):
        self.g = g
        self._counters: dict[str, tuple[int, int, float]] = {}
        self._last: tuple[str, GlobalState] | None = None

    def note(self, state: GlobalState) -> GlobalState:
        """`state` is this peer's state now (θg and momentum are `g`'s); returns it."""
        digest = self.g.digest()
        self._counters[digest] = (state.round, state.step, state.global_tokens)
        while len(self._counters) > max(1, self.g.keep_anchors):
            del self._counters[next(iter(self._counters))]
        self._last = (digest, state)
        return state

    def get(self, digest: str) -> GlobalState | None:
        """The state with `digest`, or None if this peer holds it no longer (called from the network thread)."""
        last = self._last
        if last is not None and last[0] == digest:
            return last[1]
        counters, anchor = self._counters.get(digest), self.g.anchor(digest)
        if counters is None or anchor is None:
            return None
        n = anchor.numel() // 2
        return GlobalState(anchor[:n], anchor[n:], *counters)
