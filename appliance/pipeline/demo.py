"""`appliance demo`: the pipeline on real data that ships inside an installed package."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

from appliance.core.errors import ConfigError
from appliance.core.manifest import atomic_write_text
from appliance.pipeline.runner import run_pipeline, say
from appliance.pipeline.digits import write_digits_shards


def run_demo(out: Path, epochs: int | None = None) -> dict:
    """epochs: train for that many instead of demo.toml's, when the demo writes pipeline.toml."""
    if epochs is not None and epochs < 1:
        raise ConfigError(f"--epochs must be at least 1, got {epochs}")
    out = Path(out).resolve()
    data = out / "data"
    if not any(data.glob("*.tfrecord")):
        say(f"demo: writing scikit-learn's handwritten digits as TFRecord shards into {data}")
        shards = write_digits_shards(data)
        say(f"demo: {sum(len(v) for v in shards.values())} shards (train/val, stratified 80/20)")
    config = out / "pipeline.toml"
    if not config.exists():
        text = resources.files("appliance.pipeline").joinpath("demo.toml").read_text()
        if epochs is not None:
            text = re.sub(r"(?m)^epochs = \d+", f"epochs = {epochs}", text)
        atomic_write_text(config, text)
    elif epochs is not None:
        say(f"demo: {config} exists and is run as it is (--epochs applies only when the demo writes it)")
    say(f"demo: running `appliance pipeline {config}`")
    return run_pipeline(config)
