"""What a peer tells the world about itself: its recent throughput, and its counters in Prometheus's text
exposition format, served over HTTP on the peer's network loop.

The peer writes the format itself (it is a few lines of text), so serving metrics needs no extra package;
tests parse the output with `prometheus_client`'s parser.
"""

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
