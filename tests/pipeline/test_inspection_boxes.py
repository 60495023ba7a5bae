"""The detection demo's data: seeded surfaces with boxed defects, as Object Detection API records
that pass the data check; its pipeline config reads and validates."""

import numpy as np

from appliance.pipeline.config import load_pipeline_config
from appliance.pipeline.inspection_boxes import BOX_CLASSES, make_sample, write_box_shards
from data_tools.check.run import run_check


def test_boxes_are_valid_and_a_seed_gives_the_same_sample():
    rng = np.random.default_rng(4)
    boxes_seen = 0
    for _ in range(20):
        image, boxes, labels = make_sample(rng, 64)
        assert image.shape == (64, 64, 3) and len(boxes) == len(labels) and set(labels) <= {1, 2, 3}
        assert ((boxes >= 0) & (boxes <= 1)).all() and (boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all()
        boxes_seen += len(boxes)
    assert boxes_seen > 20
    a, b = make_sample(np.random.default_rng(7)), make_sample(np.random.default_rng(7))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_demo_shards_pass_the_box_checks(tmp_path):
    written = write_box_shards(tmp_path / "data", count=40, shards=1)
    report, status = run_check([(str(p), None) for side in written.values() for p in side], tmp_path / "chk",
                               progress=False)
    assert status == 0 and report["records_quarantined"] == 0 and report["records_valid"] == 40
    det = report["detection"]
    assert det["num_classes"] == 3 and det["class_names"] == {str(i + 1): n for i, n in enumerate(BOX_CLASSES)}
    assert all(n > 0 for n in det["boxes_per_class"].values())


def test_the_detection_pipeline_config_validates(tmp_path):
    from importlib import resources
    write_box_shards(tmp_path / "data", count=10, shards=1)
    config = tmp_path / "pipeline.toml"
    config.write_text(resources.files("appliance.pipeline").joinpath("demo_detection.toml").read_text())
    cfg = load_pipeline_config(config)
    assert cfg.training["task"]["kind"] == "detection" and cfg.training["model"]["architecture"] == "fcos_tiny"
