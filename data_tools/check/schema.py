"""The expected shape of every record: keys, dtypes, value counts, label range.

A schema is a JSON file (`appliance data check` writes the one it inferred as schema.json; edit
it and pass it back with --schema to pin it):

    {"made_by": "...", "image_key": "image/encoded", "label_key": "image/class/label",
     "num_classes": 5,
     "features": {"image/encoded": {"dtype": "bytes", "required": true, "min_count": 1, "max_count": 1},
                  "image/class/label": {"dtype": "int64", "required": true, "min_count": 1,
                                        "max_count": 1, "min": 0, "max": 4}}}
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np

from appliance.core.errors import ConfigError
from appliance.core.inputs import read_bounded
from data_tools.labels import MAX_CLASSES

DTYPES = ("bytes", "int64", "float")
REQUIRED_FRACTION = 0.9  # a key in at least this share of the sample is required


def dtype_of(value) -> str:
    """Our name for the dtype decode_example gives a feature."""
    if isinstance(value, np.ndarray):
        return "float" if value.dtype.kind == "f" else "int64"
    return "bytes"


def infer_schema(sample: list[dict], image_key: str, label_key: str) -> dict:
    """A schema from decoded examples: what most of them look like."""
    n = max(len(sample), 1)
    presence: Counter = Counter()
    dtypes: dict[str, Counter] = {}
    counts: dict[str, list[int]] = {}
    for example in sample:
        for key, value in example.items():
            presence[key] += 1
            dtypes.setdefault(key, Counter())[dtype_of(value)] += 1
            counts.setdefault(key, []).append(len(value))
    features = {}
    for key in sorted(presence):
        dtype = dtypes[key].most_common(1)[0][0]
        spec = {"dtype": dtype, "required": presence[key] / n >= REQUIRED_FRACTION,
                "min_count": min(counts[key]), "max_count": max(counts[key])}
        features[key] = spec
    return {"made_by": "appliance data check (keys and dtypes inferred from the first records, label range "
                       "from all of them; edit and pass with --schema)",
            # The keys training reads, whether or not the sample holds them: a file whose records all lack
            # the label (or the image) was passed whole, and training refused its first record.
            "image_key": image_key, "label_key": label_key,
            "num_classes": None, "features": features}


def infer_num_classes(histogram: dict[int, int], stray_fraction: float = 0.01) -> int | None:
    """K for labels 0..K-1, from the label counts of the whole dataset.

    A stray 9 among 0..4 is a bad label, not a sign of 10 classes: classes are the run of
    consecutive labels from 0, and labels past a gap are strays when together they are at most
    stray_fraction of the records, or each is under a tenth of a typical class. Plentiful labels
    past a gap are classes (the gap is then an empty class, which the balance check reports).
    """
    labels = sorted(k for k in histogram if k >= 0)
    if not labels or labels[0] != 0:
        return (labels[-1] + 1) if labels else None
    k = 0
    while k < len(labels) and labels[k] == k:
        k += 1
    beyond = [histogram[label] for label in labels[k:]]
    typical = float(np.median([histogram[label] for label in labels[:k]]))
    if not beyond or sum(beyond) <= stray_fraction * sum(histogram.values()) or max(beyond) < 0.1 * typical:
        return k
    return labels[-1] + 1


def validate(example: dict, schema: dict, skip: str | tuple = ()) -> list[tuple[str, str]]:
    """Problems of one decoded example: (check, detail) with check 'schema' or 'label_range'.
    skip: keys checked elsewhere (the label and the image, by data_tools.labels)."""
    skip = (skip,) if isinstance(skip, str) else skip
    problems = []
    for key, spec in schema["features"].items():
        if key in skip:
            continue
        value = example.get(key)
        if value is None:
            if spec.get("required"):
                problems.append(("schema", f"missing required feature {key!r}"))
            continue
        found = dtype_of(value)
        if found != spec["dtype"]:
            problems.append(("schema", f"feature {key!r} is {found}, schema says {spec['dtype']}"))
            continue
        if not spec.get("min_count", 0) <= len(value) <= spec.get("max_count", len(value)):
            problems.append(("schema", f"feature {key!r} has {len(value)} values, schema says "
                                       f"{spec.get('min_count')}..{spec.get('max_count')}"))
            continue
        if "min" in spec and len(value) and (value.min() < spec["min"] or value.max() > spec["max"]):
            bad = value[(value < spec["min"]) | (value > spec["max"])][0]
            check = "label_range" if key == schema.get("label_key") else "schema"
            problems.append((check, f"{key} = {bad.item()} outside {spec['min']}..{spec['max']}"))
    return problems


def schema_num_classes(schema: dict) -> int | None:
    """The classes a schema knows: its num_classes, else its label's max + 1; None when unknown."""
    if schema.get("num_classes"):
        return int(schema["num_classes"])
    spec = schema["features"].get(schema.get("label_key") or "")
    if spec is not None and isinstance(spec.get("max"), int) and spec.get("min", 0) == 0:
        return spec["max"] + 1
    return None


def _check_spec(path, key: str, spec) -> None:
    """One feature's spec: a dtype, and counts and bounds that are numbers (what validate compares)."""
    if not isinstance(spec, dict) or spec.get("dtype") not in DTYPES:
        raise ConfigError(f"{path}: features.{key}: dtype must be one of {', '.join(DTYPES)}")
    if not isinstance(spec.get("required", False), bool):
        raise ConfigError(f"{path}: features.{key}: required must be true or false, got {spec['required']!r}")
    for name in ("min_count", "max_count"):
        value = spec.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
            raise ConfigError(f"{path}: features.{key}: {name} must be an integer in 0..{2**31 - 1}, got {value!r}")
    for name in ("min", "max"):
        value = spec.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or abs(value) >= 2**63:
            raise ConfigError(f"{path}: features.{key}: {name} must be a finite number, got {value!r}")
    if ("min" in spec) != ("max" in spec):
        raise ConfigError(f"{path}: features.{key}: min and max go together")


def load_schema(path: str | Path) -> dict:
    """Read a schema file; a malformed one is a ConfigError naming the file and what is wrong."""
    path = Path(path)
    try:
        schema = json.loads(read_bounded(path, "schema file", error=ConfigError).decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not a schema file (byte {err.start} is not UTF-8 text)") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: line {err.lineno}: schema is not valid JSON: {err.msg}") from None
    if not isinstance(schema, dict) or not isinstance(schema.get("features"), dict):
        raise ConfigError(f"{path}: schema needs a \"features\" object mapping feature keys to specs")
    for key, spec in schema["features"].items():
        _check_spec(path, key, spec)
    for name in ("image_key", "label_key"):
        if schema.get(name) is not None and (not isinstance(schema[name], str) or not schema[name]):
            raise ConfigError(f"{path}: {name} must be a feature name or null, got {schema[name]!r}")
    schema.setdefault("image_key", "image/encoded" if "image/encoded" in schema["features"] else None)
    schema.setdefault("label_key", "image/class/label" if "image/class/label" in schema["features"] else None)
    label = schema["features"].get(schema["label_key"] or "")
    if schema.get("num_classes") is not None and (not isinstance(schema["num_classes"], int)
                                                  or isinstance(schema["num_classes"], bool)
                                                  or not 0 <= schema["num_classes"] <= MAX_CLASSES):
        raise ConfigError(f"{path}: num_classes must be an integer in 0..{MAX_CLASSES}, "
                          f"got {schema['num_classes']!r}")
    if schema.get("num_classes") and label is not None and "max" not in label:
        label.update(min=0, max=int(schema["num_classes"]) - 1)
    schema.setdefault("num_classes", None)
    return schema
