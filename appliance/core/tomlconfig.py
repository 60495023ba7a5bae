"""TOML config files validated into frozen dataclasses, with one-line errors naming file, section and key.

Shared by the training config, the pipeline config and the bundle profiles. A field may carry
its allowed range: `lr: Annotated[float, Range(gt=0)] = 1e-3`; every float must be finite.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from pathlib import Path

from appliance.core.errors import ConfigError
from appliance.core.inputs import MAX_CONFIG_BYTES, read_bounded
from appliance.core.values import ANY, INT64, PathText, Range, path_problem, shown

MAX_NESTING = 32  # tables and arrays inside each other; no config of ours needs more than 3


def read_toml(path: str | Path, what: str = "config file") -> dict:
    """A TOML file of at most MAX_CONFIG_BYTES, nested at most MAX_NESTING deep, as a dict."""
    data = read_bounded(path, what, MAX_CONFIG_BYTES, error=ConfigError)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not a TOML text file (byte {err.start} is not UTF-8)") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML ({err})") from None
    except RecursionError:
        raise ConfigError(f"{path}: arrays or tables nested too deeply (at most {MAX_NESTING} levels)") from None
    if _depth(raw) > MAX_NESTING:
        raise ConfigError(f"{path}: arrays or tables nested too deeply (at most {MAX_NESTING} levels)")
    return raw


def _depth(value, limit: int = MAX_NESTING + 1) -> int:
    """Nesting depth of lists and dicts, counted no further than limit."""
    if limit <= 0 or not isinstance(value, (dict, list)):
        return 0
    items = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(v, limit - 1) for v in items), default=0)


def _type_name(tp) -> str:
    if typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _coerce(value, tp, where: str):
    """Check value against a field type and range; return it in the dataclass's form (lists become tuples)."""
    allowed, is_path = ANY, False
    if typing.get_origin(tp) is typing.Annotated:
        tp, *extras = typing.get_args(tp)
        allowed = next((e for e in extras if isinstance(e, Range)), ANY)
        is_path = any(isinstance(e, PathText) for e in extras)
    if typing.get_origin(tp) is dict:
        key_tp, value_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a table of {_type_name(value_tp)[2:]}s, got {shown(value)}")
        return {_coerce(k, key_tp, f"{where} key {k!r}"): _coerce(v, value_tp, f"{where}.{k}")
                for k, v in value.items()}
    if typing.get_origin(tp) is tuple:
        (item_tp, _) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list of {_type_name(item_tp)[2:]}s, got {shown(value)}")
        return tuple(_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value))
    # TOML distinguishes 1 from 1.0; a float key accepts both, an int key only integers.
    ok = (isinstance(value, bool) if tp is bool else
          isinstance(value, int) and not isinstance(value, bool) if tp is int else
          isinstance(value, (int, float)) and not isinstance(value, bool) if tp is float else
          isinstance(value, tp))
    if not ok:
        raise ConfigError(f"{where} must be {_type_name(tp)}, got {shown(value)}")
    if tp is str and "\0" in value:
        raise ConfigError(f"{where} must not contain a NUL character, got {shown(value)}")
    if tp is str and is_path and path_problem(value):
        raise ConfigError(f"{where} {path_problem(value)}")
    if tp in (int, float):
        if tp is float:
            try:
                value = float(value)
            except OverflowError:  # an integer of hundreds of digits
                raise ConfigError(f"{where} must be a finite number, got an integer of {len(str(value))} digits") from None
        problem = allowed.problem(value) or (INT64.problem(value) if tp is int else None)
        if problem:
            raise ConfigError(f"{where} {problem}")
    return value


def parse_section(cls, raw: dict, source: str, name: str):
    """A TOML table -> the frozen dataclass cls; unknown, mistyped or missing keys are named."""
    hints = typing.get_type_hints(cls, include_extras=True)
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
