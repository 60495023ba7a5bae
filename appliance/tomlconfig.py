"""TOML config files validated into frozen dataclasses, with one-line errors naming file, section and key.

Shared by the training config, the pipeline config and the bundle profiles.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from pathlib import Path

from appliance.errors import ConfigError


def read_toml(path: str | Path, what: str = "config file") -> dict:
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such {what}") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a {what} (give the .toml file)") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML ({err})") from None


def _type_name(tp) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _coerce(value, tp, where: str):
    """Check value against a field type; return it in the dataclass's form (lists become tuples)."""
    if typing.get_origin(tp) is tuple:
        (item_tp, _) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list of {_type_name(item_tp)[2:]}s, got {value!r}")
        return tuple(_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value))
    # TOML distinguishes 1 from 1.0; a float key accepts both, an int key only integers.
    ok = (isinstance(value, bool) if tp is bool else
          isinstance(value, int) and not isinstance(value, bool) if tp is int else
          isinstance(value, (int, float)) and not isinstance(value, bool) if tp is float else
          isinstance(value, tp))
    if not ok:
        raise ConfigError(f"{where} must be {_type_name(tp)}, got {value!r}")
    return float(value) if tp is float else value


def parse_section(cls, raw: dict, source: str, name: str):
    """A TOML table -> the frozen dataclass cls; unknown, mistyped or missing keys are named."""
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for key, value in raw.items():
        if key not in hints:
            raise ConfigError(f"{source}: [{name}] unknown key {key!r} (known keys: {', '.join(known)})")
        values[key] = _coerce(value, hints[key], f"{source}: [{name}] {key}")
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for key in required:
        if key not in values:
            raise ConfigError(f"{source}: [{name}] missing required key {key!r}")
    return cls(**values)
