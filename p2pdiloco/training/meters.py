"""Meters the learner keeps for its heartbeat and metrics: a recent rate of a cumulative count, and a moving
average of a noisy value."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable


class RateMeter:
    """Recent rate of a cumulative count, e.g. tokens per second over the last `window_s` seconds.

    The training thread calls `add`; the network thread reads `rate` (hence the lock). A peer that stops
    counting (stalled, waiting for a merge) sees its rate fall towards zero instead of freezing.

    Args:
        window_s: how far back the rate looks, in seconds.
        clock: monotonic seconds; tests pass a fake.
    """

    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.window_s, self.clock = window_s, clock
        self._samples: deque[tuple[float, float]] = deque()
        self._lock = threading.Lock()

    def add(self, total: float) -> None:
        """Note that the cumulative count is now `total`."""
        now = self.clock()
        with self._lock:
            s = self._samples
            # keep at most ~100 samples per window: a fast GPU steps far more often than that matters
            if len(s) >= 2 and now - s[-2][0] < self.window_s / 100:
                s[-1] = (now, total)
            else:
                s.append((now, total))
            # drop samples older than the window, but keep one at or before its start so it spans the window
            while len(s) > 2 and s[1][0] <= now - self.window_s:
                s.popleft()

    def rate(self) -> float:
        """Count per second from the oldest kept sample until now; 0 before two points in time exist."""
        now = self.clock()
        with self._lock:
            if not self._samples:
                return 0.0
            (t0, n0), (_, n1) = self._samples[0], self._samples[-1]
        return (n1 - n0) / (now - t0) if now > t0 else 0.0


class Ema:
    """Exponential moving average with Adam's bias correction: the training loss over roughly the last `span`
    steps. One batch's loss is too noisy to tell at a glance whether a peer's loss is falling.

    Args:
        span: steps the average mostly covers (weight 2 / (span + 1) on the newest value).
    """

    def __init__(self, span: int = 20):
        self.beta = 1.0 - 2.0 / (span + 1)
        self._avg, self._n = 0.0, 0

    def add(self, x: float) -> None:
        self._avg = self.beta * self._avg + (1.0 - self.beta) * x
        self._n += 1

    @property
    def value(self) -> float:
        """The average; NaN before the first value."""
        return self._avg / (1.0 - self.beta**self._n) if self._n else float("nan")
