"""Whether others can dial this peer: a dial-back check that another node runs for it.

A peer behind a home router (NAT, no port forward) can dial out, but nobody can dial in. libp2p announces its
private listening address all the same, and p2pd's AutoNAT cannot judge a swarm whose addresses are private. Such a
peer passes every check of its own start-up and then merges alone, round after round, without a word. So a peer asks
a node it reaches (its initial peers first: a bootstrap node serves the check too, then live peers) to open a plain
TCP connection back to it, at each port it announces, and says what came of it.

The checker dials only the IP address it sees the requester's connection come from (libp2p's AutoNAT rule): a
requester can make it connect to itself and to nobody else. A request names at most `MAX_PORTS` ports; one
requester has one check at a time, and a node runs at most `MAX_CHECKS` at once. The check needs no swarm key
(it serves any run, as a bootstrap node does) and the reply is only advice to the requester: nothing in it is
taken by anyone else as a fact about the requester.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

from hivemind.p2p import PeerID

from p2pdiloco.network.admission import Request, StreamGate, serve_stream
from p2pdiloco.network.peer_tag import PeerLog, short_id
from p2pdiloco.network.swarm import BackgroundLoop
from p2pdiloco.network.wire import ByteCounter, await_requester_close, recv_header, send_msg

logger = logging.getLogger(__name__)

PROTOCOL = "p2pdiloco.reach"
"""Not prefixed by a run id: a bootstrap node serves every run."""
MAX_PORTS = 4
MAX_CHECKS = 8
DIAL_TIMEOUT_S = 3.0
"""A connect that takes longer than this counts as not reachable (a home router drops the SYN: it never answers)."""
CHECK_TIMEOUT_S = DIAL_TIMEOUT_S * MAX_PORTS + 5.0
"""A requester's bound on one checker's answer: the dials run one after another, plus the stream's set-up."""

_TCP_ADDR = re.compile(r"^/(ip4|ip6)/([^/]+)/tcp/(\d+)")


def tcp_endpoint(maddr: str) -> tuple[str, int] | None:
    """(IP, port) of a direct TCP multiaddr; None for anything else (relayed, DNS, QUIC, malformed)."""
    m = _TCP_ADDR.match(maddr)
    if m is None or "/p2p-circuit" in maddr:
        return None
    try:
        return str(ipaddress.ip_address(m.group(2))), int(m.group(3))
    except ValueError:
        return None


@dataclass(frozen=True)
class Reachability:
    """What a dial-back check found. `reachable` None: no node could check (none answered)."""

    reachable: bool | None
    checker: str = ""
    """The peer id of the node that dialed back."""
    observed_ip: str = ""
    """The address the checker saw this peer's connection come from."""
    detail: str = ""
    """Why not, in one line, for the log and `status`."""

    def record(self) -> dict:
        """The fields this peer adds to its heartbeat record (advice it got, shown by `status`)."""
        return {"reachable": self.reachable, "reach_detail": self.detail[:200]}


async def _dial(ip: str, port: int, timeout_s: float) -> str:
    """'' if a TCP connection to (ip, port) opened within `timeout_s`, else why not."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), timeout_s)
    except TimeoutError:
        return f"no answer in {timeout_s:.0f} s"
    except OSError as e:
        return os.strerror(e.errno) if e.errno else (str(e) or type(e).__name__)
    writer.close()
    return ""


class ReachService:
    """Serves the dial-back check on a node's p2p daemon.

    Args:
        me: this node's peer id (for the logs).
        gate: bounds on incoming streams (a peer shares its merger's, so the bounds hold across its protocols).
        counter: where the check's bytes are counted.
        dial_timeout_s: how long one dial back may take.
    """

    def __init__(self, me: str, gate: StreamGate | None = None, counter: ByteCounter | None = None,
                 dial_timeout_s: float = DIAL_TIMEOUT_S):
        self.me, self.gate, self.counter = me, gate or StreamGate(), counter or ByteCounter()
        self.log = PeerLog(logger, me)
        self.dial_timeout_s = dial_timeout_s
        self._busy: set[str] = set()
        self._slots = asyncio.Semaphore(MAX_CHECKS)
        self.checks = 0
        self.refused = 0

    async def start(self, p2p) -> None:
        """Register the protocol on `p2p` (hivemind's P2P, e.g. `await dht.replicate_p2p()`)."""
        await p2p.add_binary_stream_handler(PROTOCOL, self._on_stream)

    async def _on_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = functools.partial(self._check, str(info.addr))
        await serve_stream(self.gate, "reach", self.me, lambda *_: True, self.counter, handler, info, reader, writer)

    def refusal(self, request: Request, observed: tuple[str, int] | None) -> str:
        """Why a request is not checked ('' if it is)."""
        ports = request.header.get("ports")
        if not isinstance(ports, list) or not 1 <= len(ports) <= MAX_PORTS:
            return f"a check names 1 to {MAX_PORTS} ports"
        if not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in ports):
            return "ports must be integers in 1..65535"
        if observed is None:
            return "the connection is not a direct TCP one: nothing to dial back"
        if request.sender in self._busy:
            return "a check of this peer is already running"
        if self._slots.locked():
            return "busy: too many checks at once"
        return ""

    async def _check(self, remote_maddr: str, request: Request, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        observed = tcp_endpoint(remote_maddr)
        refused = self.refusal(request, observed)
        if refused:
            self.refused += 1
            await self._reply(reader, writer, {"refused": refused})
            return
        ip = observed[0]
        self._busy.add(request.sender)
        try:
            async with self._slots:
                self.checks += 1
                results = [[port, await _dial(ip, port, self.dial_timeout_s)] for port in request.header["ports"]]
        finally:
            self._busy.discard(request.sender)
        self.log.debug("dial-back of %s at %s: %s", short_id(request.sender), ip, results)
        await self._reply(reader, writer, {"observed": ip, "ports": results})

    async def _reply(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, header: dict) -> None:
        await send_msg(writer, header, b"", self.counter)
        await await_requester_close(reader)


async def ask(p2p, checker: str, ports: list[int], counter: ByteCounter | None = None,
              timeout_s: float = CHECK_TIMEOUT_S) -> dict:
    """One node's answer to a dial-back check of `ports`: {"observed": ip, "ports": [[port, why_not]]} or
    {"refused": why}.

    Raises:
        TimeoutError, ConnectionError, OSError, WireError, P2PDaemonError: no answer.
    """
    async def call() -> dict:
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(checker), PROTOCOL)
        try:
            await send_msg(writer, {"ports": ports}, b"", counter)
            return await recv_header(reader, counter)
        finally:
            writer.close()

    return await asyncio.wait_for(call(), timeout_s)


def verdict(reply: dict, checker: str, announced: list[str]) -> Reachability | None:
    """What a checker's reply says of this peer (None: it refused or its reply is malformed).

    Args:
        reply: the checker's reply header (from a stranger: nothing in it is assumed well formed).
        checker: its peer id.
        announced: the multiaddrs this peer announces.
    """
    observed, ports = reply.get("observed"), reply.get("ports")
    if not isinstance(observed, str) or not isinstance(ports, list) or not ports:
        return None
    results = [(p[0], p[1]) for p in ports if isinstance(p, list) and len(p) == 2 and isinstance(p[1], str)]
    if not results:
        return None
    if any(why == "" for _, why in results):
        return Reachability(True, checker, observed[:64])
    port, why = results[0]
    own_ips = {e[0] for m in announced if (e := tcp_endpoint(m)) is not None}
    nat = f"; it announces {', '.join(sorted(own_ips))} but connects from {observed[:64]} (behind NAT?)" \
        if own_ips and observed not in own_ips else ""
    return Reachability(False, checker, observed[:64], f"{short_id(checker)} could not connect to {observed[:64]}:{port} "
                                                       f"({str(why)[:60]}){nat}")


async def check_reachability(p2p, checkers: list[str], announced: list[str], counter: ByteCounter | None = None,
                             timeout_s: float = CHECK_TIMEOUT_S) -> Reachability:
    """Ask `checkers` in turn to dial this peer back at the ports it announces, until one answers.

    Args:
        p2p: this peer's hivemind P2P.
        checkers: peer ids to ask, in order (its own id is skipped).
        announced: the multiaddrs this peer announces (their TCP ports are checked).
        counter: where the bytes are counted.
        timeout_s: how long each checker may take.
    """
    ports = sorted({e[1] for m in announced if (e := tcp_endpoint(m)) is not None})[:MAX_PORTS]
    if not ports:
        return Reachability(None, detail="this peer announces no TCP address")
    me = p2p.peer_id.to_base58()
    tried = []
    for checker in dict.fromkeys(c for c in checkers if c != me):
        try:
            reply = await ask(p2p, checker, ports, counter, timeout_s)
        except Exception as e:  # an old node without the protocol, a dead one, a slow one: ask the next
            tried.append(f"{short_id(checker)}: {type(e).__name__}")
            continue
        found = verdict(reply, checker, announced)
        if found is not None:
            return found
        tried.append(f"{short_id(checker)}: {str(reply.get('refused', 'malformed reply'))[:80]}")
    return Reachability(None, detail="no node could check: " + ("; ".join(tried) if tried else "none known yet"))


def peer_ids_of(maddrs: list[str]) -> list[str]:
    """The peer ids named by `/p2p/<id>` in multiaddrs (e.g. a peer's initial peers), in order."""
    return [m.rsplit("/p2p/", 1)[1] for m in maddrs if "/p2p/" in m]


async def find_reachability(p2p, announced: list[str], candidates, counter: ByteCounter | None = None,
                            tries: int = 4, retry_s: float = 15.0, on_attempt=None) -> Reachability:
    """`check_reachability` against `await candidates()` (peer ids to ask, best first), again every `retry_s`
    seconds while no node could check (the first peer of a swarm has nobody to ask until others join);
    `on_attempt(found)` after each attempt."""
    found = Reachability(None, detail="not checked")
    for attempt in range(tries):
        found = await check_reachability(p2p, await candidates(), announced, counter)
        if on_attempt is not None:
            on_attempt(found)
        if found.reachable is not None or attempt == tries - 1:
            return found
        await asyncio.sleep(retry_s)
    return found


@contextlib.contextmanager
def serving_reach(dht) -> Iterator[ReachService]:
    """Serve the dial-back check on `dht`'s p2p daemon, from a loop of its own, until the block ends: a bootstrap
    node's (every peer of a swarm reaches it, so peers ask it first). A peer serves it on its own network loop
    (app/reach.py)."""
    loop = BackgroundLoop("reach")
    p2p = None
    try:
        p2p = loop.run(dht.replicate_p2p(), timeout=10)
        service = ReachService(dht.peer_id.to_base58())
        loop.run(service.start(p2p), timeout=10)
        yield service
    finally:
        if p2p is not None:  # its socket file in /tmp goes with it
            with contextlib.suppress(Exception):  # shutting down: a stuck daemon must not keep the node up
                loop.run(p2p.shutdown(), timeout=5)
        loop.close()
