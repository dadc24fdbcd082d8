"""Reading a config: defaults, then a TOML file, then ``--set section.key=value`` flags, in that order.

This module only finds the tables and names the source of a bad key; the models in `schema.py` convert and
check the values.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from p2pdiloco.config.base import ConfigError, coerce
from p2pdiloco.config.schema import Config

ALIASES: dict[str, str] = {
    "run.slow_factor": "emulate.slow_factor",
    "run.min_step_s": "emulate.min_step_s",
    "run.hostile": "emulate.hostile",
    **{f"swarm.{key}": f"rounds.{key}" for key in ("round_steps", "round_seconds", "sync")},
    **{f"swarm.{key}": f"merge.{key}" for key in ("merge_window_s", "window_fraction", "min_window_s",
                                                  "merge_timeout_s", "group_size", "epoch_s", "state_anchors")},
    "swarm.codec": "codec.name",
    **{f"swarm.{key}": f"codec.{key}" for key in ("sparse_keep", "error_feedback", "error_feedback_decay")},
    **{f"swarm.{key}": f"startup.{key}" for key in ("wait_for_peers", "wait_for_peers_s")},
}
"""Old keys that still work, in TOML files, in ``--set`` and in the configs that summaries and checkpoints
recorded, and the key each one sets now."""


def apply_values(merged: dict[str, dict[str, Any]], values: dict[str, Any], source: str) -> None:
    """Add ``{"section": {"key": value}}`` from `source` to `merged` (later sources win), naming `source` in
    errors about unknown sections and keys. Values are converted to the field's type here, so that a bad value
    is reported in the order the sources give it; the checks run when the `Config` is built."""
    sections = Config.model_fields
    for section_name, table in values.items():
        if section_name not in sections:
            known = ", ".join(sorted(sections))
            raise ConfigError(f"{source}: unknown config section [{section_name}] (known: {known})")
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: [{section_name}] must be a table")
        for key, value in table.items():
            section, name = ALIASES.get(f"{section_name}.{key}", f"{section_name}.{key}").split(".")
            fields = sections[section].annotation.model_fields
            if name not in fields:
                raise ConfigError(
                    f"{source}: unknown config key '{section_name}.{key}' (known in [{section_name}]: "
                    f"{', '.join(fields)})"
                )
            merged.setdefault(section, {})[name] = coerce(value, fields[name].annotation, f"{section}.{name}")


def parse_set(items: list[str]) -> dict[str, dict[str, Any]]:
    """Turn ``["model.n_layer=4", ...]`` into ``{"model": {"n_layer": "4"}}`` (strings are coerced later)."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise ConfigError(f"--set expects section.key=value, got {item!r}")
        out.setdefault(section, {})[name] = value.strip()
    return out


def load_config(path: str | Path | None = None, overrides: list[dict[str, Any]] | None = None) -> Config:
    """Defaults, then the TOML file at `path`, then each override table in order."""
    merged: dict[str, dict[str, Any]] = {}
    if path is not None:
        path = Path(path)
        try:
            values = tomllib.loads(path.read_text())
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        apply_values(merged, values, str(path))
    for table in overrides or []:
        apply_values(merged, table, "flags")
    return Config(**merged)
