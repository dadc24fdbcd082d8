"""A userspace stand-in for netem: hold each queued packet for a delay (with jitter), drop some at random.

This kernel has no `sch_netem`, so the WAN lab sends the packets its routers forward to an NFQUEUE (an iptables
rule in the router's namespace) and runs this daemon in that namespace: each packet is either dropped at once
with probability `loss`, or held for `delay_ms` plus the jitter of the moment, and then accepted.

Jitter is a smooth random process, not a draw per packet: a normal value of `jitter_ms` standard deviation is
drawn every `JITTER_STEP_S` and the jitter between two draws is interpolated linearly. On a real path the delay
of packets sent close together is correlated (they share queues); independent draws per packet would, since
packets must leave in the order they came, turn into a delay well above the one set (each packet waits for the
slowest draw ahead of it: +8 ms at 5 ms of jitter and 2,000 packets/s). Packets still never overtake each other.

Run as `python -m p2pdiloco.bench.delayd --queue 0 --delay-ms 40 --loss 0.005` inside the namespace; it prints
`ready` once bound and exits on SIGTERM or SIGINT, or when the process that started it dies (Linux parent-death
signal), so that it never outlives its lab. Needs root and the NetfilterQueue package (built against Debian's
libnetfilter-queue-dev); it imports nothing heavy, so it starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import select
import signal
import socket
import sys
import time
from collections import deque

PR_SET_PDEATHSIG = 1
IDLE_S = 0.1
"""Longest wait for a packet before looking again whether SIGTERM has asked us to stop."""
JITTER_STEP_S = 0.05
"""Seconds between two draws of the jitter process (it changes slower than packets come)."""
QUEUE_MAX_LEN = 8192
"""Packets the kernel queues for us before it drops (about 0.1 s of 100 Mbit/s in full-size packets, x10)."""


class Holder:
    """The packets held back: FIFO, each with the monotonic time it may leave.

    Args:
        delay_s: the delay every packet gets, in seconds.
        jitter_s: standard deviation of the jitter process added to it, in seconds (a packet is never held
            less than zero).
        loss: probability of dropping a packet instead of holding it, 0..1.
        seed: seed of the random draws (loss and jitter), so that a run can be repeated.
    """

    def __init__(self, delay_s: float, jitter_s: float = 0.0, loss: float = 0.0, seed: int = 0):
        self.delay_s, self.jitter_s, self.loss = delay_s, jitter_s, loss
        self.rng = random.Random(seed)
        self.held: deque = deque()
        self.last_due = 0.0
        self._jitter: tuple[float, float, float, float] | None = None
        """(t0, jitter at t0, t1, jitter at t1): the segment of the jitter process being interpolated."""
        self.passed = 0
        self.dropped = 0

    def due(self, now: float) -> float | None:
        """When a packet arriving at `now` may leave, or None if it is to be dropped."""
        if self.loss > 0 and self.rng.random() < self.loss:
            self.dropped += 1
            return None
        hold = self.delay_s + self.jitter(now)
        self.last_due = max(now + max(hold, 0.0), self.last_due)  # never overtakes a packet ahead of it
        return self.last_due

    def jitter(self, now: float) -> float:
        """The jitter process at `now` (seconds, mean 0): linear between normal draws `JITTER_STEP_S` apart."""
        if self.jitter_s <= 0:
            return 0.0
        if self._jitter is None:
            self._jitter = (now, self.rng.gauss(0.0, self.jitter_s), now + JITTER_STEP_S,
                            self.rng.gauss(0.0, self.jitter_s))
        t0, j0, t1, j1 = self._jitter
        while now >= t1:  # the next segment starts where this one ended; a long silence skips ahead
            t0, j0 = (t1, j1) if now < t1 + JITTER_STEP_S else (now, self.rng.gauss(0.0, self.jitter_s))
            t1, j1 = t0 + JITTER_STEP_S, self.rng.gauss(0.0, self.jitter_s)
        self._jitter = (t0, j0, t1, j1)
        return j0 + (j1 - j0) * (now - t0) / (t1 - t0)

    def on_packet(self, packet) -> None:
        """NetfilterQueue's callback: drop the packet or hold it (its verdict is given after the callback)."""
        due = self.due(time.monotonic())
        if due is None:
            packet.drop()
        else:
            self.held.append((due, packet))

    def release(self, now: float) -> float | None:
        """Accept every held packet whose time has come; seconds until the next one is due (None: none held)."""
        while self.held and self.held[0][0] <= now:
            self.held.popleft()[1].accept()
            self.passed += 1
        return self.held[0][0] - now if self.held else None


def _die_with_parent() -> None:
    """Ask the kernel to SIGTERM us when our parent (the lab) dies, even by SIGKILL."""
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before the request took effect
        sys.exit(0)


def serve(queue: int, holder: Holder) -> None:
    """Bind NFQUEUE `queue`, say `ready`, and hold and release packets until SIGTERM or SIGINT."""
    from netfilterqueue import COPY_META, NetfilterQueue

    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    nfq = NetfilterQueue()
    nfq.bind(queue, holder.on_packet, max_len=QUEUE_MAX_LEN, mode=COPY_META)  # verdicts need no payload
    sock = socket.fromfd(nfq.get_fd(), socket.AF_NETLINK, socket.SOCK_RAW)
    print("ready", flush=True)
    try:
        while not stopping:
            wait = holder.release(time.monotonic())
            try:
                readable, _, _ = select.select([sock], [], [], IDLE_S if wait is None else min(max(wait, 0.0), IDLE_S))
            except InterruptedError:
                continue
            if readable:
                nfq.run(block=False)
    finally:
        for _, packet in holder.held:  # let what is in flight go rather than leave it queued
            packet.accept()
        nfq.unbind()
        sock.close()
        print(f"passed {holder.passed} dropped {holder.dropped}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """The daemon's entry point (see the module docstring for the flags)."""
    ap = argparse.ArgumentParser(prog="python -m p2pdiloco.bench.delayd", description=__doc__.splitlines()[0])
    ap.add_argument("--queue", type=int, default=0, help="NFQUEUE number to bind")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="delay each packet gets, ms")
    ap.add_argument("--jitter-ms", type=float, default=0.0, help="standard deviation of the jitter process, ms")
    ap.add_argument("--loss", type=float, default=0.0, help="probability of dropping a packet, 0..1")
    ap.add_argument("--seed", type=int, default=0, help="seed of the loss and jitter draws")
    args = ap.parse_args(argv)
    _die_with_parent()
    serve(args.queue, Holder(args.delay_ms / 1e3, args.jitter_ms / 1e3, args.loss, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
