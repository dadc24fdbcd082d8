"""Text generation from a trained model: temperature and top-k sampling, one token at a time (nanoGPT's
`generate`), with a seeded generator so that a seed gives the same text every time."""

from __future__ import annotations

import torch


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: list[int], n_tokens: int, seq_len: int, temperature: float = 0.8,
             top_k: int = 50, generator: torch.Generator | None = None,
             device: torch.device | None = None) -> list[int]:
    """`n_tokens` token ids that continue `prompt`.

    Args:
        model: a p2pdiloco model (`model(idx) -> (logits, None)`), in eval mode, on `device`.
        prompt: token ids to continue (at least one).
        n_tokens: how many tokens to generate.
        seq_len: the model's context length; the prompt and the text so far are cut to the last `seq_len` tokens.
        temperature: logits are divided by it; 0 picks the most likely token every time (greedy).
        top_k: sample only among the k most likely tokens (0: among all).
        generator: a CPU generator for the draws (sampling runs on CPU, so a seed gives the same text on any device).
        device: where the forward passes run (default CPU).

    Returns:
        The generated ids only (without the prompt).
    """
    if not prompt:
        raise ValueError("the prompt has no tokens")
    idx = torch.tensor([prompt], dtype=torch.long, device=device)
    out: list[int] = []
    for _ in range(n_tokens):
        logits, _ = model(idx[:, -seq_len:])
        logits = logits[0, -1].float().cpu()
        if temperature <= 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            token = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
        out.append(token)
        idx = torch.cat([idx, torch.tensor([[token]], dtype=torch.long, device=idx.device)], dim=1)
    return out
