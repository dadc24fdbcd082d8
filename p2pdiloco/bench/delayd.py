"""A userspace stand-in for netem: hold each queued packet for a delay (with jitter), drop some at random.

This kernel has no `sch_netem`, so the WAN lab sends the packets its routers forward to an NFQUEUE (an iptables
rule in the router's namespace) and runs this daemon in that namespace: each packet is either dropped at once
with probability `loss`, or held for `delay_ms` plus a jitter drawn from a normal distribution of
`jitter_ms` standard deviation, and then accepted. Packets leave in the order they came (a packet is never
released before one queued ahead of it), as on a real path; jitter therefore only ever adds delay.

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
QUEUE_MAX_LEN = 8192
"""Packets the kernel queues for us before it drops (about 0.1 s of 100 Mbit/s in full-size packets, x10)."""


class Holder:
    """The packets held back: FIFO, each with the monotonic time it may leave.

    Args:
        delay_s: the delay every packet gets, in seconds.
        jitter_s: standard deviation of a normal jitter added to it, in seconds (clipped to the delay below zero).
        loss: probability of dropping a packet instead of holding it, 0..1.
        seed: seed of the random draws (loss and jitter), so that a run can be repeated.
    """

    def __init__(self, delay_s: float, jitter_s: float = 0.0, loss: float = 0.0, seed: int = 0):
        self.delay_s, self.jitter_s, self.loss = delay_s, jitter_s, loss
        self.rng = random.Random(seed)
        self.held: deque = deque()
        self.last_due = 0.0
        self.passed = 0
        self.dropped = 0

    def due(self, now: float) -> float | None:
        """When a packet arriving at `now` may leave, or None if it is to be dropped."""
        if self.loss > 0 and self.rng.random() < self.loss:
            self.dropped += 1
            return None
        hold = self.delay_s + (self.rng.gauss(0.0, self.jitter_s) if self.jitter_s > 0 else 0.0)
        self.last_due = max(now + max(hold, 0.0), self.last_due)  # never overtakes a packet ahead of it
        return self.last_due

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
    ap.add_argument("--jitter-ms", type=float, default=0.0, help="standard deviation of a normal jitter, ms")
    ap.add_argument("--loss", type=float, default=0.0, help="probability of dropping a packet, 0..1")
    ap.add_argument("--seed", type=int, default=0, help="seed of the loss and jitter draws")
    args = ap.parse_args(argv)
    _die_with_parent()
    serve(args.queue, Holder(args.delay_ms / 1e3, args.jitter_ms / 1e3, args.loss, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
