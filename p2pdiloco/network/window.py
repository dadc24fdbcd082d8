"""How long a peer looks for a merge group (its *window*), and what widens it.

Sync mode waits up to `swarm.merge_window_s`, for everyone. Decoupled mode waits a fraction of this peer's
recent round time (an EMA of the rounds' wall times as the learner reports them, else of the time between
submits), in the spirit of Decoupled DiLoCo's grace window: long enough that peers finishing their round at
about the same time meet, short enough that nobody's merges are held up by a slow or vanished peer. No
constant to retune per model or link.

Two things widen it, because peers whose rounds drifted apart by more than the window would otherwise never
meet again:

- merges alone in a row: the window doubles after each (up to `merge_window_s`) until a group forms;
- a group mate that started looking *after* this peer's search had ended, less than half a round later: the
  next window reaches that far (plus `LATE_MARGIN_S`), never past half a round. Merges in part of the group do
  not widen it by the first rule, and equal-speed peers keep their phase: in one README run of 4 peers the
  swarm split into two pairs whose searches started 4.3 s apart with 3.2 s windows, and merged as two
  2-peer swarms for 13 rounds (final eval loss 1.77, against 1.64–1.66 in the runs that stayed one group).
  Half a round is the most it needs: of two groups out of phase, the one that looks first is less than half
  a round ahead of the other, and the one that looks second never widens. A slow peer's searches land anywhere
  in the others' rounds: when one starts within their reach they wait for it (a bigger group, a merge that
  lands later while they keep training), else nothing changes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from p2pdiloco.config import SwarmConfig

LATE_MARGIN_S = 0.5
"""Added to a late mate's lag: its announcement takes a moment, and its next start varies a little."""


@dataclass
class MergeWindow:
    cfg: SwarmConfig
    last_submit: float = field(default_factory=time.monotonic)
    round_ema: float | None = None
    alone_streak: int = 0
    search_start: float | None = None
    """When this peer's last search started (DHT time); None while none has."""
    late_mate: float = 0.0
    """Seconds after that start at which the latest mate in reach began to look (0: none)."""

    def next(self, round_s: float, now: float) -> float:
        """The window of a search starting at `now` (DHT time) for a round of `round_s` seconds (0: unknown)."""
        mono = time.monotonic()
        interval = round_s if round_s > 0 else mono - self.last_submit
        self.last_submit = mono
        self.round_ema = interval if self.round_ema is None else 0.5 * self.round_ema + 0.5 * interval
        late, self.late_mate, self.search_start = self.late_mate, 0.0, now
        if self.cfg.sync:
            return self.cfg.merge_window_s
        base = max(self.cfg.min_window_s, self.cfg.window_fraction * self.round_ema)
        if late > 0:
            base = max(base, min(late + LATE_MARGIN_S, self.round_ema / 2))
        return min(self.cfg.merge_window_s, base * 2 ** min(self.alone_streak, 8))

    def record(self, alone: bool) -> None:
        """The outcome of this peer's last merge: merges alone in a row widen the window."""
        self.alone_streak = self.alone_streak + 1 if alone else 0

    def mate_looking(self, now: float, searching: bool) -> None:
        """A group mate said at `now` (DHT time) that it started looking; `searching`: this peer still is."""
        if searching or self.search_start is None or self.round_ema is None:
            return
        lag = now - self.search_start
        if 0 < lag < self.round_ema / 2:
            self.late_mate = max(self.late_mate, lag)
