"""The command-line flags that set one config value, in one table (`CONFIG_FLAGS`): `add_config_flags` adds them
to a command's parser, `flag_overrides` reads the given ones back onto the config, and `forwarded_sets` turns
`local`'s into the settings it hands its peers.

A flag's help is the table's, or else its config field's docstring; `--set SECTION.KEY=VALUE` reaches every
other config value.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pdiloco.config import Config


def _absolute(path: str) -> str:
    return str(Path(path).resolve())


@dataclass(frozen=True)
class ConfigFlag:
    """One flag that sets the config value at `path` when given."""

    flag: str
    path: str
    """section.key of the config value it sets."""
    where: str
    """The commands that take it: "peer", "local", or "run" (both: every command that trains)."""
    help: str | None = None
    """None: the config field's docstring."""
    type: Callable[[str], Any] | None = None
    nargs: str | None = None
    metavar: str | None = None
    switch: bool = False
    """A flag without a value, that sets True."""
    to_config: Callable[[Any], Any] | None = None
    """How the parsed value becomes the config's (default: as parsed)."""
    forward: Callable[[Any], str] | None = None
    """How `local` writes it into a `--set` for its peers; None: it does not hand it on as a --set."""


CONFIG_FLAGS: tuple[ConfigFlag, ...] = (
    # peer's own, added first in its help
    ConfigFlag("--initial-peers", "swarm.initial_peers", "peer", "bootstrap node or live peer multiaddrs",
               nargs="+", metavar="MADDR"),
    ConfigFlag("--host", "swarm.host", "peer", "interface to listen on (default 0.0.0.0)"),
    ConfigFlag("--port", "swarm.port", "peer", "TCP port to listen on (default: any free one)", type=int),
    ConfigFlag("--announce", "swarm.announce", "peer", "public multiaddrs to advertise", nargs="+", metavar="MADDR"),
    ConfigFlag("--name", "run.name", "peer", "public name of this peer"),
    ConfigFlag("--steps", "run.total_steps", "peer", "inner steps to run (run.total_steps)", type=int),
    ConfigFlag("--metrics-port", "run.metrics_port", "peer",
               "serve Prometheus metrics on this port at /metrics (run.metrics_port; default 0: off)", type=int,
               metavar="PORT"),
    ConfigFlag("--resume", "run.resume", "peer", "continue from the newest good checkpoint in --run-dir (the "
               "swarm's state wins if it is ahead)", switch=True),
    # local's own
    ConfigFlag("--steps", "run.total_steps", "local", "inner steps per peer (default: run.total_steps of the config)",
               type=int),
    # every command that trains, after --config, --preset, --recipe and --set
    ConfigFlag("--run-dir", "run.run_dir", "run", "folder for metrics, summary, checkpoint and plots", metavar="DIR"),
    ConfigFlag("--run-id", "swarm.run_id", "run", "swarm name; all peers of one run use the same", metavar="NAME"),
    ConfigFlag("--data", "data.paths", "run", "text files or folders (default: Python's stdlib sources)", nargs="+",
               metavar="PATH", forward=lambda paths: ",".join(_absolute(p) for p in paths)),
    ConfigFlag("--device", "run.device", "run", "auto (default), cpu, cuda, cuda:N, mps, xpu", metavar="DEV",
               forward=str),
    ConfigFlag("--sync", "rounds.sync", "run",
               "synchronous DiLoCo baseline: wait for every merge and for every live peer", switch=True,
               forward=lambda _: "true"),
    ConfigFlag("--swarm-key", "swarm.swarm_key", "run",
               "private swarm: its key file (p2pdiloco keygen; swarm.swarm_key)", metavar="FILE", to_config=_absolute,
               forward=_absolute),
)
"""Every flag that sets one config value; `add_config_flags` adds them in this order."""


def field_help(path: str) -> str:
    """The docstring of the config field at `path` ("section.key"), with its path."""
    section, key = path.split(".")
    doc = Config.model_fields[section].annotation.model_fields[key].description or ""
    return f"{doc.rstrip('.')} ({path})" if doc else f"({path})"


def add_config_flags(parser: argparse.ArgumentParser, where: str) -> None:
    """Add the flags of `CONFIG_FLAGS` whose `where` is `where` ("peer", "local" or "run")."""
    for f in CONFIG_FLAGS:
        if f.where != where:
            continue
        help_text = (f.help if f.help is not None else field_help(f.path)).replace("%", "%%")
        if f.switch:
            parser.add_argument(f.flag, action="store_true", help=help_text)
            continue
        kwargs = {k: v for k, v in (("type", f.type), ("nargs", f.nargs), ("metavar", f.metavar)) if v is not None}
        parser.add_argument(f.flag, help=help_text, **kwargs)


def given_flags(args: argparse.Namespace, command: str) -> list[tuple[ConfigFlag, Any]]:
    """The flags of `command` ("peer" or "local") given on its command line, with their parsed values: a
    switch given, a number given (0 too), a non-empty text or list."""
    given = []
    for f in CONFIG_FLAGS:
        if f.where not in (command, "run"):
            continue
        value = getattr(args, f.flag.lstrip("-").replace("-", "_"), None)
        if value is None or value is False or (isinstance(value, (str, list)) and not value):
            continue
        given.append((f, value))
    return given


def flag_overrides(args: argparse.Namespace, command: str) -> dict[str, dict[str, Any]]:
    """The config values `command`'s given flags set, as {section: {key: value}} (for `load_config`)."""
    values: dict[str, dict[str, Any]] = {}
    for f, value in given_flags(args, command):
        section, key = f.path.split(".")
        values.setdefault(section, {})[key] = f.to_config(value) if f.to_config else value
    return values


def forwarded_sets(args: argparse.Namespace) -> list[str]:
    """`local`'s given flags that its peers take as `--set section.key=value`, with paths made absolute."""
    return [f"{f.path}={f.forward(value)}" for f, value in given_flags(args, "local") if f.forward is not None]
