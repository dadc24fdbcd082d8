"""What every model of p2pdiloco keeps to: `model(idx, targets) -> (logits, loss)`, the learner's only view of it.

Args of that call: idx, input token ids, int64 of shape (batch, time) with time <= model.seq_len; targets, the
next-token ids of the same shape, or None to skip the loss. It returns logits of shape (batch, time,
vocab_size) and the mean cross-entropy in nats per token (a scalar), or None.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_length(idx: torch.Tensor, seq_len: int) -> int:
    """The sequence length of `idx`; ValueError if it is longer than the model's context."""
    T = idx.shape[1]
    if T > seq_len:
        raise ValueError(f"sequence of {T} tokens is longer than model.seq_len={seq_len}")
    return T


def with_loss(logits: torch.Tensor, targets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits, mean next-token cross-entropy), or (logits, None) without targets."""
    if targets is None:
        return logits, None
    return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
