"""Validation loss: the one definition of eval loss, shared by the learner and the data-parallel baselines of
`bench`, so that their figures are comparable."""

from __future__ import annotations

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
