"""Admission of incoming streams: bounds on how many a peer serves at once, and the key checked first.

hivemind's p2p daemon hands every incoming libp2p stream to this process as a new socket and starts a
handler for it, with no limit. A stranger without the swarm key could open hundreds of streams and hold
each until its handler timed out, or declare a large payload and have it read before its tag was checked.
So every handler of p2pdiloco's protocols runs behind `serve_stream`, which

1. admits the stream only while this peer holds fewer than `StreamGate.max_streams` streams in all, fewer
   than `max_unauthenticated` whose header has not been checked yet, fewer than `max_per_peer` such from the
   same requester, and fewer than `max_per_sender` in all from that requester, and while the requester's
   token bucket (`sender_rate` requests a second, `sender_burst` at once) holds a token; otherwise it closes
   the stream at once, without reading a byte of it. libp2p authenticated the requester's id, so these bounds
   hold per identity: a key holder cannot take all of `max_streams` places, nor serve itself faster than
   `sender_rate`;
2. reads the header alone (at most 64 KiB, within `HEADER_TIMEOUT_S`) and checks its swarm-key tag; a
   request without a valid tag is closed without a reply, its payload unread;
3. only then hands the stream to the handler, which reads a payload of the size it expects for that
   request (see `wire.recv_payload`), with a deadline, and replies with a bounded send (`wire.send_msg`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from p2pdiloco.network.peer_tag import short_id
from p2pdiloco.network.wire import HEADER_TIMEOUT_S, ByteCounter, WireError, recv_header

logger = logging.getLogger(__name__)

MAX_STREAMS = 256
"""Incoming streams this peer's handlers hold at once (authenticated or not)."""
MAX_UNAUTHENTICATED = 64
"""Incoming streams whose header has not been checked yet, from all requesters together."""
MAX_UNAUTHENTICATED_PER_PEER = 8
"""The same, from one requester: one stranger cannot take all of `MAX_UNAUTHENTICATED`."""
MAX_PER_SENDER = 16
"""Incoming streams one requester holds at once, in all (authenticated or not). An honest mate holds at most a
handful with this peer at once (ready, invite, group notice, a part per tag, catch-up, a state download; the peak
measured in groups of 8 is in docs/security.md): 16 is a few times that, and 1/16 of `MAX_STREAMS`."""
SENDER_RATE = 20.0
"""Requests a second one requester's streams are admitted at, on average (its token bucket's refill)."""
SENDER_BURST = 60.0
"""Requests one requester may send at once before `SENDER_RATE` holds (its token bucket's size)."""
MAX_BUCKETS = 4096
"""Requesters whose token buckets are kept; beyond, full (idle) buckets are dropped, as a new one starts full."""
WARN_EVERY_S = 60.0
REFUSING_S = 10.0
"""The window in which `SHUN_REFUSALS` refused streams leave a requester out of merge groups (`StreamGate.refusing`)."""
SHUN_REFUSALS = 5
"""A requester refused `SHUN_REFUSALS` streams within `REFUSING_S` seconds is left out of this peer's merge groups
(`refusing`) until it has gone `REFUSING_S` without one: a pinner or flooder is refused again every few tenths of a
second, while an honest mate stays within its budgets, and a fast one that brushes its rate (back-to-back rounds of
a fraction of a second, or a burst of streams this peer's loop was too busy to read) is refused once or twice,
which must not keep it out of groups for seconds."""


@dataclass
class Request:
    """An incoming request whose header carried a valid swarm-key tag."""

    op: str
    sender: str
    """The requester's peer id (base58); libp2p authenticated it, the tag proves it holds the key."""
    header: dict


Handler = Callable[[Request, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
"""(request, reader, writer): serves one admitted, authenticated request; `serve_stream` closes the stream."""


class TokenBucket:
    """Requests one requester may still send now: `burst` at most, refilled at `rate` a second.

    Args:
        rate: tokens added per second.
        burst: the most tokens held (a new bucket starts full).
        now: the current monotonic time.
    """

    def __init__(self, rate: float, burst: float, now: float):
        self.rate, self.burst, self.tokens, self.at = rate, burst, burst, now

    def refill(self, now: float) -> float:
        """The tokens held at `now`."""
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        return self.tokens

    def take(self, now: float) -> bool:
        """Spend one token if one is held at `now`."""
        if self.refill(now) < 1.0:
            return False
        self.tokens -= 1.0
        return True


class StreamGate:
    """Counts the incoming streams this peer's handlers hold, and refuses those beyond the bounds.

    Args:
        max_streams: streams held at once, in all.
        max_unauthenticated: streams held at once whose header has not been checked yet.
        max_per_peer: the same, from one requester.
        max_per_sender: streams held at once from one requester, authenticated or not.
        sender_rate: requests a second admitted from one requester, on average.
        sender_burst: requests admitted from one requester at once before `sender_rate` holds.
        clock: the time source (tests pass a fake one).
    """

    def __init__(self, max_streams: int = MAX_STREAMS, max_unauthenticated: int = MAX_UNAUTHENTICATED,
                 max_per_peer: int = MAX_UNAUTHENTICATED_PER_PEER, max_per_sender: int = MAX_PER_SENDER,
                 sender_rate: float = SENDER_RATE, sender_burst: float = SENDER_BURST,
                 clock: Callable[[], float] = time.monotonic):
        self.max_streams, self.max_unauthenticated, self.max_per_peer = max_streams, max_unauthenticated, max_per_peer
        self.max_per_sender, self.sender_rate, self.sender_burst, self.clock = (max_per_sender, sender_rate,
                                                                               sender_burst, clock)
        self.open = 0
        self.unauthenticated: Counter[str] = Counter()
        self.by_sender: Counter[str] = Counter()
        """Streams each requester holds now."""
        self.buckets: dict[str, TokenBucket] = {}
        self.refused = 0
        """Streams closed at once, unread, because a bound was reached."""
        self.refused_by: Counter[str] = Counter()
        """The same by bound: 'streams', 'unauthenticated', 'peer unauthenticated', 'sender streams', 'sender rate'."""
        self.refused_from: Counter[str] = Counter()
        """The same by requester."""
        self.peak_open: Counter[str] = Counter()
        """The most streams each requester held at once (at most `max_per_sender`)."""
        self.last_refused: dict[str, deque[float]] = {}
        """When (by `clock`) each requester was refused, its last `SHUN_REFUSALS` times."""
        self.low_tokens: dict[str, float] = {}
        """The fewest tokens each requester's bucket held after an admitted request: how near it came to the rate."""
        self.unauthorized = 0
        """Requests closed after their header: no valid swarm-key tag."""
        self.dropped = 0
        """Streams closed before their header was whole: malformed, too large, or not sent in time."""
        self.peak: Counter[str] = Counter()
        """The most streams each requester held at once before their header was checked (at most `max_per_peer`)."""
        self._warned = -WARN_EVERY_S

    def admit(self, requester: str) -> bool:
        """Whether a new stream from `requester` may be read; if so it holds a place until `release`."""
        now = self.clock()
        bound = self._bound_reached(requester, now)
        if bound is not None:
            self._refuse(requester, bound, now)
            return False
        self.open += 1
        self.unauthenticated[requester] += 1
        self.by_sender[requester] += 1
        self.peak[requester] = max(self.peak[requester], self.unauthenticated[requester])
        self.peak_open[requester] = max(self.peak_open[requester], self.by_sender[requester])
        tokens = self.buckets[requester].tokens
        self.low_tokens[requester] = min(self.low_tokens.get(requester, tokens), tokens)
        return True

    def _bound_reached(self, requester: str, now: float) -> str | None:
        """The bound a new stream from `requester` would pass, or None (then it has spent a token)."""
        if self.open >= self.max_streams:
            return "streams"
        if self.unauthenticated.total() >= self.max_unauthenticated:
            return "unauthenticated"
        if self.unauthenticated[requester] >= self.max_per_peer:
            return "peer unauthenticated"
        if self.by_sender[requester] >= self.max_per_sender:
            return "sender streams"
        if requester not in self.buckets:
            if len(self.buckets) >= MAX_BUCKETS:
                self._forget_idle(now)
            self.buckets[requester] = TokenBucket(self.sender_rate, self.sender_burst, now)
        return None if self.buckets[requester].take(now) else "sender rate"

    def _forget_idle(self, now: float) -> None:
        """Drop what is kept of requesters that hold no stream and whose buckets are full again: a flood of
        made-up ids costs this peer bounded memory, and a forgotten requester's new bucket starts full anyway."""
        self.buckets = {p: b for p, b in self.buckets.items() if b.refill(now) < b.burst or p in self.by_sender}
        for kept in (self.refused_from, self.peak_open, self.low_tokens, self.peak, self.last_refused):
            for p in [p for p in kept if p not in self.buckets]:
                del kept[p]

    def _refuse(self, requester: str, bound: str, now: float) -> None:
        self.refused += 1
        self.refused_by[bound] += 1
        self.refused_from[requester] += 1
        self.last_refused.setdefault(requester, deque(maxlen=SHUN_REFUSALS)).append(now)
        if now - self._warned >= WARN_EVERY_S:  # a flood must not flood the log too
            self._warned = now
            logger.warning("closing incoming streams unread (%s bound): %d open, %d unauthenticated; %d held by "
                           "%s, which was refused %d so far; %d refused in all (%s)", bound, self.open,
                           self.unauthenticated.total(), self.by_sender[requester], requester[-8:],
                           self.refused_from[requester], self.refused, dict(self.refused_by))

    def refusing(self, requester: str) -> bool:
        """Whether `requester` was refused `SHUN_REFUSALS` streams within `REFUSING_S`, the last less than
        `REFUSING_S` ago: a mate over its budget persistently, whose merge parts this peer may refuse too, so that a
        group with it would fail for every member (its leader and members leave it out, matchmaking.py)."""
        refused = self.last_refused.get(requester)
        return (refused is not None and len(refused) == SHUN_REFUSALS and refused[-1] - refused[0] < REFUSING_S
                and self.clock() - refused[-1] < REFUSING_S)

    def authenticated(self, requester: str) -> None:
        """The stream of `requester` holding a place passed the key check."""
        self.unauthenticated[requester] -= 1
        if self.unauthenticated[requester] <= 0:
            del self.unauthenticated[requester]

    def release(self, requester: str, authenticated: bool) -> None:
        """A stream admitted for `requester` is closed."""
        self.open -= 1
        self.by_sender[requester] -= 1
        if self.by_sender[requester] <= 0:
            del self.by_sender[requester]
        if not authenticated:
            self.authenticated(requester)


async def serve_stream(gate: StreamGate, op: str, me: str, authorize: Callable[[str, dict], bool],
                       counter: ByteCounter, handler: Handler, info, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> None:
    """Serve one incoming stream of `op` (steps 1 to 3 above); always close it.

    Args:
        gate: this peer's bounds on incoming streams.
        op: the protocol's operation name (for the key check and the logs).
        me: this peer's id.
        authorize: (requester id, header) -> whether the header's tag is valid (a refusal is logged there).
        counter: where the header's bytes are added.
        handler: serves the request once admitted and authenticated.
        info, reader, writer: the stream, as hivemind's p2p daemon hands it over.
    """
    requester = info.peer_id.to_base58()
    admitted = gate.admit(requester)
    authenticated = False
    try:
        if not admitted:
            return
        try:
            async with asyncio.timeout(HEADER_TIMEOUT_S):
                header = await recv_header(reader, counter)
        except (WireError, TimeoutError, ConnectionError, OSError) as e:
            gate.dropped += 1
            logger.debug("[%s] dropped a %s stream from %s before its header: %r", short_id(me), op, requester[-8:], e)
            return
        if not authorize(requester, header):
            gate.unauthorized += 1
            return
        gate.authenticated(requester)
        authenticated = True
        await handler(Request(op, requester, header), reader, writer)
    except Exception as e:  # a requester that went away or sent garbage is normal in a swarm
        logger.debug("[%s] %s request from %s failed: %r", short_id(me), op, requester[-8:], e)
    finally:
        if admitted:
            gate.release(requester, authenticated)
        writer.close()
