"""`appliance train` with [task] kind = "segmentation": real torchrun, DeepLab-convention records, unet_small."""

import json
import subprocess

import pytest

from conftest import appliance_cmd, offline_cmd
from seg_data import SEG_CLASSES, make_seg_config


@pytest.mark.slow
def test_train_segmentation_logs_miou_and_passes_the_most_common_class_gate(tmp_path):
    config = make_seg_config(tmp_path, train_records=48, val_records=16, train={"epochs": 3, "batch_size": 8},
                             augment={"enabled": True, "crop_scale": [0.5, 1.0], "degrees": 10.0})
    # Offline (a network namespace with only loopback, which torch.distributed's rendezvous uses).
    proc = subprocess.run(offline_cmd(appliance_cmd("train", str(config), "--nproc-per-node", "1"), loopback=True),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    run = tmp_path / "runs" / "seg"
    evals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "val_miou" in r]
    assert len(evals) == 3
    last = evals[-1]
    assert set(last["val_iou"]) == set(SEG_CLASSES) and 0 <= last["val_pixel_acc"] <= 1
    # The confusion counts labelled pixels only: 16 images x 15 labelled rows x 16 columns.
    assert sum(map(sum, last["val_confusion"])) == 16 * 15 * 16
    quality = json.loads((run / "quality.json").read_text())
    assert quality["passed"] and quality["val_miou"] > quality["required_miou"] > quality["baseline_miou"]
    assert quality["baseline_class"] == "surface" and "val mIoU" in proc.stdout and "gate passed" in proc.stdout
    report = json.loads((run / "report.json").read_text())
    assert report["segmentation"]["val_miou"] == [r["val_miou"] for r in evals]
    assert 'id="chart-miou"' in (run / "report.html").read_text()
    card = json.loads((run / "model" / "model.json").read_text())
    assert card["architecture"] == "unet_small" and card["extra"]["task"] == {"kind": "segmentation", "ignore_label": 255}
