"""Authenticated request and reply between two peers over hivemind's libp2p streams, every byte counted.

One request is one stream: the requester sends a frame (see wire.py) whose header carries the swarm key's tag
for (op, requester, responder); the responder checks it, sends one reply frame tagged for (op + ':reply'),
and keeps the stream open until the requester has read it. Protocol names are `p2pdiloco.<run id>.<op>`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import hivemind
from hivemind.p2p import PeerID

from p2pdiloco.network.swarm_key import SwarmAuth
from p2pdiloco.network.wire import ByteCounter, await_requester_close, recv_msg, send_msg

logger = logging.getLogger(__name__)

RPC_TIMEOUT_S = 5.0
"""Bound on one small request (invite, group notice)."""

Handler = Callable[[object, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
"""(stream info with the requester's peer id, reader, writer): serves one request."""


class MergeFailed(Exception):
    """A group merge that must not be applied."""


class Rpc:
    """This peer's end of p2pdiloco's request/reply protocols.

    Args:
        dht: this peer's running DHT (its p2p daemon carries the streams).
        run_id: the swarm's run id, which prefixes every protocol name.
        auth: the swarm key's request authenticator.
        counter: where the bytes of every frame sent and received are added.
    """

    def __init__(self, dht: hivemind.DHT, run_id: str, auth: SwarmAuth, counter: ByteCounter):
        self.dht, self.run_id, self.auth, self.counter = dht, run_id, auth, counter
        self.peer_id = dht.peer_id.to_base58()
        self._p2p = None

    def proto(self, op: str) -> str:
        return f"p2pdiloco.{self.run_id}.{op}"

    async def start(self, handlers: dict[str, Handler]) -> None:
        """Attach to the DHT's p2p daemon and serve `handlers`: {op: handler}, registered in that order."""
        self._p2p = await self.dht.replicate_p2p()
        for op, handler in handlers.items():
            await self._p2p.add_binary_stream_handler(self.proto(op), handler)

    async def call(self, peer: str, op: str, header: dict, payload: bytes = b"", max_reply: int = 0) -> tuple[dict, bytes]:
        """Send one request to `peer` and return its (reply header, reply payload).

        Raises:
            MergeFailed: the reply does not carry the swarm key's tag.
            WireError, ConnectionError, OSError: the stream broke or the reply was malformed or too large.
        """
        _, reader, writer = await self._p2p.call_binary_stream_handler(PeerID.from_base58(peer), self.proto(op))
        try:
            await send_msg(writer, {**header, "auth": self.auth.tag(op, self.peer_id, peer)}, payload, self.counter)
            reply, data = await recv_msg(reader, max_reply, self.counter)
        finally:
            writer.close()
        if not self.auth.verify(op + ":reply", peer, self.peer_id, reply.get("auth")):
            raise MergeFailed(f"{op} reply from {peer[-6:]} without the swarm key")
        return reply, data

    async def request(self, peer: str, op: str, header: dict) -> dict | None:
        """A small request with a short timeout; None if the peer did not answer."""
        try:
            reply, _ = await asyncio.wait_for(self.call(peer, op, header), RPC_TIMEOUT_S)
            return reply
        except Exception as e:  # an unreachable or dead peer is normal in a swarm
            logger.debug("[%s] %s to %s failed: %r", self.peer_id[-6:], op, peer[-6:], e)
            return None

    async def receive(self, reader: asyncio.StreamReader, max_payload: int = 0) -> tuple[dict, bytes]:
        """A handler's request: (header, payload), counted."""
        return await recv_msg(reader, max_payload, self.counter)

    def authorized(self, op: str, requester: str, header: dict) -> bool:
        """Whether a request's header carries the swarm key's tag (a refusal is logged)."""
        if self.auth.verify(op, requester, self.peer_id, header.get("auth")):
            return True
        logger.warning("[%s] refused a %s request from %s: no valid swarm key", self.peer_id[-6:], op, requester[-8:])
        return False

    async def reply(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, op: str, requester: str,
                    header: dict, payload: bytes = b"") -> None:
        """Send a handler's reply and keep the stream open until the requester has read it (see wire.py)."""
        await send_msg(writer, {**header, "auth": self.auth.tag(op + ":reply", self.peer_id, requester)}, payload,
                       self.counter)
        await await_requester_close(reader)
