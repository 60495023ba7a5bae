"""The one contract every stage keeps (DESIGN.md, "Stage results").

A stage is a library function with typed inputs that writes one output directory (with its
manifest.json) and returns a result implementing StageResult: where it wrote (`out_dir`), how to
rebuild the same result from a finished directory (`load`), and the figures the pipeline's
summary shows (`figures`). Each stage's package implements it once, next to the stage function;
the CLI verb and the pipeline call that same function. Only the stage's own module knows its file
names: a caller reads paths and figures off the result, never out of the directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, runtime_checkable

from appliance.core.errors import DataError
from appliance.core.manifest import read_manifest


@runtime_checkable
class StageResult(Protocol):
    out_dir: Path

    @classmethod
    def load(cls, out_dir: Path) -> "StageResult":
        """The result of a finished run of the stage in out_dir; DataError naming the file when it is not one."""

    def figures(self) -> dict:
        """What the pipeline's summary shows for this stage: plain JSON values."""


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
