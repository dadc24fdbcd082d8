"""Validation loss: the one definition of eval loss, shared by the learner and the data-parallel baselines of
`bench`, so that their figures are comparable."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from p2pdiloco.training.accel import autocast_for
from p2pdiloco.training.flat import flat_params, load_flat_


@torch.no_grad()
def evaluate_model(model: torch.nn.Module, val_batches: list[tuple[torch.Tensor, torch.Tensor]],
                   device: torch.device, precision: str = "auto") -> float:
    """Mean validation loss (nats per token: per byte with byte tokens; see `Reporter.per_byte`) of `model` over
    `val_batches`; NaN if there are none.

    Args:
        model: the model, on `device`.
        val_batches: (inputs, targets) on CPU, shape [batch, seq_len].
        device: where the forward passes run.
        precision: `run.precision` (see accel.autocast_for).
    """
    model.eval()
    losses = []
    for x, y in val_batches:
        with autocast_for(device, precision):
            _, loss = model(x.to(device), y.to(device))
        losses.append(float(loss))
    model.train()
    return sum(losses) / len(losses) if losses else float("nan")


def evaluate_flat(model: torch.nn.Module, flat: torch.Tensor, val_batches: list[tuple[torch.Tensor, torch.Tensor]],
                  device: torch.device, precision: str = "auto") -> float:
    """`evaluate_model` at the weights `flat` (e.g. the global model θg); `model` keeps its own weights after.

    Args:
        flat: a flat fp32 vector of the model's parameters (see flat.py).
        model, val_batches, device, precision: as for `evaluate_model`.
    """
    own = flat_params(model)
    load_flat_(model, flat)
    try:
        return evaluate_model(model, val_batches, device, precision)
    finally:
        load_flat_(model, own)


JOIN_GAIN = 0.02
"""A downloaded state is taken only if its loss on the joiner's probe batches is below (1 − this) × its own model's."""


def state_check(model: torch.nn.Module, own: torch.Tensor, probe: list[tuple[torch.Tensor, torch.Tensor]],
                device: torch.device, precision: str = "auto", gain: float = JOIN_GAIN
                ) -> Callable[[torch.Tensor], str | None]:
    """What a joiner checks itself of a state before it takes it: the state's θg must predict the joiner's own
    probe batches (windows of its own data that it drew at random, so that no donor can fit them in advance)
    better than the joiner's own model, by `gain`. A fresh joiner's own model is the initial one, so a state must
    have learned something of the data: a scaled, noisy or freshly initialised model is refused, however
    many peers name it. A resumed peer keeps its own model unless the swarm's is better on its data.

    Args:
        model: the joiner's model (its weights are restored after each evaluation).
        own: the joiner's own θg, flat fp32.
        probe: the probe batches (`BatchSampler.probe`); none: every state passes.
        device, precision: where and how the forward passes run (`evaluate_flat`).
        gain: the fraction by which a state's loss must be below the own model's.

    Returns:
        A function of a state's flat θg that returns why it is refused, or None to take it.
    """
    if not probe:
        return lambda _params: None
    own_loss = evaluate_flat(model, own, probe, device, precision)
    bound = (1 - gain) * own_loss if math.isfinite(own_loss) else math.inf

    def refusal(params: torch.Tensor) -> str | None:
        loss = evaluate_flat(model, params, probe, device, precision)
        if math.isfinite(loss) and loss < bound:
            return None
        return (f"its loss on this peer's probe batches is {loss:.4f}, not below {bound:.4f} "
                f"({1 - gain:g} × this peer's own model's {own_loss:.4f})")

    return refusal
