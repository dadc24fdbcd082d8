"""A model's parameters as one flat fp32 CPU vector, the form θg, Δ and the outer momentum take, and back."""

from __future__ import annotations

import torch
from torch.nn.utils import parameters_to_vector


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """A copy of the model's parameters as one flat fp32 CPU vector (in `model.parameters()` order)."""
    return parameters_to_vector(model.parameters()).detach().float().cpu().clone()


@torch.no_grad()
def load_flat_(model: torch.nn.Module, flat: torch.Tensor) -> None:
    """Copy a flat fp32 vector into the model's parameters.

    Copies, unlike torch's vector_to_parameters, which on CPU would make the parameters views of `flat`
    so that inner steps would silently rewrite the global model.
    """
    offset = 0
    for p in model.parameters():
        n = p.numel()
        p.copy_(flat[offset : offset + n].view_as(p))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"flat vector has {flat.numel()} values, model has {offset}")
