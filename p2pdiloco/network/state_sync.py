"""State download: a joining (or resuming) peer fetches the swarm's global model from a live peer.

What travels: θg and the outer momentum (fp32, concatenated) as the payload, and the counters (round,
schedule step, tokens absorbed) with a sha256 of the payload in the header. The joiner verifies length,
checksum and finiteness before it uses anything, and tries the next donor on any failure. Donors serve
`SERVING_SLOTS` downloads at a time, one per joiner, shared fairly (state_slots.py), and otherwise answer
"busy" with the time to ask again, so several joiners spread over several donors instead of queueing on the
freshest one, and come back when told. A download is a bounded send (`wire.send_msg`): a joiner that stops
reading is cut off within seconds and then refused for a while, so it cannot keep a slot (or a copy of the
state) for long. Requests pass the peer's stream admission first (admission.py): the key is checked before
anything else.

Nothing a donor says about its state is taken on its word (a donor may lie): the joiner takes a state only if its
digest is the global model of at least two live peers (their heartbeat records carry `global_digest`; with a
single live peer, that peer's), and only if the joiner's own check passes (`fetch(judge=…)`: the app checks that
the state predicts the joiner's own data better than its own model, training/evaluation.state_check), since ids
are free and two of them can name any digest. The counters it adopts are capped by the lower median of the live
peers' records and by the lowest claim among the records naming the state, so that neither one donor claiming step
10⁹ nor peers that hold the honest state and lie about its counters can end a joiner's run.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import hivemind
import torch
from hivemind.p2p import PeerID

from p2pdiloco.algorithm.outer import state_digest
from p2pdiloco.network.admission import Request, StreamGate, serve_stream
from p2pdiloco.network.peer_tag import PeerLog, short_id
from p2pdiloco.network.state_slots import Refusal, StateSlots
from p2pdiloco.network.swarm_key import SwarmAuth
from p2pdiloco.network.wire import (
    HEADER_TIMEOUT_S,
    ByteCounter,
    WireError,
    await_requester_close,
    recv_header,
    recv_payload,
    send_deadline,
    send_msg,
)
from p2pdiloco.util.numbers import number_or_none

logger = logging.getLogger(__name__)

BUSY_WAIT_S = 30.0
"""How long, at most, one pass of a joiner over its donors waits in all for donors that said "busy" to be free."""


class StateError(Exception):
    """A downloaded state that must not be used."""


class StateBusy(StateError):
    """A donor that does not serve this joiner now, and says when to ask again.

    Args:
        reason: the donor's word: 'busy', 'one at a time', 'backed off' or 'served recently' (state_slots.py).
        retry_after_s: seconds after which the donor may serve this joiner.
    """

    def __init__(self, reason: str, retry_after_s: float):
        super().__init__(f"donor busy ({reason}; ask again in {retry_after_s:.1f} s)")
        self.reason, self.retry_after_s = reason, retry_after_s


@dataclass
class GlobalState:
    """What a peer needs to continue the swarm's run: the global model, outer state and counters."""

    global_params: torch.Tensor
    """Flat fp32 θg."""
    momentum: torch.Tensor
    """Flat fp32 outer momentum."""
    round: int
    """Merges the donor has applied."""
    step: int
    """The donor's inner step (its position in the learning-rate schedule)."""
    global_tokens: float
    """Tokens whose effect reached this θg."""


def pack_state(state: GlobalState) -> tuple[dict, bytes]:
    payload = torch.cat([state.global_params, state.momentum]).float().contiguous().numpy().tobytes()
    header = {
        "ok": True, "round": state.round, "step": state.step, "global_tokens": state.global_tokens,
        "n_params": state.global_params.numel(), "sha256": hashlib.sha256(payload).hexdigest(),
    }
    return header, payload


def unpack_state(header: dict, payload: bytes, n_params: int) -> GlobalState:
    """Verify and decode a state reply; raise StateError on anything unexpected."""
    if header.get("n_params") != n_params or len(payload) != 2 * n_params * 4:
        raise StateError(f"state of {header.get('n_params')} params / {len(payload)} bytes, expected {n_params}")
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise StateError("checksum mismatch")
    try:
        round_, step, tokens = int(header["round"]), int(header["step"]), float(header["global_tokens"])
    except (KeyError, TypeError, ValueError):
        raise StateError("malformed counters") from None
    flat = torch.frombuffer(bytearray(payload), dtype=torch.float32)
    if not torch.isfinite(flat).all():
        raise StateError("non-finite values")
    return GlobalState(flat[:n_params].clone(), flat[n_params:].clone(), round_, step, tokens)


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _retry_after(header: dict) -> float:
    """A busy donor's `retry_after_s`, bounded to [0, `BUSY_WAIT_S`] (a donor's word; 1 s if it gave none)."""
    value = _number(header.get("retry_after_s"))
    return 1.0 if value is None or not math.isfinite(value) else min(max(value, 0.0), BUSY_WAIT_S)


def donor_order(records: dict[str, dict], me: str, rng: random.Random | None = None) -> list[str]:
    """Donors to try: peers whose global model the most live peers share first (by the digests in their
    records), and among those, peers whose record does not say that others cannot dial them (a download is a
    stream the joiner opens; network/reachability.py), shuffled among equals so that joiners arriving together
    pick different donors. A peer with no digest yet (no merge applied) has nothing to give."""
    rng = rng or random.Random()
    digests = {p: r.get("global_digest") for p, r in records.items() if p != me}
    digests = {p: d for p, d in digests.items() if isinstance(d, str) and d}
    support = Counter(digests.values())
    donors = list(digests)
    rng.shuffle(donors)
    # stable: the shuffle orders equals
    return sorted(donors, key=lambda p: (-support[digests[p]], records[p].get("reachable") is False))


def state_support(records: dict[str, dict], me: str, digest: str) -> tuple[int, int]:
    """(live peers other than `me` whose record says their global model has `digest`, how many must agree)."""
    digests = [r.get("global_digest") for p, r in records.items() if p != me]
    holders = [d for d in digests if isinstance(d, str) and d]
    return sum(d == digest for d in holders), min(2, len(holders))


def wanted_digest(records: dict[str, dict], me: str) -> str | None:
    """The global model a joiner asks its donors for: of the digests that enough live records name to be taken
    at once (`state_support`), the one most records name, and among those the one whose records claim the most
    tokens. Records lag their peers' merges by up to a heartbeat, so where rounds are shorter each donor's current
    state may be one no record names yet; a donor that still holds the named one serves it (`StateSync.held`).
    None where no digest is named often enough."""
    tokens: dict[str, float] = {}
    for p, r in records.items():
        if p != me and isinstance(d := r.get("global_digest"), str) and d:
            tokens[d] = max(tokens.get(d, 0.0), number_or_none(r.get("global_tokens")) or 0.0)
    support = {d: state_support(records, me, d) for d in tokens}
    enough = [d for d, (holders, need) in support.items() if holders >= need]
    return max(enough, key=lambda d: (support[d][0], tokens[d], d)) if enough else None


def bounded_counters(state: GlobalState, records: dict[str, dict], me: str, digest: str | None = None) -> GlobalState:
    """The donor's counters capped by the (lower) median of the live peers' records, and by the lowest claim among
    the records naming `digest` (the state's): a donor's claim alone cannot put a joiner at the end of the schedule
    or make its θg count for more than the swarm's, and an honest holder of the state bounds what others holding
    the same bits claim for it."""
    def cap(value: float, field: str) -> float:
        claims = sorted(x for p, r in records.items() if p != me and (x := _number(r.get(field))) is not None)
        holders = [x for p, r in records.items()
                   if p != me and digest and r.get("global_digest") == digest and (x := _number(r.get(field))) is not None]
        value = min(value, claims[(len(claims) - 1) // 2]) if claims else value
        return min(value, *holders) if holders else value

    return GlobalState(state.global_params, state.momentum, int(cap(state.round, "round")), int(cap(state.step, "step")),
                       cap(state.global_tokens, "global_tokens"))


class StateSync:
    """Serves this peer's state to joiners, and fetches the swarm's state for this peer.

    Args:
        dht: this peer's DHT (its p2p daemon carries the streams).
        run_id: the swarm's name (protocol prefix).
        n_params: length of the flat parameter vector.
        provider: returns this peer's current state, or None while it has none worth serving.
        held: returns the state with a digest if this peer still holds it (a joiner asks for the one its donors'
            records name, `wanted_digest`), else None; None: only the current state is served.
        counter: where bytes sent and received are added.
        auth: the swarm key's authenticator: requests and replies without a valid tag are refused (None: public).
        gate: bounds on the incoming streams this peer serves; pass the merger's (`P2PMerger.rpc.gate`) so that
            they hold across all of the peer's protocols (None: its own).
    """

    def __init__(self, dht: hivemind.DHT, run_id: str, n_params: int,
                 provider: Callable[[], GlobalState | None], counter: ByteCounter, auth: SwarmAuth | None = None,
                 gate: StreamGate | None = None, held: Callable[[str], GlobalState | None] | None = None):
        self.dht, self.proto, self.n_params, self.provider, self.counter = dht, f"p2pdiloco.{run_id}.state", n_params, provider, counter
        self.auth = auth or SwarmAuth(None, run_id)
        self.gate = gate or StreamGate()
        self.held = held
        self.me = dht.peer_id.to_base58()
        self.log = PeerLog(logger, self.me)
        self.slots = StateSlots()
        """Who is served now, who waits, who is backed off (state_slots.py)."""
        self.aborted = 0
        """Downloads cut off because the joiner did not read them in time."""
        self.refused: dict[str, str] = {}
        """States the joiner's own check refused in its last `fetch`: {digest: why}."""
        self._p2p = None

    async def start(self) -> None:
        self._p2p = await self.dht.replicate_p2p()
        serve = functools.partial(serve_stream, self.gate, "state", self.me, self._authorized, self.counter,
                                  self._on_request)
        await self._p2p.add_binary_stream_handler(self.proto, serve)

    def _authorized(self, joiner: str, header: dict) -> bool:
        if self.auth.verify("state", joiner, self.me, header.get("auth")):
            return True
        self.log.warning("refused a state request from %s: no valid swarm key", joiner[-8:])
        return False

    async def _on_request(self, request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A joiner's request (its tag checked; the stream is closed after, see admission.py; `StateSlots.opened`)."""
        async with asyncio.timeout(HEADER_TIMEOUT_S):
            await recv_payload(reader, 0, self.counter, exact=True)  # a request carries none
        joiner = request.sender
        tag = self.auth.tag("state:reply", self.me, joiner)
        try:
            if (refusal := self.slots.opened(joiner)) is not None:  # refused at once: no wait for its close
                await self._refuse(writer, tag, refusal)
            elif await self._serve(request, writer, tag):
                await await_requester_close(reader)  # closing at once could lose the reply (see wire.py)
        finally:
            self.slots.closed(joiner)

    async def _refuse(self, writer: asyncio.StreamWriter, tag: str, refusal: Refusal) -> None:
        await send_msg(writer, {"ok": False, "busy": True, "reason": refusal.reason, "retry_after_s":
                                refusal.retry_after_s, "auth": tag}, counter=self.counter, deadline_s=send_deadline(0))

    async def _serve(self, request: Request, writer: asyncio.StreamWriter, tag: str) -> bool:
        """Reply to `request`: the state, or why not; False if a download was cut off."""
        joiner, want = request.sender, request.header.get("want")
        state = (self.held(want) if self.held is not None and isinstance(want, str) and want else None) or self.provider()
        if state is None:
            await send_msg(writer, {"ok": False, "error": "no state yet", "auth": tag}, counter=self.counter,
                           deadline_s=send_deadline(0))
        elif (refusal := self.slots.ask(joiner, send_deadline(2 * self.n_params * 4))) is not None:
            await self._refuse(writer, tag, refusal)
        else:
            stalled = completed = False
            try:
                header, payload = pack_state(state)
                await send_msg(writer, {**header, "auth": tag}, payload, self.counter,
                               deadline_s=send_deadline(len(payload)))
                completed = True
            except WireError as e:
                self.aborted, stalled = self.aborted + 1, True
                self.log.warning("cut off a state download to %s: %s", short_id(joiner), e)
                return False
            finally:
                self.slots.release(joiner, stalled, completed)
            self.log.info("served state of round %d to %s", state.round, short_id(joiner))
        return True

    async def fetch_from(self, peer: str, timeout: float, want: str | None = None) -> GlobalState:
        """Download `peer`'s state (the one with digest `want` if it still holds it, else its current one): its
        reply's tag is checked before its payload is read."""
        _, reader, writer = await self._p2p.call_binary_stream_handler(PeerID.from_base58(peer), self.proto)
        try:
            request = {"auth": self.auth.tag("state", self.me, peer), **({"want": want} if want else {})}
            await send_msg(writer, request, counter=self.counter)
            async with asyncio.timeout(timeout):
                header = await recv_header(reader, self.counter)
                if not self.auth.verify("state:reply", peer, self.me, header.get("auth")):
                    raise StateError("the donor does not hold the swarm key")
                if not header.get("ok"):
                    if header.get("busy"):
                        raise StateBusy(str(header.get("reason", "busy")), _retry_after(header))
                    raise StateError(f"donor refused: {header.get('error')}")
                payload = await recv_payload(reader, 2 * self.n_params * 4, self.counter, exact=True)
        finally:
            writer.close()
        return unpack_state(header, payload, self.n_params)

    async def fetch(self, records: dict[str, dict], me: str, timeout: float,
                    refresh: Callable[[], Awaitable[dict[str, dict]]] | None = None, passes: int = 3,
                    judge: Callable[[torch.Tensor], str | None] | None = None) -> tuple[GlobalState, str] | None:
        """Try donors in `donor_order` until a state is held by enough live peers: those that served it to us
        (bit for bit, as its digest shows) and those whose record named its digest in any read of the records
        during this fetch, together at least two (one if only one live peer has a model).

        Args:
            records: live peers' heartbeat records, {peer id: record}.
            me: this peer's id.
            timeout: bound on one download.
            refresh: re-reads the live records (after a heartbeat). A record lags its peer's last merge by up
                to a heartbeat, and where rounds are shorter than a heartbeat every donor may serve a state no
                record names yet: so after each pass over the donors without a qualifying state the records are
                read again, and what every read named is kept.
            passes: passes over the donors, at most (each but the first after a refresh). In a pass, a donor that
                says "busy" is asked again when it says to come back (`_download_pass`).
            judge: the joiner's own check of a downloaded state's θg (run in a worker thread, once a digest):
                returns why it is refused, or None. A refused state is not taken however many peers hold it, and
                donors whose record names it are not asked again in this fetch; refusals are kept in `refused`.

        Returns:
            (the state, with counters bounded by the latest records; the donor), or None if no state qualified.
        """
        got: dict[str, tuple[GlobalState, str]] = {}
        served: dict[str, set[str]] = {}
        named: dict[str, set[str]] = {}
        self.refused = {}

        def note(records: dict[str, dict]) -> dict[str, dict]:
            for p, r in records.items():
                if p != me and isinstance(d := r.get("global_digest"), str) and d:
                    named.setdefault(d, set()).add(p)
            return records

        def agreed(records: dict[str, dict]) -> tuple[GlobalState, str] | None:
            for digest, (state, donor) in got.items():
                if len(served[digest] | named.get(digest, set())) >= state_support(records, me, digest)[1]:
                    return bounded_counters(state, records, me, digest), donor
            return None

        async def take(state: GlobalState, donor: str) -> tuple[GlobalState, str] | None:
            digest = state_digest(state.global_params, state.momentum)
            if digest not in got and digest not in self.refused and judge is not None:
                if (why := await asyncio.to_thread(judge, state.global_params)) is not None:
                    self.refused[digest] = why
            if digest in self.refused:
                logger.warning("refused the state from %s: %s", short_id(donor), self.refused[digest])
                return None
            got.setdefault(digest, (state, donor))
            served.setdefault(digest, set()).add(donor)
            if (found := agreed(records)) is None:
                logger.info("the state from %s is held by no other live peer yet; trying the next donor",
                            short_id(donor))
            return found

        def refused_by_record(donor: str) -> bool:  # by the latest read of the records
            return records.get(donor, {}).get("global_digest") in self.refused

        note(records)
        for attempt in range(1, passes + 1):
            want = wanted_digest(records, me)
            if (found := await self._download_pass(donor_order(records, me), timeout, take, want,
                                                   refused_by_record)) is not None:
                return found
            if refresh is None or attempt == passes:
                break
            records = note(await refresh())
            if (found := agreed(records)) is not None:
                return found
            logger.info("no state held by enough live peers after pass %d of %d; reading the records again",
                        attempt, passes)
        if got or self.refused:
            logger.warning("no state offered by %d donor(s) was held by enough live peers and passed this peer's "
                           "check (%d refused by it): not taken", len(got) + len(self.refused), len(self.refused))
        return None

    async def _download_pass(self, donors: list[str], timeout: float,
                             take: Callable[[GlobalState, str], Awaitable[tuple[GlobalState, str] | None]],
                             want: str | None = None,
                             skip: Callable[[str], bool] = lambda _donor: False) -> tuple[GlobalState, str] | None:
        """Ask each of `donors` in order; a donor that says "busy" again when it says to come back (other donors
        first), for at most `BUSY_WAIT_S` from the pass's start, asking for the state with digest `want`.
        `take(state, donor)` returns what `fetch` returns once a state qualifies, which ends the pass; a donor for
        which `skip(donor)` holds when its turn comes is not asked."""
        due = [(0.0, donor) for donor in donors]  # (monotonic time to ask, donor)
        give_up = time.monotonic() + BUSY_WAIT_S
        while due:
            due.sort(key=lambda d: d[0])  # stable: donors due at once keep their order
            at, donor = due.pop(0)
            if at > give_up:
                logger.info("donor %s still busy; not waiting longer", short_id(donor))
                continue
            if skip(donor):
                logger.info("not asking %s: its record names a state this peer refused", short_id(donor))
                continue
            if (pause := at - time.monotonic()) > 0:
                await asyncio.sleep(pause)
            try:
                state = await asyncio.wait_for(self.fetch_from(donor, timeout, want), timeout)
            except StateBusy as e:
                logger.info("state download from %s: %s", short_id(donor), e)
                due.append((time.monotonic() + e.retry_after_s, donor))
                continue
            except (StateError, WireError, TimeoutError, ConnectionError, OSError, Exception) as e:
                logger.warning("state download from %s failed (%s); trying the next donor", short_id(donor), e)
                continue
            if (found := await take(state, donor)) is not None:
                return found
        return None
