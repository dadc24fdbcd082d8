"""Peer identities and owner-bound DHT records: a record under subkey = peer id P is valid only if P's key signed it.

A peer's records (heartbeat, ready, 'left', 'finished') live under `{run_id}_peers` and `{run_id}_ready` with
subkey = its peer id. hivemind lets any node write any subkey, and the swarm key (`KeyedRecordValidator`) only
proves that the writer holds the key, not which peer it is, so without this any node could replace another
peer's records (docs/security.md, "Forged peer records"). A libp2p peer id is derived from its identity key:
for Ed25519 (p2pd's default, ids `12D3KooW...`) the id *contains* the public key (identity multihash of the
protobuf-serialized key); for RSA (hivemind's `generate_identity`, ids `Qm...`) it is the sha2-256 multihash of
it. So every node can check, from the subkey alone, that a record was signed by the peer it names.

Record value layout (after the application's msgpack bytes):
    value | public key (protobuf; empty for Ed25519, whose id holds it) | signature | u16 len(key) | u16 len(sig)
"""

from __future__ import annotations

import collections
import functools
import hashlib
import os
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, padding, rsa
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.proto import crypto_pb2
from hivemind.utils.serializer import MSGPackSerializer

DOMAIN = b"p2pdiloco-record-v1"
"""Signed before every record, so that a record signature cannot be replayed as any other libp2p signature."""
IDENTITY_HASH, SHA256_HASH = 0x00, 0x12  # multihash codes libp2p uses for peer ids
MAX_INLINED_KEY = 42
"""libp2p inlines public keys of up to this many bytes (protobuf-serialized) in the peer id."""
TRAILER = struct.Struct(">HH")
MAX_RECORD_BYTES = 4096
"""The largest owner-signed record a node stores or a reader takes, signature included: a peer's records are a few
hundred bytes (a config record with its full fingerprint ~1 kB), and every reader of a key moves all its records, so
a stranger's record is bounded before anyone stores or reads it."""
_REGULAR_SUBKEY = MSGPackSerializer.dumps(None)  # hivemind's subkey of a value stored without one


class IdentityError(ValueError):
    """An identity file that cannot be read or used."""


@dataclass(frozen=True)
class PeerIdentity:
    """A libp2p identity key held by this process.

    Args:
        private_key: an Ed25519 or RSA private key (`cryptography`).
    """

    private_key: ed25519.Ed25519PrivateKey | rsa.RSAPrivateKey

    @classmethod
    def generate(cls) -> PeerIdentity:
        return cls(ed25519.Ed25519PrivateKey.generate())  # ~0.1 ms; an RSA key takes 50-500 ms

    @classmethod
    def from_protobuf(cls, data: bytes) -> PeerIdentity:
        """Parse a libp2p private key file's bytes (what p2pd's `-id` reads)."""
        try:
            pb = crypto_pb2.PrivateKey.FromString(data)
            if pb.key_type == crypto_pb2.Ed25519 and len(pb.data) in (64, 96):  # seed | public (| public: legacy)
                return cls(ed25519.Ed25519PrivateKey.from_private_bytes(pb.data[:32]))
            if pb.key_type == crypto_pb2.RSA:
                key = serialization.load_der_private_key(pb.data, password=None)
                if isinstance(key, rsa.RSAPrivateKey):
                    return cls(key)
        except Exception:
            pass
        raise IdentityError("not a libp2p Ed25519 or RSA private key")

    def to_protobuf(self) -> bytes:
        if isinstance(self.private_key, ed25519.Ed25519PrivateKey):
            seed = self.private_key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                                  serialization.NoEncryption())
            return crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519, data=seed + self._raw_public()).SerializeToString()
        der = self.private_key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL,
                                             serialization.NoEncryption())
        return crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()

    def _raw_public(self) -> bytes:
        if isinstance(self.private_key, ed25519.Ed25519PrivateKey):
            return self.private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return self.private_key.public_key().public_bytes(serialization.Encoding.DER,
                                                          serialization.PublicFormat.SubjectPublicKeyInfo)

    @functools.cached_property
    def public_protobuf(self) -> bytes:
        key_type = crypto_pb2.Ed25519 if isinstance(self.private_key, ed25519.Ed25519PrivateKey) else crypto_pb2.RSA
        return crypto_pb2.PublicKey(key_type=key_type, data=self._raw_public()).SerializeToString()

    @functools.cached_property
    def peer_id(self) -> str:
        """The base58 peer id libp2p derives from this key (as `hivemind.PeerID.to_base58()` prints it)."""
        return peer_id_of(self.public_protobuf)

    def sign(self, message: bytes) -> bytes:
        if isinstance(self.private_key, ed25519.Ed25519PrivateKey):
            return self.private_key.sign(message)
        return self.private_key.sign(message, padding.PKCS1v15(), hashes.SHA256())


def peer_id_of(public_protobuf: bytes) -> str:
    """libp2p's rule: keys of up to 42 bytes are inlined (identity multihash), longer ones hashed with sha2-256."""
    if len(public_protobuf) <= MAX_INLINED_KEY:
        return base58.b58encode(bytes((IDENTITY_HASH, len(public_protobuf))) + public_protobuf).decode()
    return base58.b58encode(bytes((SHA256_HASH, 32)) + hashlib.sha256(public_protobuf).digest()).decode()


def load_or_create_identity(path: str | Path) -> PeerIdentity:
    """The identity in `path`, or a new Ed25519 one written there (mode 0600) if the file does not exist."""
    path = Path(path)
    try:
        return PeerIdentity.from_protobuf(path.read_bytes())
    except FileNotFoundError:
        pass
    except OSError as e:
        raise IdentityError(f"cannot read identity {path}: {e.strerror}") from None
    except IdentityError:
        raise IdentityError(f"{path} is not a libp2p identity (Ed25519 or RSA private key)") from None
    identity = PeerIdentity.generate()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise IdentityError(f"cannot write an identity to {path}: {e.strerror}") from None
    with os.fdopen(fd, "wb") as f:
        f.write(identity.to_protobuf())
    return identity


def write_temporary_identity(identity: PeerIdentity) -> str:
    """Write `identity` to a new private (0600) temporary file for p2pd's `-id`; the caller removes it."""
    fd, path = tempfile.mkstemp(prefix="p2pdiloco-id-", suffix=".key")
    with os.fdopen(fd, "wb") as f:
        f.write(identity.to_protobuf())
    return path


@functools.lru_cache(maxsize=4096)
def _public_key(peer_id: str, carried: bytes) -> ed25519.Ed25519PublicKey | rsa.RSAPublicKey | None:
    """The public key that `peer_id` names: inlined in the id, or `carried` if it hashes to the id; else None."""
    try:
        mh = base58.b58decode(peer_id)
    except ValueError:
        return None
    if len(mh) < 2 or mh[1] != len(mh) - 2:
        return None
    if mh[0] == IDENTITY_HASH and not carried:
        proto = mh[2:]
    elif mh[0] == SHA256_HASH and len(mh) == 34 and hashlib.sha256(carried).digest() == mh[2:]:
        proto = carried
    else:
        return None
    try:
        pb = crypto_pb2.PublicKey.FromString(proto)
        if pb.key_type == crypto_pb2.Ed25519:
            return ed25519.Ed25519PublicKey.from_public_bytes(pb.data)
        if pb.key_type == crypto_pb2.RSA:
            key = serialization.load_der_public_key(pb.data)
            return key if isinstance(key, rsa.RSAPublicKey) else None
    except Exception:
        return None
    return None


def record_message(key: bytes, subkey: bytes, expiration: float, value: bytes) -> bytes:
    """What a record's owner signs: its key id, subkey, expiration and value, each delimited."""
    return b"".join((DOMAIN, len(key).to_bytes(4, "big"), key, len(subkey).to_bytes(4, "big"), subkey,
                     struct.pack(">d", expiration), value))


def split_trailer(value: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(value, carried public key, signature), or None if `value` has no well-formed trailer."""
    if len(value) < TRAILER.size:
        return None
    n_key, n_sig = TRAILER.unpack(value[-TRAILER.size:])
    end = len(value) - TRAILER.size - n_key - n_sig
    if end < 0:
        return None
    return value[:end], value[end:end + n_key], value[end + n_key:end + n_key + n_sig]


VERIFIED_CACHE = 4096
"""Signature checks remembered (`_verified`), the most recently used kept: a reader meets a fresh record at every
heartbeat of every peer, so over an hour of a 5-peer swarm thousands of distinct ones."""
_verified_cache: collections.OrderedDict[bytes, bool] = collections.OrderedDict()
_verified_lock = threading.Lock()


def _verified(owner: str, key: bytes, subkey: bytes, packed_expiration: bytes, signed_value: bytes) -> bool:
    """Whether `owner` signed this record. Cached: hivemind checks a record again in every answer that holds it,
    and matchmaking reads the same records every 0.25 s (a hit costs a few us, a check ~130 us for Ed25519).
    It keeps a 32-byte digest of each record with its verdict, not the record: ~0.2 KB an entry, where keeping
    the records (a heartbeat's signed value is ~1 KB) would hold several MB in every DHT process once full."""
    digest = hashlib.blake2b(digest_size=32)
    for part in (owner.encode(), key, subkey, packed_expiration, signed_value):
        digest.update(len(part).to_bytes(4, "big"))
        digest.update(part)
    seen = digest.digest()
    with _verified_lock:
        verdict = _verified_cache.get(seen)
        if verdict is not None:
            _verified_cache.move_to_end(seen)
            return verdict
    verdict = _check_signature(owner, key, subkey, packed_expiration, signed_value)
    with _verified_lock:
        _verified_cache[seen] = verdict
        while len(_verified_cache) > VERIFIED_CACHE:
            _verified_cache.popitem(last=False)
    return verdict


def _check_signature(owner: str, key: bytes, subkey: bytes, packed_expiration: bytes, signed_value: bytes) -> bool:
    """Whether `owner` signed this record (uncached, see `_verified`)."""
    parts = split_trailer(signed_value)
    if parts is None:
        return False
    value, carried, signature = parts
    public_key = _public_key(owner, carried)
    if public_key is None:
        return False
    message = record_message(key, subkey, struct.unpack(">d", packed_expiration)[0], value)
    try:
        if isinstance(public_key, ed25519.Ed25519PublicKey):
            public_key.verify(signature, message)
        else:
            public_key.verify(signature, message, padding.PKCS1v15(), hashes.SHA256())
    except InvalidSignature:
        return False
    return True


class PeerRecordValidator(RecordValidatorBase):
    """DHT record validator: a record whose subkey is a string must be signed by the peer that string names, and be
    at most `MAX_RECORD_BYTES` long.

    In p2pdiloco every string subkey is a peer id (heartbeats, ready records), on every node (peers, bootstrap,
    `status`), whatever the run id, so all nodes refuse the same records. A string subkey that is not a peer id
    is refused too (a fake peer needs a key of its own). Values without a subkey, or with a non-string one,
    pass untouched. This node signs only records under its own peer id.

    Args:
        identity: this process's libp2p identity (the key p2pd runs with).
    """

    def __init__(self, identity: PeerIdentity):
        self._identity = identity
        # an Ed25519 id carries its public key; an RSA id only its hash, so the record carries the key
        self._carried = b"" if len(identity.public_protobuf) <= MAX_INLINED_KEY else identity.public_protobuf

    @staticmethod
    def _owner(record: DHTRecord) -> str | None:
        """The peer id a record must be signed by, or None if this validator does not guard it."""
        if record.subkey == _REGULAR_SUBKEY:
            return None
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:
            return None
        return subkey if isinstance(subkey, str) else None

    def validate(self, record: DHTRecord) -> bool:
        owner = self._owner(record)
        if owner is None:
            return True
        if len(record.value) > MAX_RECORD_BYTES:
            return False
        # the expiration's bytes, not the float, key the cache: 0.0 == -0.0 but they are signed differently
        return _verified(owner, record.key, record.subkey, struct.pack(">d", record.expiration_time), record.value)

    def sign_value(self, record: DHTRecord) -> bytes:
        if self._owner(record) != self._identity.peer_id:
            return record.value  # not ours to sign: every honest node will refuse it
        signature = self._identity.sign(record_message(record.key, record.subkey, record.expiration_time, record.value))
        return record.value + self._carried + signature + TRAILER.pack(len(self._carried), len(signature))

    def strip_value(self, record: DHTRecord) -> bytes:
        if self._owner(record) is None:
            return record.value
        parts = split_trailer(record.value)
        return record.value if parts is None else parts[0]

    @property
    def priority(self) -> int:
        return 5  # below KeyedRecordValidator (10): signed first, checked after the swarm key's tag is stripped

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False
