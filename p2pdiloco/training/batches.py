"""Batches of token windows: this peer's shard of the training tokens, and the fixed validation batches.

The tokens are cut into chunks of ``seq_len + 1`` (the trailing remainder is unused); each chunk gives one
input sequence and its next-token targets. Shard ``"i/n"`` owns the i-th of n contiguous ranges of chunks,
so peers given different shards never train on the same window.
"""

from __future__ import annotations

import torch

from p2pdiloco.config import ConfigError


def parse_shard(shard: str) -> tuple[int, int]:
    """Split ``"i/n"`` into ``(i, n)`` with ``0 <= i < n``.

    Args:
        shard: The shard spec, e.g. ``"0/4"`` for the first of four parts.

    Raises:
        ConfigError: The spec is malformed or out of range.
    """
    try:
        i, n = (int(x) for x in shard.split("/"))
    except ValueError:
        raise ConfigError(f"data.shard must look like 'i/n', got {shard!r}") from None
    if not 0 <= i < n:
        raise ConfigError(f"data.shard {shard!r}: need 0 <= i < n")
    return i, n


def shard_range(n_chunks: int, shard: str) -> range:
    """Indices of the chunks that shard ``"i/n"`` owns: the i-th of n contiguous, disjoint ranges.

    Args:
        n_chunks: Chunks in the whole text.
        shard: ``"i/n"``, or empty for all chunks.

    Returns:
        A range of chunk indices; over i = 0..n-1 the ranges cover ``range(n_chunks)`` exactly once.
    """
    if not shard:
        return range(n_chunks)
    i, n = parse_shard(shard)
    return range(i * n_chunks // n, (i + 1) * n_chunks // n)


class BatchSampler:
    """Random batches of non-overlapping windows of the text, reshuffled every epoch.

    The text is cut into chunks of ``seq_len + 1`` bytes (the trailing remainder is unused); each
    chunk gives one input sequence and its next-byte targets.

    Args:
        tokens: Byte tokens, a 1-D tensor (uint8 or any integer dtype).
        seq_len: Tokens per sequence.
        batch_size: Sequences per batch.
        seed: Seed of the chunk order; the same seed gives the same batches.
        shard: ``"i/n"`` to use only the i-th of n contiguous, disjoint ranges of chunks (so peers of
            one machine see disjoint text), or empty for all chunks.

    Raises:
        ConfigError: The shard is malformed or holds no chunk.
    """

    def __init__(
        self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int, shard: str = ""
    ) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len} and {batch_size}")
        self.seq_len = seq_len
        self.batch_size = batch_size
        window = seq_len + 1
        n_chunks = tokens.numel() // window
        self.chunk_range = shard_range(n_chunks, shard)
        if len(self.chunk_range) < 1:
            where = f"shard {shard}" if shard else "the text"
            raise ConfigError(
                f"{where} holds no window of {window} bytes ({tokens.numel()} bytes, {n_chunks} windows in all)"
            )
        # A view, not a copy: chunk c of this shard is row c.
        all_chunks = tokens[: n_chunks * window].view(n_chunks, window)
        self._chunks = all_chunks[self.chunk_range.start : self.chunk_range.stop]
        self._generator = torch.Generator().manual_seed(seed)
        self._order = torch.empty(0, dtype=torch.long)
        self._pos = 0

    @property
    def tokens_per_batch(self) -> int:
        """Input tokens in one batch: batch_size * seq_len."""
        return self.batch_size * self.seq_len

    @property
    def n_chunks(self) -> int:
        """Windows this sampler draws from (one epoch)."""
        return len(self._chunks)

    def _take(self, n: int):
        """The next `n` chunk ids of the order, in slices; a fresh permutation per epoch (a batch may straddle two)."""
        while n:
            if self._pos == len(self._order):
                self._order = torch.randperm(self.n_chunks, generator=self._generator)
                self._pos = 0
            take = self._order[self._pos : self._pos + n]
            self._pos += len(take)
            n -= len(take)
            yield take

    def skip(self, batches: int) -> None:
        """Move on as if `batches` batches had been drawn (a resumed peer continues its order instead of replaying
        the batches it trained on before it stopped)."""
        for _ in self._take(batches * self.batch_size):
            pass

    def probe(self, n_batches: int, generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`n_batches` batches of windows of this shard drawn by `generator`, without moving this sampler's order
        (a joiner's check of a downloaded state: windows that no donor can know in advance).

        Args:
            n_batches: batches wanted.
            generator: draws the windows (seed it from the OS so that they are unpredictable).

        Returns:
            ``(x, y)`` pairs as `next_batch` gives them.
        """
        ids = torch.randint(self.n_chunks, (n_batches, self.batch_size), generator=generator)
        windows = self._chunks[ids.flatten()].long().view(n_batches, self.batch_size, -1)
        return [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch.

        Returns:
            ``(x, y)``, int64 of shape (batch_size, seq_len), where ``y[:, t]`` is the byte after
            ``x[:, t]``.
        """
        windows = self._chunks[torch.cat(list(self._take(self.batch_size)))].long()
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def eval_batches(
    tokens: torch.Tensor, seq_len: int, batch_size: int, n_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed validation batches, spread evenly over the text, the same on every peer.

    Args:
        tokens: Validation bytes, 1-D.
        seq_len: Tokens per sequence.
        batch_size: Sequences per batch.
        n_batches: Batches wanted.

    Returns:
        Up to ``n_batches`` ``(x, y)`` pairs of int64 (batch_size, seq_len) tensors. Fewer when the
        text holds fewer than ``n_batches * batch_size`` windows; a single smaller batch when it holds
        fewer than ``batch_size``; empty when it holds no window at all.
    """
    window = seq_len + 1
    n_chunks = tokens.numel() // window
    n_rows = min(n_chunks, n_batches * batch_size)
    if n_rows >= batch_size:
        n_rows -= n_rows % batch_size
    if n_rows < 1:
        return []
    # Integer arithmetic so that indices stay exact and distinct for any length of text.
    ids = torch.arange(n_rows) * n_chunks // n_rows
    windows = tokens[: n_chunks * window].view(n_chunks, window)[ids].long()
    return [(rows[:, :-1].contiguous(), rows[:, 1:].contiguous()) for rows in windows.split(batch_size)]
