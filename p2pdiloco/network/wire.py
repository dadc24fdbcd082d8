"""Framing of p2pdiloco's messages on libp2p streams: a msgpack header and an optional raw payload.

Frame: 4-byte big-endian header length, msgpack header (a dict), 8-byte big-endian payload length,
payload bytes. A receiver reads a frame in two steps: the header (`recv_header`), which it can authenticate
and from which it knows how large the payload must be, then the payload (`recv_payload`), whose declared
length is checked against that size before anything is allocated. So a stranger, or a peer that declares a
huge message, is refused before its payload is read.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import msgpack

MAX_HEADER_BYTES = 64 * 1024

HEADER_TIMEOUT_S = 5.0
"""How long a handler waits for a request's header: a stream that sends none is closed after this."""

SEND_STALL_S = 5.0
"""How long one chunk (`SEND_CHUNK`) of a bounded send may wait for the reader (see `send_msg`)."""

MIN_SEND_RATE = 64_000
"""Bytes per second a reader must take, on average, from a bounded send (see `send_deadline`): 0.5 Mbit/s, below what
one TCP connection of a home uplink to another continent carries (in the WAN lab, at 160 ms and 1 % loss, 0.8 Mbit/s
with a loss-based congestion control such as most hosts run: docs/wanlab.md), so that an owner does not cut its
reply to a member on such a link mid-message. A reader that stops reading is still cut after `SEND_STALL_S`."""

SEND_CHUNK = 1 << 16
"""A bounded send hands the stream this much at a time, each within `SEND_STALL_S` (12.8 kB/s at the least)."""


class WireError(Exception):
    """A malformed or oversized message from a remote peer, or a reader too slow to take ours."""


@dataclass
class ByteCounter:
    """Bytes this peer sent and received on p2pdiloco's own protocols."""

    sent: int = 0
    received: int = 0


def _count(counter: ByteCounter | None, phase: ByteCounter | None, sent: int = 0, received: int = 0) -> None:
    for c in (counter, phase):
        if c is not None:
            c.sent += sent
            c.received += received


def send_deadline(nbytes: int) -> float:
    """Seconds a bounded send of `nbytes` payload bytes may take: a few seconds plus `MIN_SEND_RATE`."""
    return SEND_STALL_S + nbytes / MIN_SEND_RATE


async def send_msg(writer: asyncio.StreamWriter, header: dict, payload: bytes | memoryview = b"",
                   counter: ByteCounter | None = None, deadline_s: float | None = None,
                   phase: ByteCounter | None = None) -> None:
    """Write one frame and wait until it is flushed.

    Args:
        writer: the stream.
        header: the frame's header (msgpack-able map).
        payload: the frame's payload.
        counter: where to add the bytes sent.
        deadline_s: None: wait as long as the reader takes (the caller bounds it). Else the whole frame must be
            taken within `deadline_s` seconds and each `SEND_CHUNK` of it within `SEND_STALL_S`, or the stream
            is aborted (its buffered bytes dropped) and WireError raised: handlers use this, so that a reader
            that never reads holds neither the handler nor a copy of the payload for long.
        phase: where to add them too: the counter of the merge phase the frame belongs to (`MergeSession.counter`).
    """
    head = msgpack.packb(header, use_bin_type=True)
    if len(head) > MAX_HEADER_BYTES:
        raise WireError("header too large")
    prefix = len(head).to_bytes(4, "big") + head + len(payload).to_bytes(8, "big")
    if deadline_s is None:
        writer.write(prefix)
        if len(payload):
            writer.write(payload)
        await writer.drain()
    else:
        view = memoryview(payload)
        try:
            async with asyncio.timeout(deadline_s):
                writer.write(prefix)
                for start in range(0, max(len(view), 1), SEND_CHUNK):
                    if len(view):
                        writer.write(view[start:start + SEND_CHUNK])
                    async with asyncio.timeout(SEND_STALL_S):
                        await writer.drain()
        except TimeoutError:
            transport = getattr(writer, "transport", None)
            if transport is not None:
                transport.abort()  # close() would keep the unsent bytes until the reader takes them
            raise WireError(f"the reader took less than {len(payload)} bytes in {deadline_s:.0f} s") from None
    _count(counter, phase, sent=len(prefix) + len(payload))


async def recv_header(reader: asyncio.StreamReader, counter: ByteCounter | None = None,
                      phase: ByteCounter | None = None) -> dict:
    """Read a frame's header (not its payload length); raise WireError if it is malformed or too large.

    Args:
        reader: the stream.
        counter: where to add the bytes read.
        phase: where to add them too (see `send_msg`).
    """
    try:
        head_len = int.from_bytes(await reader.readexactly(4), "big")
        if head_len > MAX_HEADER_BYTES:
            raise WireError(f"declared header of {head_len} bytes exceeds {MAX_HEADER_BYTES}")
        head = await reader.readexactly(head_len)
    except asyncio.IncompleteReadError as e:
        raise WireError("stream closed mid-message") from e
    _count(counter, phase, received=4 + head_len)
    try:
        header = msgpack.unpackb(head, raw=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise WireError(f"undecodable header: {e}") from e
    if not isinstance(header, dict):
        raise WireError("header is not a map")
    return header


async def recv_payload(reader: asyncio.StreamReader, max_payload: int, counter: ByteCounter | None = None,
                       exact: bool = False, phase: ByteCounter | None = None) -> bytes:
    """Read a frame's payload length and payload, after `recv_header`; raise WireError on a wrong size.

    Args:
        reader: the stream.
        max_payload: the largest payload this message may carry, in bytes.
        counter: where to add the bytes read.
        exact: the payload must be exactly `max_payload` bytes (a request whose size the receiver knows).
        phase: where to add them too (see `send_msg`).
    """
    try:
        payload_len = int.from_bytes(await reader.readexactly(8), "big")
        if exact and payload_len != max_payload:
            raise WireError(f"declared payload of {payload_len} bytes, expected {max_payload}")
        if payload_len > max_payload:
            raise WireError(f"declared payload of {payload_len} bytes exceeds {max_payload}")
        payload = await reader.readexactly(payload_len) if payload_len else b""
    except asyncio.IncompleteReadError as e:
        raise WireError("stream closed mid-message") from e
    _count(counter, phase, received=8 + payload_len)
    return payload


REPLY_LINGER_S = 10.0


async def await_requester_close(reader: asyncio.StreamReader, limit_s: float = REPLY_LINGER_S) -> None:
    """A handler, after its reply: wait until the requester closes its end (or `limit_s`), then return.

    p2pd pipes every libp2p stream to a socket of ours. When a handler closed its socket right after
    writing the reply, the daemon closed the stream for reading too, its copy loop then reset the stream,
    and a reset that reached the requester's daemon before it had read the reply discarded the reply: the
    requester saw "stream closed mid-message" although the handler had answered (a leader's invite
    "failed" while the invitee had accepted, in about 1 run in 10 of a 4-peer merge test under load).
    The requester closes as soon as it has read the reply, so waiting for that costs nothing.
    Whatever the requester still sends is read and dropped; errors mean it is gone, which is fine too.
    """
    try:
        async with asyncio.timeout(limit_s):
            while await reader.read(1 << 16):
                pass
    except (TimeoutError, ConnectionError, OSError):
        pass
