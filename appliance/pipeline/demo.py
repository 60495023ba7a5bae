"""`appliance demo`: the pipeline on real data that ships inside an installed package."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from appliance.manifest import atomic_write_text
from appliance.pipeline.runner import run_pipeline, say


def run_demo(out: Path) -> dict:
    out = Path(out).resolve()
    data = out / "data"
    if not any(data.glob("*.tfrecord")):
        from appliance.pipeline.digits import write_digits_shards

        say(f"demo: writing scikit-learn's handwritten digits as TFRecord shards into {data}")
        shards = write_digits_shards(data)
        say(f"demo: {sum(len(v) for v in shards.values())} shards (train/val, stratified 80/20)")
    config = out / "pipeline.toml"
    if not config.exists():
        atomic_write_text(config, resources.files("appliance.pipeline").joinpath("demo.toml").read_text())
    say(f"demo: running `appliance pipeline {config}`")
    return run_pipeline(config)
