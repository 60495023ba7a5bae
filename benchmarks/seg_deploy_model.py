"""The small segmentation model behind the deploy figures in docs/quantize.md, compile.md and edge.md.

    PYTHONPATH=. .venv/bin/python benchmarks/seg_deploy_model.py --size 32 --out /tmp/seg32

Writes OUT/train.tfrecord (64 scenes) and OUT/val.tfrecord (16 scenes) in DeepLab's convention
(tests/train/seg_data.py: grey noise, a bright scratch = class 1, a dark spot = class 2, the last
row ignored), trains unet_small (1 channel, 3 classes; seeded, 8 epochs, Adam 1e-2, one thread),
and exports it with `appliance export`'s function to OUT/export/model.onnx. The deploy verbs then
run on it as the docs show (quantize, compile, package, edge verify).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "train"))
from seg_data import SEG_CLASSES, seg_records  # noqa: E402

from appliance.deploy.export import export_model  # noqa: E402
from appliance.deploy.samples import load_samples  # noqa: E402
from appliance.models import ModelCard, save_trained_model  # noqa: E402
from appliance.tasks.segmentation_models import build_segmentation_model  # noqa: E402
from data_tools.tfrecord import write_records  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=32, help="image side in pixels (a multiple of 4)")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    write_records(out / "train.tfrecord", seg_records(64, seed=1, size=args.size))
    write_records(out / "val.tfrecord", seg_records(16, seed=2, size=args.size))
    pre = {"image_size": args.size, "mean": [0.4], "std": [0.2], "channel_order": "L"}
    train = load_samples([out / "train.tfrecord"], pre)
    x, y = torch.from_numpy(train.x), torch.from_numpy(train.y)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # batches of 16 small images: more threads only wait on a shared box
    model = build_segmentation_model("unet_small", 3, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(args.epochs):
        for i in range(0, len(x), 16):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[i:i + 16]), y[i:i + 16], ignore_index=255).backward()
            opt.step()
    card = ModelCard("unet_small", 3, 1, args.size, mean=(0.4,), std=(0.2,), channel_order="L",
                     class_names=SEG_CLASSES, extra={"task": {"kind": "segmentation", "ignore_label": 255}})
    save_trained_model(out / "run" / "model", model.eval(), card)
    export_model(out / "run", out / "export", sample_files=[out / "val.tfrecord"])
    print(f"wrote {out / 'export' / 'model.onnx'}")


if __name__ == "__main__":
    main()
