"""Admission of incoming streams: bounds on how many a peer serves at once, and the key checked first.

hivemind's p2p daemon hands every incoming libp2p stream to this process as a new socket and starts a
handler for it, with no limit. A stranger without the swarm key could open hundreds of streams and hold
each until its handler timed out, or declare a large payload and have it read before its tag was checked.
So every handler of p2pdiloco's protocols runs behind `serve_stream`, which

1. admits the stream only while this peer holds fewer than `StreamGate.max_streams` streams in all, fewer
   than `max_unauthenticated` whose header has not been checked yet, and fewer than `max_per_peer` such
   from the same requester; otherwise it closes the stream at once, without reading a byte of it;
2. reads the header alone (at most 64 KiB, within `HEADER_TIMEOUT_S`) and checks its swarm-key tag; a
   request without a valid tag is closed without a reply, its payload unread;
3. only then hands the stream to the handler, which reads a payload of the size it expects for that
   request (see `wire.recv_payload`), with a deadline, and replies with a bounded send (`wire.send_msg`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
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
WARN_EVERY_S = 60.0


@dataclass
class Request:
    """An incoming request whose header carried a valid swarm-key tag."""

    op: str
    sender: str
    """The requester's peer id (base58); libp2p authenticated it, the tag proves it holds the key."""
    header: dict


Handler = Callable[[Request, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
"""(request, reader, writer): serves one admitted, authenticated request; `serve_stream` closes the stream."""


class StreamGate:
    """Counts the incoming streams this peer's handlers hold, and refuses those beyond the bounds.

    Args:
        max_streams: streams held at once, in all.
        max_unauthenticated: streams held at once whose header has not been checked yet.
        max_per_peer: the same, from one requester.
    """

    def __init__(self, max_streams: int = MAX_STREAMS, max_unauthenticated: int = MAX_UNAUTHENTICATED,
                 max_per_peer: int = MAX_UNAUTHENTICATED_PER_PEER):
        self.max_streams, self.max_unauthenticated, self.max_per_peer = max_streams, max_unauthenticated, max_per_peer
        self.open = 0
        self.unauthenticated: Counter[str] = Counter()
        self.refused = 0
        """Streams closed at once, unread, because a bound was reached."""
        self.unauthorized = 0
        """Requests closed after their header: no valid swarm-key tag."""
        self.dropped = 0
        """Streams closed before their header was whole: malformed, too large, or not sent in time."""
        self.peak: Counter[str] = Counter()
        """The most streams each requester held at once before their header was checked (at most `max_per_peer`)."""
        self._warned = -WARN_EVERY_S

    def admit(self, requester: str) -> bool:
        """Whether a new stream from `requester` may be read; if so it holds a place until `release`."""
        if (self.open >= self.max_streams or self.unauthenticated.total() >= self.max_unauthenticated
                or self.unauthenticated[requester] >= self.max_per_peer):
            self.refused += 1
            now = time.monotonic()
            if now - self._warned >= WARN_EVERY_S:  # a flood must not flood the log too
                self._warned = now
                logger.warning("closing incoming streams unread: %d open, %d unauthenticated (%d from %s); "
                               "%d refused so far", self.open, self.unauthenticated.total(),
                               self.unauthenticated[requester], requester[-8:], self.refused)
            return False
        self.open += 1
        self.unauthenticated[requester] += 1
        self.peak[requester] = max(self.peak[requester], self.unauthenticated[requester])
        return True

    def authenticated(self, requester: str) -> None:
        """The stream of `requester` holding a place passed the key check."""
        self.unauthenticated[requester] -= 1
        if self.unauthenticated[requester] <= 0:
            del self.unauthenticated[requester]

    def release(self, requester: str, authenticated: bool) -> None:
        """A stream admitted for `requester` is closed."""
        self.open -= 1
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
