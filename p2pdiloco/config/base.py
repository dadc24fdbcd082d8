"""The machinery under every config model: coercion of TOML and flag values, one-line errors, and the
`_Section` base whose `checks` hold a table's validation.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator, model_validator


class ConfigError(ValueError):
    """Bad user input in a config file or a flag; the CLI prints it as one line."""


def coerce(value: Any, annotation: Any, key: str) -> Any:
    """Convert a TOML or command-line value to the field's type, or raise ConfigError.

    Args:
        value: what the TOML file or the ``--set`` flag gave (flags give strings; a list may be "a,b").
        annotation: the field's type: bool, int, float, str or list of one of them.
        key: ``section.key``, for the error message.
    """
    hint = annotation
    origin = typing.get_origin(hint)
    try:
        if origin in (list,):
            (item_type,) = typing.get_args(hint)
            if isinstance(value, str):
                value = [v for v in value.split(",") if v]
            if not isinstance(value, list):
                raise TypeError
            return [coerce(v, item_type, key) for v in value]
        if origin in (typing.Union, types.UnionType):
            raise TypeError  # no optional fields today
        if hint is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
                return value.lower() in ("true", "1", "yes", "on")
            raise TypeError
        if hint is int:
            if isinstance(value, bool):
                raise TypeError
            if isinstance(value, float) and not value.is_integer():
                raise TypeError
            return int(value)
        if hint is float:
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        if hint is str:
            if not isinstance(value, str | int | float):
                raise TypeError
            return str(value)
    except (TypeError, ValueError):
        pass
    else:
        raise ConfigError(f"config key {key!r} has an unsupported type")
    raise ConfigError(f"config key {key!r} expects {getattr(hint, '__name__', hint)}, got {value!r}")


def as_config_error(error: ValidationError, section: str = "") -> ConfigError:
    """The first problem pydantic found, as the one-line ConfigError a validator raised (or one made from it).

    Args:
        error: what pydantic raised.
        section: the table the failing model stands for ("" for the whole `Config`), to name the key.
    """
    first = error.errors()[0]
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, ConfigError):
        return cause
    key = ".".join(str(part) for part in ([section] if section else []) + list(first["loc"]))
    if first["type"] == "extra_forbidden":
        return ConfigError(f"unknown config key {key!r}")
    return ConfigError(f"config key {key!r}: {first['msg']}")


class _Model(BaseModel):
    """Unknown keys are errors; each field's docstring is its description; failures are ConfigErrors."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise as_config_error(e, getattr(self, "SECTION", "")) from None


class _Section(_Model):
    """One TOML table: values are coerced as flags and TOML give them, then checked by `checks`."""

    SECTION: ClassVar[str] = ""
    """The table's name in TOML files and in ``--set section.key=value``."""

    @field_validator("*", mode="before")
    @classmethod
    def _coerce(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name or ""
        return coerce(value, cls.model_fields[name].annotation, f"{cls.SECTION}.{name}")

    @model_validator(mode="after")
    def _check(self) -> _Section:
        for ok, message in self.checks():
            if not ok:
                raise ConfigError(message)
        return self

    def checks(self) -> Iterator[tuple[bool, str]]:
        """(condition, message if it is false) pairs, evaluated in order; the first false one is raised."""
        return iter(())
