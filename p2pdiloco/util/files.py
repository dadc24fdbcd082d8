"""Writing a file so that a reader, or a process killed mid-write, never leaves or sees half of it."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path


def temp_beside(path: Path) -> Path:
    """A temporary name in `path`'s folder (a rename is atomic only within one file system), hidden, and this
    process's own: processes of one machine writing the same file (peers caching one corpus) never share one."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def sync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable (the folder's entry itself is flushed to disk)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(path: Path, tmp: Path | None = None, durable: bool = False) -> Iterator[Path]:
    """Write to the yielded temporary path; when the block ends without an error, the file is flushed to disk and
    renamed onto `path` all at once. On an error the temporary file is removed and the error goes on.

    Args:
        path: the file to write.
        tmp: the temporary path (default `temp_beside(path)`).
        durable: also flush the folder, so that the rename survives a power cut (checkpoints).
    """
    tmp = tmp or temp_beside(path)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        sync_folder(path.parent)


def write_atomic(path: Path, data: bytes | str, durable: bool = False) -> None:
    """Write `data` (str as UTF-8) to `path` through `replacing`."""
    with replacing(path, durable=durable) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


def write_json_atomic(path: Path, obj: object) -> None:
    """Write `obj` as indented JSON to `path` through `replacing`."""
    write_atomic(path, json.dumps(obj, indent=2))
