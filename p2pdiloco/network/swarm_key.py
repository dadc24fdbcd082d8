"""Private swarms: a shared secret key that every merge, state transfer and DHT record must prove.

hivemind 1.1.12's p2pd has no libp2p private-network (PSK) option, and a PSK would not cover its QUIC
transport anyway, so the door is closed at the application layer (docs/security.md):

- every request on p2pdiloco's streams (invite, group, part, state) carries an HMAC-SHA256 over
  (run id, operation, sender id, receiver id) under the key, and every reply one over the same with the
  roles swapped. libp2p already authenticates peer ids and encrypts streams (Noise/TLS), so binding the
  tag to both ids makes it useless to anyone but its sender, towards anyone but its receiver;
- every DHT record is signed with an HMAC over (key, subkey, value, expiration) by `KeyedRecordValidator`;
  nodes with the key refuse to store, and refuse to return to the application, records without a valid tag.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import struct
from pathlib import Path

from hivemind.dht.validation import DHTRecord, RecordValidatorBase

KEY_BYTES = 32
TAG_BYTES = 32


class SwarmKeyError(ValueError):
    """A missing or malformed swarm key file."""


def write_new_key(path: str | Path) -> Path:
    """Write a fresh random key (hex) to `path`, readable by its owner only; never overwrite a key."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.parent.is_dir():  # mkdir accepts an existing file as the parent
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.exists():
            raise SwarmKeyError(f"{path} exists; refusing to overwrite a swarm key") from None
        raise SwarmKeyError(f"cannot write a swarm key to {path}: a parent is a file") from None
    except OSError as e:  # a parent that is a file or cannot be made, a read-only folder, a full disk
        raise SwarmKeyError(f"cannot write a swarm key to {path}: {e.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(KEY_BYTES) + "\n")
    return path


def load_key(path: str | Path) -> bytes:
    """Read a key written by `write_new_key`."""
    try:
        text = Path(path).read_text().strip()
    except OSError as e:
        raise SwarmKeyError(f"cannot read swarm key {path}: {e.strerror}") from None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise SwarmKeyError(f"{path} is not a swarm key ({2 * KEY_BYTES} hex digits; make one with p2pdiloco keygen)")
    return key


class SwarmAuth:
    """Tags and checks requests and replies on p2pdiloco's streams; with no key, everything passes (public swarm).

    Args:
        key: the swarm key, or None for a public swarm.
        run_id: the swarm's name, bound into every tag so one key can serve several runs.
    """

    def __init__(self, key: bytes | None, run_id: str):
        self.key, self.run_id = key, run_id

    @property
    def private(self) -> bool:
        return self.key is not None

    def tag(self, op: str, sender: str, receiver: str) -> str:
        if self.key is None:
            return ""
        msg = "\x00".join(("p2pdiloco-auth-v1", self.run_id, op, sender, receiver)).encode()
        return hmac.new(self.key, msg, hashlib.sha256).hexdigest()

    def verify(self, op: str, sender: str, receiver: str, tag: object) -> bool:
        if self.key is None:
            return True
        return isinstance(tag, str) and hmac.compare_digest(tag, self.tag(op, sender, receiver))


class KeyedRecordValidator(RecordValidatorBase):
    """DHT record validator: values carry an HMAC tag under the swarm key, checked on store and on read.

    Args:
        key: the swarm key.
    """

    def __init__(self, key: bytes):
        self._key = key

    def _mac(self, record: DHTRecord, value: bytes) -> bytes:
        msg = b"".join((len(record.key).to_bytes(4, "big"), record.key, len(record.subkey).to_bytes(4, "big"),
                        record.subkey, struct.pack(">d", record.expiration_time), value))
        return hmac.new(self._key, msg, hashlib.sha256).digest()

    def validate(self, record: DHTRecord) -> bool:
        if len(record.value) < TAG_BYTES:
            return False
        value, tag = record.value[:-TAG_BYTES], record.value[-TAG_BYTES:]
        return hmac.compare_digest(tag, self._mac(record, value))

    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value + self._mac(record, record.value)

    def strip_value(self, record: DHTRecord) -> bytes:
        return record.value[:-TAG_BYTES]

    @property
    def priority(self) -> int:
        return 10  # sign last, check first: nothing else looks at an unauthenticated value

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False
