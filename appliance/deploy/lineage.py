"""Lineage: each deploy stage carries its upstream manifests' inputs forward.

A stage's manifest has `params.lineage`, a list of {stage, dir, inputs} from the oldest stage
to its direct parent, so the edge package's manifest names the exact training data files
(with sha256) that produced it, without anyone having to keep the intermediate directories.
"""

from __future__ import annotations

import json
from pathlib import Path

from appliance.errors import DataError
from appliance.manifest import MANIFEST_NAME


def lineage_from(*dirs) -> list[dict]:
    """The lineage to record for a stage whose inputs live in `dirs` (first manifest found wins)."""
    for d in dirs:
        path = Path(d) / MANIFEST_NAME
        if path.is_file():
            try:
                manifest = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                # A damaged upstream manifest would silently cut the edge package's lineage.
                raise DataError(f"{path}: damaged stage manifest ({err}); rerun that stage") from None
            earlier = manifest.get("params", {}).get("lineage", [])
            return [*earlier, {"stage": manifest.get("stage"), "dir": str(Path(d).resolve()),
                               "inputs": manifest.get("inputs", [])}]
    return []
