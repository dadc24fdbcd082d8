"""This peer's view of the swarm's model: θg and the outer momentum, stepped once per merge.

The tensors are replaced, never mutated in place, so a reference handed to the network thread (a state
download, a contribution) stays valid while training goes on.
"""

from __future__ import annotations

from collections import deque

import torch

from p2pdiloco.algorithm.outer import STATE_REACH, outer_step, state_digest, state_within_reach
from p2pdiloco.config import OuterOptConfig
from p2pdiloco.network.merger import Merged


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
        return self.outer.alone_lr or self.outer.lr

    def anchors(self) -> dict[str, torch.Tensor]:
        """The states this peer can rebuild exactly, by digest, newest first (see `Contribution.anchors`)."""
        return dict(reversed(list(self._anchors.items())))

    def merge(self, result: Merged, own_weight: float = 1.0, alone: bool = False) -> bool:
        """Adopt the group's averaged (θg, momentum) if members disagreed, then take the outer step on Δ̄.

        Args:
            result: the merge (`merged_alone` for a merge alone).
            own_weight: tokens this peer's θg has absorbed. With none (a fresh peer) the group's state is adopted
                whatever it is; otherwise only within reach of this peer's own (see `state_within_reach`).
            alone: the step is on this peer's own Δ alone (it takes `alone_lr`).

        Returns:
            False if the group's state was refused (this peer steps its own θg instead), else True.
        """
        o = self.outer
        adopted = True
        if result.agreed_state is not None:
            n = self.params.numel()
            params, momentum = result.agreed_state[:n], result.agreed_state[n:]
            if own_weight > 0:
                own_next, _ = outer_step(self.params, self.momentum, result.average, o.lr, o.momentum, o.nesterov)
                adopted = state_within_reach(self.params, params, own_next - self.params,
                                             longest_recent=max(self._steps, default=0.0))
            if adopted:  # not an anchor: only the stepped state below is held by every member
                self.params, self.momentum = params.clone(), momentum.clone()
        lr = self.alone_lr if alone else o.lr
        before = self.params
        self.params, self.momentum = outer_step(self.params, self.momentum, result.average, lr, o.momentum,
                                                o.nesterov)
        self._steps.append(float(torch.linalg.vector_norm(self.params - before)))
        self._remember()
        return adopted

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
