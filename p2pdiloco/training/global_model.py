"""This peer's view of the swarm's model: θg and the outer momentum, stepped once per merge.

The tensors are replaced, never mutated in place, so a reference handed to the network thread (a state
download, a contribution) stays valid while training goes on.
"""

from __future__ import annotations

import torch

from p2pdiloco.algorithm.outer import outer_step, state_digest, state_within_reach
from p2pdiloco.config import OuterOptConfig
from p2pdiloco.network.merger import MergeResult


class GlobalModel:
    """θg and the outer Nesterov momentum (DiLoCo, arXiv 2311.08105).

    Args:
        params: flat fp32 θg to start from (the swarm's initial weights).
        outer: the outer optimizer's settings.
    """

    def __init__(self, params: torch.Tensor, outer: OuterOptConfig):
        self.params = params
        self.momentum = torch.zeros_like(params)
        self.outer = outer

    def merge(self, result: MergeResult, own_weight: float = 1.0) -> bool:
        """Adopt the group's averaged (θg, momentum) if members disagreed, then take the outer step on Δ̄.

        Args:
            result: the merge.
            own_weight: tokens this peer's θg has absorbed. With none (a fresh peer) the group's state is adopted
                whatever it is; otherwise only within reach of this peer's own (see `state_within_reach`).

        Returns:
            False if the group's state was refused (this peer steps its own θg instead), else True.
        """
        o = self.outer
        adopted = True
        if result.global_state is not None:
            n = self.params.numel()
            params, momentum = result.global_state[:n], result.global_state[n:]
            if own_weight > 0:
                own_next, _ = outer_step(self.params, self.momentum, result.pseudo_grad, o.lr, o.momentum, o.nesterov)
                adopted = state_within_reach(self.params, params, own_next - self.params)
            if adopted:
                self.adopt(params, momentum)
        self.params, self.momentum = outer_step(self.params, self.momentum, result.pseudo_grad, o.lr, o.momentum,
                                                o.nesterov)
        return adopted

    def adopt(self, params: torch.Tensor, momentum: torch.Tensor) -> None:
        """Continue from another (θg, momentum): a group's average, a donor's state or a checkpoint's."""
        if params.numel() != self.params.numel() or momentum.numel() != self.params.numel():
            raise ValueError("state does not fit this model")
        self.params, self.momentum = params.clone(), momentum.clone()

    def digest(self) -> str:
        """Hash of (θg, momentum): members compare digests to see whether their global models agree."""
        return state_digest(self.params, self.momentum)
