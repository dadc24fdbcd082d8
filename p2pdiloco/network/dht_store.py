"""Storing a peer's records without walking the DHT every time.

hivemind's `DHTNode.store` finds a key's nearest nodes by a lookup (`rpc_find`) on every store, and every node the
lookup visits answers with the key's whole value, every subkey of it: a heartbeat into a shard holding k peers'
records moved those k records from each of ~8 nodes every 5 s, and a census registration the whole census. Both
grow with the swarm (docs/benchmarks.md, DHT, compares the two).

`store_near` remembers a key's nearest nodes for `NEAREST_TTL_S` and sends the signed record straight to them
(`rpc_store`: the record and its key, nothing else), walking again only when that time is up or one of them did
not answer; the walk itself keeps `DHT_REPLICAS` nodes in its beam, not `DHT_BUCKET_SIZE`, and looks up an id
next to the key's (`beside`), so that the nodes on the way do not send the key's records with their contacts. Reads
(`swarm.read_subkeys`) walk with the same beam, so they visit the nodes the stores went to.

These functions run in the DHT's own process (`DHT.run_coroutine`), where the node and its signing validators live.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import hivemind
from hivemind.dht.node import _SearchState
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord

DHT_BUCKET_SIZE = 8
"""Contacts per routing bucket, and per reply to a lookup (hivemind's default: 20)."""
DHT_REPLICAS = 3
"""Nodes that store each record (hivemind's default: 5); records are re-written every heartbeat anyway."""
NEAREST_TTL_S = 60.0
"""A key's nearest nodes are looked up again after this long, so that nodes that joined since are found."""

_NEAREST: dict[DHTID, tuple[float, dict]] = {}
"""In the DHT process: key id -> (when looked up, monotonic; {node id: peer id} of its nearest nodes, self included)."""


async def _nearest(node, key_id: DHTID) -> dict:
    return (await _nearest_many(node, [key_id]))[key_id]


async def _nearest_many(node, key_ids: list[DHTID]) -> dict[DHTID, dict]:
    """The nearest nodes of each key, from the cache or by one walk for all the keys not in it. A cached set is
    first brought up to date with this node's routing table (`_with_known`): no walk, no byte."""
    now = time.monotonic()
    missing = [k for k in key_ids if (cached := _NEAREST.get(k)) is None or now - cached[0] >= NEAREST_TTL_S]
    for key_id in set(key_ids) - set(missing):
        when, cached = _NEAREST[key_id]
        _NEAREST[key_id] = (when, _with_known(node, key_id, cached))
    if missing:
        # The walk asks for `beside(key_id)`, where nothing is stored: every node it visits answers with contacts
        # only, where asking for the key itself returned its whole value (all subkeys) from each of them. The keys'
        # queries share one walk, so that a node on the way answers for several at once.
        queries = {beside(k): k for k in missing}
        found = await node.find_nearest_nodes(list(queries), k_nearest=node.num_replicas, beam_size=node.num_replicas,
                                              exclude_self=node.protocol.client_mode)  # a client serves no records
        for stale in [k for k, (t, _) in _NEAREST.items() if now - t >= NEAREST_TTL_S]:
            del _NEAREST[stale]
        for query, key_id in queries.items():
            _NEAREST[key_id] = (now, found[query])
    return {k: _NEAREST[k][1] for k in key_ids}


def _with_known(node, key_id: DHTID, cached: dict) -> dict:
    """`cached` (a key's nearest nodes as last looked up, nearest first) with any nearer node that this node's routing
    table has learned of since, as many nodes as before.

    A key's nearest nodes looked up while the swarm was still starting (a routing table of a few nodes) are not its
    nearest once the rest have joined. Kept for `NEAREST_TTL_S`, a record written in that time (a census registration
    for the next epoch) went to them only, where the others' reads (`read_near_many`, from the nearest node they
    know) may not look: their views of the epoch then differ, and they walk the census to fill them
    (`census.Census.members`). Nodes that join contact the others (and are contacted), so the routing tables learn of
    them within seconds."""
    known = node.protocol.routing_table.get_nearest_neighbors(key_id, k=node.num_replicas,
                                                              exclude=node.node_id)
    merged = {**cached, **{n: p for n, p in known if n not in cached}}
    nearest = sorted(merged, key=key_id.xor_distance)[:node.num_replicas]
    return cached if list(cached) == nearest else {n: merged[n] for n in nearest}


def beside(key_id: DHTID) -> DHTID:
    """The id that differs from `key_id` in its last bit only: its nearest nodes are `key_id`'s (XOR distances to
    the two differ by one in the last bit, so they order nodes alike unless two nodes' distances differ in that
    bit alone), and no record is stored under it."""
    return DHTID(key_id ^ 1)


def one_in_turn(nearest: dict, turn: int | None) -> dict:
    """The nodes of `nearest` (a key's nearest nodes, nearest first) that a store in `turn` goes to: all of them for
    None, else the `turn`-th in rotation (counting from the nearest)."""
    if turn is None or not nearest:
        return nearest
    node_id = list(nearest)[turn % len(nearest)]
    return {node_id: nearest[node_id]}


async def _store_near(dht: hivemind.DHT, node, key: str, subkey: str, value: dict, expiration: float,
                      turn: int | None = None) -> bool:
    key_id = DHTID.generate(source=key)
    nearest = one_in_turn(await _nearest(node, key_id), turn)
    protocol = node.protocol
    record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), protocol.serializer.dumps(value),
                       expiration)
    if protocol.record_validator is not None:
        record = dataclasses.replace(record, value=protocol.record_validator.sign_value(record))

    async def one(node_id: DHTID, peer_id) -> bool | None:
        if node_id == node.node_id:  # this node is among the nearest: its own storage, checked as a peer's store is
            if protocol.record_validator is not None and not protocol.record_validator.validate(record):
                return False
            return protocol.storage.store(key_id, record.value, expiration, subkey=subkey)
        stored = await protocol.call_store(peer_id, keys=[key_id], values=[record.value], expiration_time=[expiration],
                                           subkeys=[subkey])
        return None if stored is None else bool(stored[0])

    results = await asyncio.gather(*(one(n, p) for n, p in nearest.items()))
    if any(r is None for r in results):  # a node did not answer (it left?): look the key up again next time
        _NEAREST.pop(key_id, None)
    return any(results)


async def store_near(dht: hivemind.DHT, key: str, subkey: str, value: dict, expiration: float,
                     turn: int | None = None) -> bool:
    """Store `value` under (key, subkey) until `expiration` (DHT time) on the key's nearest nodes; whether any
    of them took it (a node refuses a record that expires before the one it holds).

    Args:
        turn: None: on every one of the nearest nodes. An int: on one of them only, the `turn`-th in rotation, for
            a record re-stored every few seconds that lives long enough to be refreshed on each node in turn
            (`app/heartbeat.Heartbeat`): a reader's walk (`swarm.read_subkeys`) merges the copies of every
            node it visits and keeps the one that expires last, the newest."""
    return await dht.run_coroutine(_Store(key, subkey, value, expiration, turn), return_future=True)


@dataclasses.dataclass(frozen=True)
class _Store:
    """`_store_near`'s arguments, picklable, for `DHT.run_coroutine` (which passes only the DHT and the node)."""

    key: str
    subkey: str
    value: dict
    expiration: float
    turn: int | None = None

    async def __call__(self, dht: hivemind.DHT, node) -> bool:
        return await _store_near(dht, node, self.key, self.subkey, self.value, self.expiration, self.turn)


async def _read_near(node, keys: list[str]) -> dict[str, dict[str, tuple[object, float]]]:
    key_ids = {DHTID.generate(source=key): key for key in keys}
    nearest = {k: list(v.items()) for k, v in (await _nearest_many(node, list(key_ids))).items()}
    protocol = node.protocol
    found = {k: _SearchState(k, float("inf"), serializer=protocol.serializer, record_validator=protocol.record_validator)
             for k in key_ids}
    pending = set(key_ids)
    for turn in range(max(map(len, nearest.values()), default=0)):  # the nearest first, the next where it is silent
        asked: dict[tuple, list[DHTID]] = {}  # one request a node, for every key it is asked for
        for key_id in pending:
            if turn < len(nearest[key_id]):
                asked.setdefault(nearest[key_id][turn], []).append(key_id)

        async def ask(node_id: DHTID, peer_id, ids: list[DHTID]) -> None:
            if node_id == node.node_id:
                answer = {k: (protocol.storage.get(k), None) for k in ids}
            else:  # records checked by the validators on arrival
                answer = await protocol.call_find(peer_id, ids)
            if answer is None:  # it did not answer (it left?): look the keys up again next time, ask the next
                for k in ids:
                    _NEAREST.pop(k, None)
                return
            for k in ids:
                found[k].add_candidate(answer[k][0], source_node_id=node_id)
                pending.discard(k)

        await asyncio.gather(*(ask(n, p, ids) for (n, p), ids in asked.items()))
    out = {}
    for key_id, state in found.items():
        state.finish_search()
        result = state.future.result()
        out[key_ids[key_id]] = {} if result is None or not isinstance(result.value, dict) else {
            k: (v.value, v.expiration_time) for k, v in result.value.items()}
    return out


async def read_near_many(dht: hivemind.DHT, keys: list[str]) -> dict[str, dict[str, tuple[object, float]]]:
    """Every record under each of `keys` as {key: {subkey: (value, expiration)}}, read from the first of the key's
    nearest nodes that answers (this node's own storage when it is that node), not from every node of a walk: one
    copy of the key's records where a walk (`DHT.get`) merges the whole value from each of the ~3 nodes holding it.
    The keys' nearest nodes not known yet are looked up by one walk, and each node is asked once, for all its keys.

    What that one node holds may be less than what a walk finds (a writer whose routing table was still filling
    stored on other nodes), so a reader must check the answer before trusting it (`census.Census.members`)."""
    return await dht.run_coroutine(_Read(tuple(keys)), return_future=True)


@dataclasses.dataclass(frozen=True)
class _Read:
    """`_read_near`'s argument, picklable, for `DHT.run_coroutine`."""

    keys: tuple[str, ...]

    async def __call__(self, dht: hivemind.DHT, node) -> dict:
        return await _read_near(node, list(self.keys))
