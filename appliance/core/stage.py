"""The one contract every stage keeps (docs/dev/contracts.md, "Stage results").

A stage is a library function with typed inputs that writes one output directory (with its
manifest.json) and returns a result implementing StageResult: where it wrote (`out_dir`, always a
Path), how to rebuild the same result from a finished directory (`load`, through read_result_json:
DataError naming the file when it is missing or damaged), and the figures the pipeline's summary
shows (`figures`: flat, see Figures). Each stage's package implements it once, next to the stage
function; the CLI verb and the pipeline call that same function, which takes `on_result(result)`
when its caller prints figures before the gate, and raises GateFailed (exit 3) for a failed gate,
DataError / ConfigError (exit 2) for bad input. Only the stage's own module knows its file names:
a caller reads paths and figures off the result, never out of the directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Protocol, Union, runtime_checkable

from appliance.core.errors import DataError
from appliance.core.manifest import read_manifest


Scalar = Union[str, int, float, bool, None]
# A stage's figures: one level, each value a scalar or a list of scalars. A record's nested parts are
# spelled with dots ("check.top1_agreement", "routes.0.runner"): flat_figures makes them, figures_under
# reads one part back as it was.
Figures = dict[str, Union[Scalar, list[Scalar]]]
_SCALARS = (str, int, float, bool, type(None))


@runtime_checkable
class StageResult(Protocol):
    out_dir: Path

    @classmethod
    def load(cls, out_dir: Path) -> "StageResult":
        """The result of a finished run of the stage in out_dir; DataError naming the file when it is not one."""

    def figures(self) -> Figures:
        """What the pipeline's summary shows for this stage: flat (see Figures)."""


def flat_figures(record: Mapping, prefix: str = "") -> Figures:
    """record (a stage's JSON record) as Figures: nested mappings and lists of mappings become dotted keys."""
    out: Figures = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_figures(value, f"{name}."))
        elif isinstance(value, Mapping):  # an empty part: kept as a key, read back as None
            out[name] = None
        elif isinstance(value, (list, tuple)) and not all(isinstance(v, _SCALARS) for v in value):
            out.update(flat_figures({str(i): v for i, v in enumerate(value)}, f"{name}."))
        else:
            out[name] = list(value) if isinstance(value, tuple) else value
    return out


def figures_under(figures: Mapping, prefix: str):
    """The part of flat figures under prefix, nested again as the record held it (a list where its keys
    are 0..n-1); the plain value when prefix is itself a key; None when there is nothing under it."""
    if prefix in figures:
        return figures[prefix]
    tree: dict = {}
    for key, value in figures.items():
        if key.startswith(prefix + "."):
            *parents, leaf = key[len(prefix) + 1:].split(".")
            node = tree
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
    return _lists(tree) if tree else None


def _lists(node):
    if not isinstance(node, dict):
        return node
    items = {k: _lists(v) for k, v in node.items()}
    if items and list(items) == [str(i) for i in range(len(items))]:
        return list(items.values())
    return items


def is_flat(figures) -> bool:
    """Whether figures keep the Figures shape: str keys, scalar or list-of-scalar values."""
    return isinstance(figures, dict) and all(
        isinstance(k, str) and (isinstance(v, _SCALARS) or (isinstance(v, list) and all(isinstance(x, _SCALARS) for x in v)))
        for k, v in figures.items())


def html_reports(result: StageResult) -> list[Path]:
    """The HTML reports a finished stage lists among its manifest's outputs (none when it has no manifest)."""
    out_dir = Path(result.out_dir)
    try:
        outputs = read_manifest(out_dir).get("outputs", [])
    except DataError:  # a stage without a readable manifest has no report to link
        return []
    return [out_dir / o["path"] for o in outputs if str(o.get("path", "")).endswith(".html")]


def read_result_json(path: Path) -> dict:
    """A finished stage's JSON record; DataError naming the file when it is missing or damaged."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise DataError(f"{path}: missing (is {Path(path).parent} the output of that stage?)") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise DataError(f"{path}: damaged ({str(err)[:200]}); rerun that stage") from None
