"""Message framing: round trip, byte counts, and refusal of malformed or oversized frames."""

import asyncio
import time

import pytest

from p2pdiloco.network import wire
from p2pdiloco.network.wire import (
    MAX_HEADER_BYTES,
    ByteCounter,
    WireError,
    await_requester_close,
    recv_header,
    recv_payload,
    send_msg,
)
from tests.conftest import recv_msg


class _Sink:
    def __init__(self):
        self.data = bytearray()

    def write(self, b):
        self.data += b

    async def drain(self):
        pass


def _reader(data: bytes) -> asyncio.StreamReader:
    r = asyncio.StreamReader()
    r.feed_data(data)
    r.feed_eof()
    return r


async def test_round_trip_and_byte_counts():
    sink, sent, received = _Sink(), ByteCounter(), ByteCounter()
    await send_msg(sink, {"op": "part", "index": 2}, b"\x00" * 40, sent)
    header, payload = await recv_msg(_reader(bytes(sink.data)), 40, received)
    assert header == {"op": "part", "index": 2} and payload == b"\x00" * 40
    assert sent.sent == len(sink.data) == received.received


async def test_oversized_payload_refused_before_reading():
    sink = _Sink()
    await send_msg(sink, {}, b"x" * 100)
    with pytest.raises(WireError, match="exceeds 99"):
        await recv_msg(_reader(bytes(sink.data)), 99)


async def test_huge_declared_header_refused():
    data = (MAX_HEADER_BYTES + 1).to_bytes(4, "big")
    with pytest.raises(WireError, match="header"):
        await recv_msg(_reader(data), 10)


@pytest.mark.parametrize("data", [b"", b"\x00\x00", b"\x00\x00\x00\x05abc", b"\x00\x00\x00\x01\xc1" + bytes(8),
                                  b"\x00\x00\x00\x01\x05" + bytes(8)])
async def test_truncated_or_garbage_frames(data):
    with pytest.raises(WireError):
        await recv_msg(_reader(data), 10)


async def test_a_handler_keeps_the_stream_until_the_requester_closes_and_no_longer_than_its_limit():
    # the requester read the reply and closed (stray bytes first): the handler may close at once
    r = asyncio.StreamReader()
    r.feed_data(b"stray bytes")
    asyncio.get_running_loop().call_later(0.2, r.feed_eof)
    t0 = time.monotonic()
    await await_requester_close(r, limit_s=10)
    assert 0.15 < time.monotonic() - t0 < 5
    # a requester that never closes holds the handler only for the limit
    t0 = time.monotonic()
    await await_requester_close(asyncio.StreamReader(), limit_s=0.3)
    assert 0.25 < time.monotonic() - t0 < 5


async def test_a_request_of_another_size_than_expected_is_refused_before_its_payload():
    sink = _Sink()
    await send_msg(sink, {"op": "part"}, b"x" * 100)
    reader = _reader(bytes(sink.data))
    assert await recv_header(reader) == {"op": "part"}
    with pytest.raises(WireError, match="expected 99"):
        await recv_payload(reader, 99, exact=True)  # smaller than declared
    assert len(await reader.read()) == 100  # the payload itself was left unread
    reader = _reader(bytes(sink.data))
    await recv_header(reader)
    with pytest.raises(WireError, match="expected 101"):
        await recv_payload(reader, 101, exact=True)  # larger than declared is refused too


class _StalledWriter(_Sink):
    """A stream whose reader never reads: drain never returns."""

    def __init__(self):
        super().__init__()
        self.aborted = False
        self.transport = self

    def abort(self):
        self.aborted = True

    async def drain(self):
        await asyncio.Event().wait()


async def test_a_bounded_send_to_a_reader_that_never_reads_is_aborted(monkeypatch):
    monkeypatch.setattr(wire, "SEND_STALL_S", 0.2)
    writer, t0 = _StalledWriter(), time.monotonic()
    with pytest.raises(WireError, match="reader took less than"):
        await send_msg(writer, {}, b"x" * (3 * wire.SEND_CHUNK), deadline_s=30)
    assert writer.aborted and time.monotonic() - t0 < 5
    assert len(writer.data) < 2 * wire.SEND_CHUNK  # the rest was never handed to the stream
