"""Owner-bound peer records: only the peer a subkey names can write its records (docs/security.md, "Forged peer
records").

The unit tests sign and check records with `PeerRecordValidator` alone; the integration tests run real hivemind
DHTs on loopback, with an attacker node that overwrites a victim's heartbeat by a 'left, finished' record."""

from __future__ import annotations

import collections
import dataclasses
import functools
import random
import stat

import hivemind
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import P2P, PeerID
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from p2pdiloco.config import SwarmConfig
from p2pdiloco.network import identity as identity_module
from p2pdiloco.network.identity import (
    IdentityError,
    PeerIdentity,
    PeerRecordValidator,
    load_or_create_identity,
    record_message,
)
from p2pdiloco.network.swarm import SwarmError, peers_key, read_subkeys, start_dht, write_subkey
from p2pdiloco.network.swarm_key import KeyedRecordValidator, load_key, write_new_key
from p2pdiloco.network.traffic import MAX_KEYS, OTHER_KEYS, Traffic, count_key, dht_bytes_by_kind
from p2pdiloco.observe.status import read_status
from tests.conftest import wait_for

FORGED = {"left": True, "finished": True, "step": 10**9}
"""What the attacker writes over each victim's heartbeat: 'this peer finished the run and left'."""


def _record(subkey, value: dict, expiration: float = 1000.0) -> DHTRecord:
    return DHTRecord(b"key-id", MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), expiration)


def _signed(validator, record: DHTRecord) -> DHTRecord:
    return dataclasses.replace(record, value=validator.sign_value(record))


@pytest.fixture(scope="module")
def rsa_identity(tmp_path_factory) -> PeerIdentity:
    path = tmp_path_factory.mktemp("rsa") / "rsa.key"
    P2P.generate_identity(str(path))  # how hivemind (and older bootstrap nodes) make identities: RSA, ids Qm...
    identity = load_or_create_identity(path)
    assert identity.peer_id == PeerID.from_identity(path.read_bytes()).to_base58()
    return identity


@pytest.mark.parametrize("kind", ["ed25519", "rsa"])
def test_own_record_round_trips_and_every_tampering_is_refused(kind, rsa_identity):
    me = PeerIdentity.generate() if kind == "ed25519" else rsa_identity
    other = PeerIdentity.generate()
    validator = PeerRecordValidator(me)
    record = _record(me.peer_id, {"step": 3})
    signed = _signed(validator, record)
    assert validator.validate(signed) and validator.strip_value(signed) == record.value
    assert PeerRecordValidator(other).validate(signed)  # any node can check it, not just its writer

    value = MSGPackSerializer.dumps({"step": 4})
    tampered_value = dataclasses.replace(signed, value=value + signed.value[len(record.value):])
    tampered_expiration = dataclasses.replace(signed, expiration_time=signed.expiration_time + 3600)
    other_subkey = dataclasses.replace(signed, subkey=MSGPackSerializer.dumps(other.peer_id))
    other_key = dataclasses.replace(signed, key=b"other-key-id")
    for bad in (tampered_value, tampered_expiration, other_subkey, other_key):
        assert not validator.validate(bad)


@pytest.mark.parametrize("kind", ["ed25519", "rsa"])
def test_a_signed_record_over_the_size_cap_is_refused_and_one_under_it_kept(kind, rsa_identity):
    from p2pdiloco.network.identity import MAX_RECORD_BYTES

    me = PeerIdentity.generate() if kind == "ed25519" else rsa_identity
    validator = PeerRecordValidator(me)
    def padded(size: int):  # a signed record of `size` bytes (msgpack's header of a long string is 3 bytes)
        return _signed(validator, _record(me.peer_id, {"pad": "x" * (size - len(_signed(validator, _record(
            me.peer_id, {"pad": ""})).value) - 2)}))

    at_cap, over = padded(MAX_RECORD_BYTES), padded(MAX_RECORD_BYTES + 1)
    assert len(at_cap.value) == MAX_RECORD_BYTES and len(over.value) == MAX_RECORD_BYTES + 1
    assert validator.validate(at_cap) and not validator.validate(over)  # its owner's signature does not save it
    assert not PeerRecordValidator(PeerIdentity.generate()).validate(over)


def test_the_signature_cache_keeps_digests_of_a_bounded_number_of_records(monkeypatch):
    monkeypatch.setattr(identity_module, "_verified_cache", collections.OrderedDict())
    monkeypatch.setattr(identity_module, "VERIFIED_CACHE", 8)
    me = PeerIdentity.generate()
    validator = PeerRecordValidator(me)
    signed = [_signed(validator, _record(me.peer_id, {"pad": "x" * 1000}, 1000.0 + i)) for i in range(20)]
    forged = dataclasses.replace(signed[0], value=MSGPackSerializer.dumps(FORGED) + signed[0].value[-80:])
    for _ in range(2):  # the second time from the cache, where it still holds them
        assert all(validator.validate(r) for r in signed[-8:]) and not validator.validate(forged)
    assert all(validator.validate(r) for r in signed)
    cache = identity_module._verified_cache
    assert len(cache) == 8 and all(isinstance(k, bytes) and len(k) == 32 for k in cache)
    assert not validator.validate(forged)  # evicted and checked again: still refused


def test_a_record_under_someone_elses_id_is_refused(rsa_identity):
    victim, attacker = PeerIdentity.generate(), PeerIdentity.generate()
    honest = PeerRecordValidator(victim)
    forged = _record(victim.peer_id, FORGED, expiration=10**10)
    assert PeerRecordValidator(attacker).sign_value(forged) == forged.value  # an honest node never signs for others
    assert not honest.validate(forged)  # unsigned
    # signed by the attacker's key, in the layout the victim's would have (an Ed25519 id carries its own key)
    sig = attacker.sign(record_message(forged.key, forged.subkey, forged.expiration_time, forged.value))
    assert not honest.validate(dataclasses.replace(forged, value=forged.value + sig + b"\x00\x00\x00\x40"))
    # an RSA victim: the attacker's RSA key carried in the record does not hash to the victim's id
    other_rsa = PeerIdentity(rsa.generate_private_key(public_exponent=65537, key_size=2048))
    rsa_forged = _record(rsa_identity.peer_id, FORGED)
    carried = other_rsa.public_protobuf
    sig = other_rsa.sign(record_message(rsa_forged.key, rsa_forged.subkey, rsa_forged.expiration_time, rsa_forged.value))
    layout = carried + sig + len(carried).to_bytes(2, "big") + len(sig).to_bytes(2, "big")
    assert not honest.validate(dataclasses.replace(rsa_forged, value=rsa_forged.value + layout))
    # a made-up peer: a string subkey that is no peer id, signed or not
    assert not honest.validate(_signed(PeerRecordValidator(attacker), _record("somepeer", FORGED)))
    # junk trailers are refused, never raised
    for junk in (b"", b"\x01", b"\xff\xff\xff\xff", forged.value + b"\x00\x00\xff\xff"):
        assert not honest.validate(dataclasses.replace(forged, value=junk))


def test_records_without_a_peer_subkey_pass_untouched():
    validator = PeerRecordValidator(PeerIdentity.generate())
    for subkey in (None, b"raw-bytes", 7):
        record = _record(subkey, {"x": 1})
        assert validator.sign_value(record) == record.value
        assert validator.validate(record) and validator.strip_value(record) == record.value


def test_chains_with_the_swarm_key_both_must_hold():
    key, me = b"k" * 32, PeerIdentity.generate()
    honest = CompositeValidator([KeyedRecordValidator(key), PeerRecordValidator(me)])
    record = _record(me.peer_id, {"step": 1})
    signed = _signed(honest, record)
    assert honest.validate(signed) and honest.strip_value(signed) == record.value
    # a key holder (the insider of a private swarm) cannot write under another peer's id
    insider = CompositeValidator([KeyedRecordValidator(key), PeerRecordValidator(PeerIdentity.generate())])
    assert not honest.validate(_signed(insider, _record(me.peer_id, FORGED, 10**10)))
    # and the peer's own signature is no use without the key
    assert not honest.validate(_signed(PeerRecordValidator(me), record))


def test_identity_file_is_private_and_reused(tmp_path):
    path = tmp_path / "peer.key"
    first = load_or_create_identity(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_identity(path).peer_id == first.peer_id  # that p2pd agrees: the restart test below
    (tmp_path / "junk.key").write_bytes(b"not a key")
    with pytest.raises(IdentityError, match="is not a libp2p identity"):
        load_or_create_identity(tmp_path / "junk.key")
    with pytest.raises(SwarmError, match="is not a libp2p identity"):
        start_dht(SwarmConfig(host="127.0.0.1"), identity_path=str(tmp_path / "junk.key"))


# ---- real DHTs on loopback --------------------------------------------------------------------------------


@pytest.fixture(params=["public", "private"])
def swarm(request, tmp_path):
    """A bootstrap node (identity file, as `p2pdiloco bootstrap` runs it), a victim peer, an honest reader, and an
    attacker: a plain hivemind node with its own identity (and, in the private swarm, the swarm key), so it signs
    nothing for anyone and stores what it likes."""
    key = str(write_new_key(tmp_path / "swarm.key")) if request.param == "private" else ""
    cfg = SwarmConfig(run_id="rec", host="127.0.0.1", swarm_key=key)
    started = [start_dht(cfg, identity_path=str(tmp_path / "boot.key"))]
    try:
        joined = SwarmConfig(**{**cfg.__dict__, "initial_peers": [str(m) for m in started[0].get_visible_maddrs()]})
        started += [start_dht(joined), start_dht(joined)]
        attacker = hivemind.DHT(start=True, initial_peers=joined.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                record_validators=[KeyedRecordValidator(load_key(key))] if key else [],
                                startup_timeout=15)
        started.append(attacker)
        yield {"boot": started[0], "victim": started[1], "reader": started[2], "attacker": attacker,
               "joined": joined, "tmp": tmp_path}
    finally:
        for d in started:
            d.shutdown()


def _seen(net_loop, dht, peer_id: str, want: dict, timeout: float = 20) -> dict:
    return wait_for(lambda: (r := net_loop.run(read_subkeys(dht, peers_key("rec")), 10)).get(peer_id) == want and r,
                    timeout=timeout, what=f"{want} under {peer_id[-6:]}")


@pytest.mark.integration
def test_forged_left_record_is_refused_and_the_victims_own_stays(swarm, net_loop):
    victim, attacker = swarm["victim"], swarm["attacker"]
    victim_id = victim.peer_id.to_base58()
    own = {"step": 5, "loss": 2.0}
    assert net_loop.run(write_subkey(victim, peers_key("rec"), victim_id, own, get_dht_time() + 60), 10)
    _seen(net_loop, swarm["reader"], victim_id, own)

    # the attack: the victim's subkey, a later expiration, 'left, finished at step 10^9'; every honest node refuses
    assert net_loop.run(_store_elsewhere(attacker, victim_id, FORGED, get_dht_time() + 3600), 15) is False
    # the attacker keeps it in its own storage and serves it: honest readers drop that answer, never return it
    net_loop.run(_store_elsewhere(attacker, victim_id, FORGED, get_dht_time() + 3600, exclude_self=False), 15)
    # readers on honest nodes (a peer, the bootstrap node, `status`'s DHT client) see the victim's own record
    for dht in (swarm["reader"], swarm["boot"], victim):
        records = net_loop.run(read_subkeys(dht, peers_key("rec")), 10)
        assert records.get(victim_id) == own, records
    status_dht = start_dht(swarm["joined"], client_mode=True)
    try:
        status = read_status(net_loop, status_dht, "rec", wait_s=10)
        assert [p["peer_id"] for p in status["peers"]] == [victim_id] and status["peers"][0]["step"] == 5
    finally:
        status_dht.shutdown()
    # the attacker can still write under its own id (that is a fake peer, not a forged one: another issue)
    attacker_id = attacker.peer_id.to_base58()
    unsigned = _store_elsewhere(attacker, attacker_id, {"step": 1}, get_dht_time() + 60)
    assert net_loop.run(unsigned, 15) is False  # unsigned: a plain hivemind node cannot write at all


async def _store_elsewhere(dht: hivemind.DHT, subkey: str, value: dict, expiration: float,
                           exclude_self: bool = True) -> bool:
    """Store on the other nodes only (not in `dht`'s own storage), so the result is their verdict."""
    return await dht.store(peers_key("rec"), value, expiration, subkey=subkey, exclude_self=exclude_self,
                           return_future=True)


@pytest.mark.integration
def test_own_records_round_trip_across_a_restart_with_the_same_identity(swarm, net_loop):
    path = str(swarm["tmp"] / "peer.key")
    expiration = get_dht_time() + 60
    for step in (1, 2):
        peer = start_dht(swarm["joined"], identity_path=path)
        try:
            peer_id = peer.peer_id.to_base58()
            assert peer_id == load_or_create_identity(path).peer_id
            expiration += 1  # a restarted peer's record must expire after its previous one (write_subkey)
            assert net_loop.run(write_subkey(peer, peers_key("rec"), peer_id, {"step": step}, expiration), 10)
            _seen(net_loop, swarm["reader"], peer_id, {"step": step})
        finally:
            peer.shutdown()


@pytest.mark.integration
def test_heartbeats_go_straight_to_the_nearest_nodes_and_stay_readable(swarm, net_loop):
    """`store_near`: the first store of a key walks the DHT, the next ones send the signed record
    straight to the nodes that walk found; readers on other nodes see every one, and an older record is refused."""
    from p2pdiloco.network.traffic import Traffic

    victim = swarm["victim"]
    victim_id = victim.peer_id.to_base58()
    counts = Traffic()

    def made(rpc: str) -> int:
        net_loop.run(counts.refresh_dht(victim), 10)
        return counts.dht_by_rpc.get(rpc, [0, 0, 0])[0]

    expiration = get_dht_time() + 60
    assert net_loop.run(write_subkey(victim, peers_key("rec"), victim_id, {"step": 0}, expiration), 10)
    finds, stores = made("find"), made("store")
    assert finds >= 1  # the walk
    for step in range(1, 6):
        expiration += 1
        assert net_loop.run(write_subkey(victim, peers_key("rec"), victim_id, {"step": step}, expiration), 10)
        _seen(net_loop, swarm["reader"], victim_id, {"step": step})
    assert made("find") == finds  # no walk for the five beats after the first
    assert made("store") > stores  # each went to the other nearest nodes by rpc_store alone
    # those finds and stores are told apart as the peer records' (traffic.dht_bytes_by_kind); the rest are
    # hivemind's routing-table refreshes
    kinds = dht_bytes_by_kind(counts.dht_by_key, "rec")
    assert kinds["peer records"] > sum(counts.dht_by_key.values()) / 2 and kinds["census"] == kinds["config"] == 0
    # a record expiring before the one the nodes hold is refused by all of them, and the newer one stays
    assert net_loop.run(write_subkey(victim, peers_key("rec"), victim_id, {"step": -1}, expiration - 10), 10) is False
    for dht in (swarm["reader"], swarm["boot"]):
        assert net_loop.run(read_subkeys(dht, peers_key("rec")), 10)[victim_id] == {"step": 5}


@pytest.mark.integration
def test_the_walk_before_a_first_store_does_not_download_the_keys_records(swarm, net_loop):
    """The walk that finds a key's nearest nodes asks for an id beside the key (`beside`), so the nodes on the way
    answer with contacts only: with hivemind's walk for the key itself, each node holding it sent every record
    under it (so a census registration would download the whole census)."""
    from p2pdiloco.network.traffic import Traffic

    reader, victim = swarm["reader"], swarm["victim"]
    key, blob = "rec_walk", "x" * 3_500  # under MAX_RECORD_BYTES, over what the walk may move
    assert net_loop.run(write_subkey(reader, key, reader.peer_id.to_base58(), {"blob": blob}, get_dht_time() + 60), 10)
    wait_for(lambda: len(net_loop.run(read_subkeys(swarm["boot"], key), 10)) == 1, 20, what="the large record")
    counts = Traffic()

    def find_bytes() -> int:
        net_loop.run(counts.refresh_dht(victim), 10)
        return counts.dht_by_rpc.get("find", [0, 0, 0])[2]

    before = find_bytes()
    victim_id = victim.peer_id.to_base58()
    assert net_loop.run(write_subkey(victim, key, victim_id, {"step": 1}, get_dht_time() + 60), 10)
    walked = find_bytes() - before
    assert 0 < walked < 3_000  # the walk happened, and moved no copy of the 3.5 kB record
    got = net_loop.run(read_subkeys(swarm["boot"], key), 10)  # stored where readers look
    assert got[victim_id] == {"step": 1} and got[reader.peer_id.to_base58()] == {"blob": blob}


def test_dht_bytes_are_told_apart_by_the_key_they_were_for():
    from hivemind.dht.routing import DHTID

    from p2pdiloco.network.census import census_key
    from p2pdiloco.network.swarm import config_key

    def hex_id(key: str) -> str:
        return DHTID.generate(source=key).to_bytes().hex()

    from p2pdiloco.network.dht_store import beside

    by_key = {hex_id(peers_key("run", 0)): 100, hex_id(peers_key("run", 3)): 20, hex_id(census_key("run")): 7,
              hex_id(census_key("other run")): 3, hex_id(config_key("run")): 50, hex_id(peers_key("other run", 0)): 1,
              beside(DHTID.generate(source=census_key("run"))).to_bytes().hex(): 2}  # a walk before a store
    assert dht_bytes_by_kind(by_key, "run") == {"peer records": 120, "census": 9, "config": 50, "other": 4}


@pytest.mark.integration
def test_a_read_from_the_nearest_node_sees_every_record_and_moves_one_copy(swarm, net_loop):
    """`read_near_subkeys` (an epoch's first census read): every node reads every writer's record, from one node."""
    from p2pdiloco.network.swarm import read_near_subkeys
    from p2pdiloco.network.traffic import Traffic

    key, blob = "rec_near", "y" * 2_000
    writers = [swarm["boot"], swarm["victim"], swarm["reader"]]
    for i, dht in enumerate(writers):
        record = {"i": i, "blob": blob}
        assert net_loop.run(write_subkey(dht, key, dht.peer_id.to_base58(), record, get_dht_time() + 60), 10)
    want = {dht.peer_id.to_base58(): {"i": i, "blob": blob} for i, dht in enumerate(writers)}
    for dht in writers:
        counts = Traffic()
        net_loop.run(read_near_subkeys(dht, key), 10)  # a first read may walk (contacts only) to find the nearest
        net_loop.run(counts.refresh_dht(dht), 10)
        before = counts.dht_by_rpc.get("find", [0, 0, 0])
        assert net_loop.run(read_near_subkeys(dht, key), 10) == want
        net_loop.run(counts.refresh_dht(dht), 10)
        after = counts.dht_by_rpc.get("find", [0, 0, 0])
        assert after[0] - before[0] <= 1  # one node asked (none when this node is the nearest)
        assert after[2] - before[2] < 1.5 * len(want) * len(blob)  # at most one copy of the records


def test_the_id_beside_a_key_has_the_keys_nearest_nodes():
    from hivemind.dht.routing import DHTID

    from p2pdiloco.network.dht_store import beside

    rng = random.Random(0)
    for _ in range(200):
        key = DHTID.generate(source=str(rng.random()))
        nodes = [DHTID.generate(source=str(rng.random())) for _ in range(64)]
        assert beside(key) != key and beside(beside(key)) == key
        assert sorted(nodes, key=key.xor_distance)[:8] == sorted(nodes, key=beside(key).xor_distance)[:8]


@pytest.mark.integration
def test_a_peer_restarted_under_its_id_registers_again_for_an_epoch_it_had_registered_for(swarm, net_loop):
    """The census refused the second registration of (epoch, peer id) when it expired with the first: a peer
    restarted under its id (`--resume`) then waited out two epochs unmatched."""
    from p2pdiloco.network.census import EPOCH_S, Census, epoch_of, registration_expiry

    epoch = epoch_of(get_dht_time())
    assert registration_expiry(epoch, epoch * EPOCH_S + 1) < registration_expiry(epoch, epoch * EPOCH_S + 2)
    path = str(swarm["tmp"] / "peer.key")
    for _ in range(2):
        peer = start_dht(swarm["joined"], identity_path=path)
        try:
            census = Census(peer, "rec", peer.peer_id.to_base58())
            net_loop.run(census.register(epoch), 15)
            assert set(census._registered) == {epoch, epoch + 1}  # both stores taken, the second time too
        finally:
            peer.shutdown()


async def _node_id(dht, node) -> int:
    return int(node.node_id)


@pytest.mark.integration
def test_a_read_sends_no_copy_of_what_it_found_back_into_the_dht(swarm, net_loop):
    """hivemind's defaults have a reader keep what it found (`cache_locally`, which also re-reads it in the
    background before it expires) and push it to a node near the key (`cache_nearest`): at 32 peers that push of
    the whole census after a read was ~0.4 kB/s a peer of DHT stores (docs/benchmarks.md, DHT). Records are
    stored on their key's nearest nodes and read from there, so neither copy serves anyone."""
    from hivemind.dht.routing import DHTID

    from p2pdiloco.network.traffic import Traffic

    reader, victim, boot = swarm["reader"], swarm["victim"], swarm["boot"]
    nodes = [boot, victim, reader, swarm["attacker"]]
    ids = [d.run_coroutine(_node_id) for d in nodes]

    def farthest(key: str) -> int:
        return max(range(4), key=lambda i: ids[i] ^ int(DHTID.generate(source=key)))

    # a key whose 3 nearest nodes are the other three: the victim holds none of it and reads it from them
    key = next(k for k in (f"rec_cache_{i}" for i in range(200)) if farthest(k) == 1)
    blob = "x" * 3_500  # under MAX_RECORD_BYTES
    now = get_dht_time()
    assert net_loop.run(write_subkey(reader, key, reader.peer_id.to_base58(), {"blob": blob}, now + 120), 10)
    wait_for(lambda: len(net_loop.run(read_subkeys(boot, key), 10)) == 1, 20, what="the large record")
    counts = Traffic()

    def store_bytes() -> int:
        net_loop.run(counts.refresh_dht(victim), 10)
        return counts.dht_by_rpc.get("store", [0, 0, 0])[2]

    before = store_bytes()
    assert set(net_loop.run(read_subkeys(victim, key), 10)) == {reader.peer_id.to_base58()}
    assert store_bytes() - before < 1_000  # no copy of the 3.5 kB record went anywhere
    boot_id = boot.peer_id.to_base58()
    assert net_loop.run(write_subkey(boot, key, boot_id, {"step": 1}, now + 60), 10)
    got = wait_for(lambda: (r := net_loop.run(read_subkeys(victim, key), 10)).get(boot_id) and r, 10,
                   what="a record added since, read again by the same node")
    assert got[boot_id] == {"step": 1} and store_bytes() - before < 1_000


async def _find_many(peer: PeerID, n: int, _dht, node):
    """Run in a DHT process (`DHT.run_coroutine`): one find request to `peer` for `n` random keys."""
    from hivemind.dht.routing import DHTID

    return await node.protocol.call_find(peer, [DHTID.generate() for _ in range(n)])


def test_bytes_by_key_keep_the_busy_keys_and_a_bounded_table_whatever_keys_requests_name():
    by_key: dict[str, int] = {}
    busy = [f"{i:040x}" for i in range(3)]
    total = 0
    for i in range(20 * MAX_KEYS):  # a stranger's random ids (or every joiner's own), between the run's requests
        count_key(by_key, random.randbytes(20).hex(), 10)
        count_key(by_key, busy[i % 3], 100)
        total += 110
    assert len(by_key) <= MAX_KEYS + 1 and sum(by_key.values()) == total
    assert all(by_key[k] > 100 * MAX_KEYS for k in busy) and by_key[OTHER_KEYS] > 0
    assert dht_bytes_by_kind(by_key, "run")["other"] == total  # none of them is the run's


@pytest.mark.integration
@pytest.mark.parametrize("swarm", ["public"], indirect=True)
def test_a_find_for_thousands_of_random_keys_leaves_the_dht_process_s_key_table_bounded(swarm, net_loop):
    """The byte counts by key live in the DHT process for as long as it runs: a stranger who names 2,000 new keys in
    one request must not add 2,000 entries to them."""
    victim, attacker = swarm["victim"], swarm["attacker"]
    assert attacker.run_coroutine(functools.partial(_find_many, victim.peer_id, 2_000)) is not None  # it answered
    counts = Traffic()
    net_loop.run(counts.refresh_dht(victim), 10)
    assert len(counts.dht_by_key) <= MAX_KEYS + 1 and counts.dht_by_key[OTHER_KEYS] > 0


async def _held(dht: hivemind.DHT, node, key: str, subkey: str) -> tuple[dict, float] | None:
    """(value, expiration) of `subkey` under `key` in `node`'s own storage (run in the DHT process), or None."""
    from hivemind.dht.routing import DHTID

    key_id = DHTID.generate(source=key)
    found = node.protocol.storage.get(key_id)
    for sub, item in (found.value.items() if found is not None else ()):
        if sub == subkey:
            record = DHTRecord(key_id.to_bytes(), MSGPackSerializer.dumps(sub), item.value, item.expiration_time)
            return MSGPackSerializer.loads(node.protocol.record_validator.strip_value(record)), item.expiration_time
    return None


@pytest.mark.integration
def test_heartbeats_refresh_one_nearest_node_in_turn_and_readers_see_the_newest(swarm, net_loop):
    """After a first beat to every nearest node, each beat goes to one of them in turn (a third of the store
    bytes), lives long enough to be refreshed there before it expires, and a reader's walk still sees the newest;
    the 'left' record goes to all of them again."""
    from p2pdiloco.app.heartbeat import RECORD_BEATS, Heartbeat
    from p2pdiloco.network.dht_store import DHT_REPLICAS
    from p2pdiloco.network.swarm import peer_shard

    victim, blob = swarm["victim"], "z" * 3_000
    victim_id = victim.peer_id.to_base58()
    step = 0
    beat = Heartbeat(victim, "rec", victim_id, lambda: {"step": step, "blob": blob}, period=5.0)
    key = peers_key("rec", peer_shard(victim_id))
    counts = Traffic()

    def stores() -> tuple[int, int]:
        net_loop.run(counts.refresh_dht(victim), 10)
        made = counts.dht_by_rpc.get("store", [0, 0, 0])
        return made[0], made[2]

    net_loop.run(beat.beat(), 10)
    def held(dht: hivemind.DHT) -> tuple[dict, float] | None:
        return dht.run_coroutine(functools.partial(_held, key=key, subkey=victim_id))

    holders = [d for d in (swarm["boot"], victim, swarm["reader"]) if held(d) is not None]
    assert len(holders) >= 2  # the first beat went to every nearest node (of 4 nodes, the attacker may be one)
    before = stores()
    for step in range(1, 2 * DHT_REPLICAS + 1):
        net_loop.run(beat.beat(), 10)
        got = net_loop.run(read_subkeys(swarm["reader"], key), 10)[victim_id]
        assert got["step"] == step  # the newest, wherever it went
    made, moved = (a - b for a, b in zip(stores(), before, strict=True))
    assert made <= 2 * DHT_REPLICAS  # one store a beat at most (none when this node's turn is its own storage)
    assert moved < 1.2 * 2 * DHT_REPLICAS * len(blob)
    now = get_dht_time()
    for dht in holders:  # every copy was refreshed within the last DHT_REPLICAS beats, and outlives the next turn
        _, expiration = held(dht)
        assert expiration > now + (RECORD_BEATS - DHT_REPLICAS) * beat.period
    net_loop.run(beat.leave(), 10)
    for dht in holders:
        assert held(dht)[0].get("left") is True


@pytest.mark.integration
def test_a_near_read_of_every_shard_finds_every_record_in_one_copy(swarm, net_loop):
    """`read_peers(near=True)`, a starting peer's first look: the shards' nearest nodes by one walk, then one copy of
    each shard, one request a node; it finds what the walks of every shard find."""
    from p2pdiloco.network.swarm import PEER_SHARDS, peer_shard, read_peers

    blob = "w" * 1_000
    writers = [swarm["boot"], swarm["victim"], swarm["reader"]]
    for i, dht in enumerate(writers):
        peer_id = dht.peer_id.to_base58()
        record = {"i": i, "blob": blob}
        assert net_loop.run(write_subkey(dht, peers_key("rec", peer_shard(peer_id)), peer_id, record,
                                         get_dht_time() + 60), 10)
    want = {dht.peer_id.to_base58(): {"i": i, "blob": blob} for i, dht in enumerate(writers)}
    for dht in writers:
        assert net_loop.run(read_peers(dht, "rec"), 10) == want  # the walks
        counts = Traffic()
        net_loop.run(counts.refresh_dht(dht), 10)
        before = counts.dht_by_rpc.get("find", [0, 0, 0])
        assert net_loop.run(read_peers(dht, "rec", near=True), 10) == want
        net_loop.run(counts.refresh_dht(dht), 10)
        after = counts.dht_by_rpc.get("find", [0, 0, 0])
        assert after[2] - before[2] < 1.5 * len(want) * len(blob) + PEER_SHARDS * 1_500  # one copy, and the walk
        before = after
        assert net_loop.run(read_peers(dht, "rec", near=True), 10) == want  # the shards' nearest nodes known now
        net_loop.run(counts.refresh_dht(dht), 10)
        after = counts.dht_by_rpc.get("find", [0, 0, 0])
        assert after[0] - before[0] <= len(writers) + 1  # one request a node at most (of 4 nodes)
        assert after[2] - before[2] < 1.5 * len(want) * len(blob) + 4 * 1_000


async def _newest_expiration(key: str, _dht, node) -> float | None:
    """When the newest record this node stores under `key` expires (None: it stores none)."""
    from hivemind.dht.routing import DHTID

    found = node.protocol.storage.get(DHTID.generate(source=key))
    return None if found is None else max(item.expiration_time for _, item in found.value.items())


async def _known(_dht, node) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


@pytest.mark.integration
def test_a_store_reaches_nodes_that_joined_after_the_key_s_nearest_were_looked_up(net_loop):
    """The nearest nodes `store_near` remembers for a minute are brought up to date with the routing table: a node
    that looked a key up alone (a swarm's first peer) stores on the nodes that joined since, not on itself only,
    where the others' reads of their nearest node would not find it."""
    cfg = SwarmConfig(run_id="near", host="127.0.0.1")
    started = [start_dht(cfg)]
    try:
        first, key = started[0], "near_key"
        me = first.peer_id.to_base58()  # records are signed: a peer writes under its own id
        assert net_loop.run(write_subkey(first, key, me, {"i": 0}, get_dht_time() + 60), 10)
        joined = SwarmConfig(**{**cfg.__dict__, "initial_peers": [str(m) for m in first.get_visible_maddrs()]})
        started += [start_dht(joined), start_dht(joined)]
        wait_for(lambda: first.run_coroutine(_known) == 2, 20, "the first node to learn of the two that joined")
        # (hivemind's node may hand the records it stores to a node it meets that is nearer to their key)
        newer = get_dht_time() + 90
        assert net_loop.run(write_subkey(first, key, me, {"i": 1}, newer), 10)
        # 3 nodes, 3 replicas: every node is among the key's nearest
        assert [dht.run_coroutine(functools.partial(_newest_expiration, key)) for dht in started] == [newer] * 3
    finally:
        for dht in started:
            dht.shutdown()
