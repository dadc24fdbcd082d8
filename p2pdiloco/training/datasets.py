"""Documents of a dataset read with Hugging Face `datasets`: local jsonl / parquet / arrow files or folders, or a
hub dataset on a machine with internet (`data.dataset = "hub:NAME[:SPLIT]"`).

Each document has a key that is the same on every machine holding the same files: the file's path relative to
the folder named (or its name) and the row's index in it, e.g. ``part-000.jsonl#17``. The split between training
and validation hashes that key (`data.is_val_file`), as the split of text files hashes their paths.

`datasets` is the optional `hf` extra: only a run that sets `data.dataset` needs it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from p2pdiloco.config import ConfigError
from p2pdiloco.training.data import list_candidates

LOG = logging.getLogger(__name__)

HUB = "hub:"
"""Prefix of a `data.dataset` that names a dataset on the Hugging Face hub."""
BUILDERS = {".jsonl": "json", ".json": "json", ".jsonl.gz": "json", ".json.gz": "json", ".parquet": "parquet",
            ".arrow": "arrow"}
"""File name endings `data.dataset` reads, and the `datasets` builder of each."""


@dataclass(frozen=True)
class DatasetFile:
    """One file of a local dataset."""

    rel_path: str
    """Its path relative to the folder named in `data.dataset` (or its name): the first part of its documents' keys."""
    path: Path
    """Where to read it on this machine."""
    builder: str
    """The `datasets` builder that reads it: json, parquet or arrow."""


def require_datasets() -> None:
    """ConfigError, in one line, unless Hugging Face `datasets` is installed."""
    if importlib.util.find_spec("datasets") is None:
        raise ConfigError("data.dataset needs Hugging Face datasets: pip install p2pdiloco[hf]")


def _builder(name: str) -> str | None:
    return next((b for end, b in BUILDERS.items() if name.endswith(end)), None)


def _holds_documents(path: Path, text_field: str) -> bool:
    """Whether a .json file found in a folder holds documents: JSON Lines whose first row has the text field."""
    try:
        with path.open("rb") as f:
            first = json.loads(f.readline(1 << 20))
        return isinstance(first, dict) and text_field in first
    except (OSError, ValueError):
        return False


def split_spec(spec: str) -> list[str]:
    """`data.dataset`'s comma-separated parts."""
    return [part.strip() for part in spec.split(",") if part.strip()]


def dataset_files(spec: str, text_field: str) -> list[DatasetFile]:
    """The files a local `data.dataset` names: files as given, folders walked (hidden entries skipped) and sorted,
    keeping those whose names end in a known format (`BUILDERS`); of a folder's .json files, only those that hold
    documents (JSON Lines with `text_field`), since a folder of documents often holds other JSON too (the
    tokenizer.json trained on it, a config).

    Raises:
        ConfigError: a path does not exist, a file named directly has an unknown format, or no file was found.
    """
    if not split_spec(spec):
        raise ConfigError(f"data.dataset {spec!r} names no file or folder")
    candidates, source = list_candidates(split_spec(spec))
    found = []
    for cand in candidates:
        builder = _builder(cand.path.name)
        if builder is None:
            if cand.explicit:
                raise ConfigError(f"data.dataset file {cand.path}: unknown format (known: {', '.join(BUILDERS)})")
            continue
        if not cand.explicit and cand.path.name.endswith(".json") and not _holds_documents(cand.path, text_field):
            LOG.debug("data.dataset: skipping %s (not JSON Lines with a %r field)", cand.path, text_field)
            continue
        found.append(DatasetFile(cand.rel_path, cand.path, builder))
    if not found:
        raise ConfigError(f"no dataset files ({', '.join(BUILDERS)}) found in {source}")
    return found


def source_stamp(spec: str, text_field: str) -> list:
    """What identifies the dataset's contents without reading them, for the token cache's key: each file's path,
    size and modification time, or the hub name (a hub dataset is taken as unchanging)."""
    if spec.startswith(HUB):
        return [spec]
    out = []
    for f in dataset_files(spec, text_field):
        st = f.path.stat()
        out.append([f.rel_path, str(f.path.resolve()), st.st_size, st.st_mtime_ns])
    return out


def _rows(builder: str, data_files: list[str] | None, name: str | None = None, split: str = "train"):
    from datasets import load_dataset

    # streaming: rows are read in file order as they are needed; nothing is copied into ~/.cache/huggingface
    try:
        if name is not None:
            return load_dataset(name, split=split, streaming=True)
        return load_dataset(builder, data_files=data_files, split="train", streaming=True)
    except Exception as e:  # datasets raises many kinds; the user needs the one line
        raise ConfigError(f"data.dataset {name or data_files[0]}: cannot read it ({type(e).__name__}: {e})") from None


def _text(row: dict, text_field: str, where: str) -> str:
    if text_field not in row:
        raise ConfigError(f"data.text_field {text_field!r} is not a field of {where} (fields: {', '.join(row)})")
    value = row[text_field]
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ConfigError(f"data.text_field {text_field!r} of {where} holds {type(value).__name__}, not text")
    return value


def iter_documents(spec: str, text_field: str) -> Iterator[tuple[str, str]]:
    """``(key, text)`` of every document of `data.dataset`, in a fixed order: files sorted, rows in file order.

    Args:
        spec: `data.dataset`: files or folders (comma-separated), or ``hub:NAME[:SPLIT]`` (split default train).
        text_field: the field holding the text (`data.text_field`).

    Raises:
        ConfigError: `datasets` is missing, a file cannot be read, or its rows lack `text_field`.
    """
    require_datasets()
    if spec.startswith(HUB):
        name, _, split = spec[len(HUB):].partition(":")
        for i, row in enumerate(_rows("", None, name=name, split=split or "train")):
            yield f"{name}#{i}", _text(row, text_field, f"hub dataset {name}")
        return
    for f in dataset_files(spec, text_field):
        try:
            for i, row in enumerate(_rows(f.builder, [str(f.path)])):
                yield f"{f.rel_path}#{i}", _text(row, text_field, str(f.path))
        except ConfigError:
            raise
        except Exception as e:  # a malformed row surfaces while iterating, not at load_dataset
            raise ConfigError(f"data.dataset file {f.path}: cannot read it ({type(e).__name__}: {e})") from None
