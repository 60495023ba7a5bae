"""`appliance demo`: the pipeline on real data made or shipped inside an installed package.

Per task, what the demo writes and which config it runs: classification trains on scikit-learn's
bundled handwritten digits (demo.toml); segmentation on seeded industrial inspection images made
offline (inspection.py, demo_segmentation.toml); detection on the same surfaces with boxed defects
(inspection_boxes.py, demo_detection.toml).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable

from appliance.core.errors import ConfigError
from appliance.core.manifest import atomic_write_text
from appliance.pipeline.digits import write_digits_shards
from appliance.pipeline.inspection import write_inspection_shards
from appliance.pipeline.inspection_boxes import write_box_shards
from appliance.pipeline.runner import run_pipeline, say


@dataclass(frozen=True)
class DemoData:
    config: str  # the pipeline config in appliance.pipeline, copied to OUT/pipeline.toml
    what: str  # said while the data is written
    split: str
    write: Callable[[Path], dict]


DEMOS = {
    "classification": DemoData("demo.toml", "scikit-learn's handwritten digits", "train/val, stratified 80/20",
                               write_digits_shards),
    "segmentation": DemoData("demo_segmentation.toml", "seeded inspection images (64 px surfaces with scratches, "
                             "spots and cracks)", "train/val, 80/20", write_inspection_shards),
    "detection": DemoData("demo_detection.toml", "seeded inspection images with boxed defects (64 px surfaces with "
                          "scratches, spots and cracks)", "train/val, 80/20", write_box_shards),
}


def run_demo(out: Path, epochs: int | None = None, task: str = "classification") -> dict:
    """epochs: train for that many instead of the config's, when the demo writes pipeline.toml."""
    if epochs is not None and epochs < 1:
        raise ConfigError(f"--epochs must be at least 1, got {epochs}")
    if task not in DEMOS:
        raise ConfigError(f"--task must be one of {', '.join(DEMOS)}, got {task!r}")
    demo = DEMOS[task]
    out = Path(out).resolve()
    data = out / "data"
    try:  # before the shards are made: /dev/null or a file as --out was an internal NotADirectoryError
        data.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--out {out}: cannot make {data}: {err.strerror or err}") from None
    if not any(data.glob("*.tfrecord")):
        say(f"demo: writing {demo.what} as TFRecord shards into {data}")
        shards = demo.write(data)
        say(f"demo: {sum(len(v) for v in shards.values())} shards ({demo.split})")
    config = out / "pipeline.toml"
    if not config.exists():
        text = resources.files("appliance.pipeline").joinpath(demo.config).read_text()
        if epochs is not None:
            text = re.sub(r"(?m)^epochs = \d+", f"epochs = {epochs}", text)
        atomic_write_text(config, text)
    elif epochs is not None:
        say(f"demo: {config} exists and is run as it is (--epochs applies only when the demo writes it)")
    say(f"demo: running `appliance pipeline {config}`")
    return run_pipeline(config)
