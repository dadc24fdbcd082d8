"""Config presets shipped inside the package, so `p2pdiloco peer --preset NAME` works from an installed wheel.

`peers/*.toml` in the repository are the operator-facing copies of these files (a test keeps them equal).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from p2pdiloco.config import ConfigError


def preset_names() -> list[str]:
    """The names `--preset` accepts, sorted."""
    return sorted(p.name.removesuffix(".toml") for p in resources.files(__name__).iterdir() if p.name.endswith(".toml"))


def preset_path(name: str) -> Path:
    """The TOML file of preset `name`; ConfigError naming the known presets if there is none."""
    if name not in preset_names():
        raise ConfigError(f"unknown preset {name!r} (known: {', '.join(preset_names())})")
    return Path(str(resources.files(__name__).joinpath(f"{name}.toml")))
