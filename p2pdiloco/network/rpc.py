"""Authenticated request and reply between two peers over hivemind's libp2p streams, every byte counted.

One request is one stream: the requester sends a frame (see wire.py) whose header carries the swarm key's tag
for (op, requester, responder); the responder admits the stream within its bounds and checks the tag before it
reads the payload (admission.py), sends one reply frame tagged for (op + ':reply') with a bounded send, and
keeps the stream open until the requester has read it. Protocol names are `p2pdiloco.<run id>.<op>`.
"""

from __future__ import annotations

import asyncio
import functools
import logging

import hivemind
from hivemind.p2p import PeerID

from p2pdiloco.network.admission import Handler, StreamGate, serve_stream
from p2pdiloco.network.peer_tag import PeerLog, short_id
from p2pdiloco.network.swarm_key import SwarmAuth
from p2pdiloco.network.wire import (
    ByteCounter,
    await_requester_close,
    recv_header,
    recv_payload,
    send_deadline,
    send_msg,
)

logger = logging.getLogger(__name__)

RPC_TIMEOUT_S = 5.0
"""Bound on one small request (invite, group notice)."""


class MergeFailed(Exception):
    """A group merge that must not be applied."""


class Rpc:
    """This peer's end of p2pdiloco's request/reply protocols.

    Args:
        dht: this peer's running DHT (its p2p daemon carries the streams).
        run_id: the swarm's run id, which prefixes every protocol name.
        auth: the swarm key's request authenticator.
        counter: where the bytes of every frame sent and received are added.
        gate: bounds on the incoming streams this peer serves (None: its own, with the default bounds);
            share one with the peer's `StateSync` so that the bounds hold across all its protocols.
    """

    def __init__(self, dht: hivemind.DHT, run_id: str, auth: SwarmAuth, counter: ByteCounter,
                 gate: StreamGate | None = None):
        self.dht, self.run_id, self.auth, self.counter = dht, run_id, auth, counter
        self.gate = gate or StreamGate()
        self.peer_id = dht.peer_id.to_base58()
        self.log = PeerLog(logger, self.peer_id)
        self._p2p = None

    def proto(self, op: str) -> str:
        return f"p2pdiloco.{self.run_id}.{op}"

    async def start(self, handlers: dict[str, Handler]) -> None:
        """Attach to the DHT's p2p daemon and serve `handlers`: {op: handler}, registered in that order.

        Each handler gets requests whose header carried a valid tag, within the gate's bounds (admission.py);
        it reads the payload with `receive_payload` and answers with `reply`.
        """
        self._p2p = await self.dht.replicate_p2p()
        for op, handler in handlers.items():
            serve = functools.partial(serve_stream, self.gate, op, self.peer_id, functools.partial(self.authorized, op),
                                      self.counter, handler)
            await self._p2p.add_binary_stream_handler(self.proto(op), serve)

    async def close(self) -> None:
        """Stop serving and remove the p2p client's socket file from /tmp. The client is hivemind's replica of the
        DHT's P2P, which the DHT object caches, so every protocol served through this DHT (`StateSync`'s too) stops
        with it: call it when the peer shuts down. Without it the socket file outlived every peer's run, one file a
        peer (hivemind removes it only when the replica is shut down or garbage-collected, and a peer exits holding
        it): thousands of them in a test machine's /tmp."""
        if self._p2p is not None:
            p2p, self._p2p = self._p2p, None
            await p2p.shutdown()

    async def call(self, peer: str, op: str, header: dict, payload: bytes = b"", max_reply: int = 0,
                   phase: ByteCounter | None = None) -> tuple[dict, bytes]:
        """Send one request to `peer` and return its (reply header, reply payload); `phase`: the merge phase's byte
        counter, where the request's and reply's bytes are added too.

        Raises:
            MergeFailed: the reply does not carry the swarm key's tag.
            WireError, ConnectionError, OSError: the stream broke or the reply was malformed or too large.
        """
        _, reader, writer = await self._p2p.call_binary_stream_handler(PeerID.from_base58(peer), self.proto(op))
        try:
            await send_msg(writer, {**header, "auth": self.auth.tag(op, self.peer_id, peer)}, payload, self.counter,
                           phase=phase)
            reply = await recv_header(reader, self.counter, phase)
            if not self.auth.verify(op + ":reply", peer, self.peer_id, reply.get("auth")):
                raise MergeFailed(f"{op} reply from {short_id(peer)} without the swarm key")  # its payload unread
            data = await recv_payload(reader, max_reply, self.counter, phase=phase)
        finally:
            writer.close()
        return reply, data

    async def request(self, peer: str, op: str, header: dict) -> dict | None:
        """A small request with a short timeout; None if the peer did not answer."""
        try:
            reply, _ = await asyncio.wait_for(self.call(peer, op, header), RPC_TIMEOUT_S)
            return reply
        except Exception as e:  # an unreachable or dead peer is normal in a swarm
            self.log.debug("%s to %s failed: %r", op, short_id(peer), e)
            return None

    async def receive_payload(self, reader: asyncio.StreamReader, size: int = 0,
                              timeout_s: float = RPC_TIMEOUT_S, exact: bool = True,
                              phase: ByteCounter | None = None) -> bytes:
        """A handler's request payload, which must be exactly `size` bytes (at most `size` if not `exact`) and
        arrive within `timeout_s`; `phase`: the merge phase's byte counter, where its bytes are added too.

        Raises:
            WireError: another size was declared (nothing of it is read), or the stream broke.
            TimeoutError: it did not arrive in time.
        """
        async with asyncio.timeout(timeout_s):
            return await recv_payload(reader, size, self.counter, exact=exact, phase=phase)

    def authorized(self, op: str, requester: str, header: dict) -> bool:
        """Whether a request's header carries the swarm key's tag (a refusal is logged)."""
        if self.auth.verify(op, requester, self.peer_id, header.get("auth")):
            return True
        self.log.warning("refused a %s request from %s: no valid swarm key", op, requester[-8:])
        return False

    async def reply(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, op: str, requester: str,
                    header: dict, payload: bytes = b"", phase: ByteCounter | None = None) -> None:
        """Send a handler's reply, within `send_deadline` of its size, and keep the stream open until the requester
        has read it (see wire.py); `phase`: the merge phase's byte counter, where its bytes are added too."""
        await send_msg(writer, {**header, "auth": self.auth.tag(op + ":reply", self.peer_id, requester)}, payload,
                       self.counter, deadline_s=send_deadline(len(payload)), phase=phase)
        await await_requester_close(reader)
