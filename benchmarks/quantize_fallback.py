"""Time per-layer sensitivity plus `--fallback auto` on MobileNetV2 at 96 px (issue 30's bound: a few minutes on 2 cores).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/quantize_fallback.py --out /tmp/qfb [--steps 60]

Trains torchvision's mobilenet_v2 (4 classes) briefly on synthetic images (a bright square in one
quadrant per class, noise elsewhere), exports it to ONNX, and times two real `appliance quantize` runs
with /usr/bin/time's view (wall, user): a representative calibration set (the gate passes; sensitivity
of every layer), and one dimmed to 5 % (PTQ fails; sensitivity plus the whole fallback). Prints one
JSON object and writes it to OUT/quantize_fallback.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SIZE, CLASSES = 96, 4
MEAN, STD = 0.2, 0.3


def images(n: int, seed: int):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, n)
    x = rng.integers(0, 90, (n, 3, SIZE, SIZE)).astype(np.float32)
    half = SIZE // 2
    for img, label in zip(x, labels):
        r, c = divmod(int(label), 2)
        img[int(label) % 3, r * half + 8:r * half + half - 8, c * half + 8:c * half + half - 8] += 160
    return ((x / 255.0 - MEAN) / STD).astype(np.float32), labels.astype(np.int64)


def train_and_export(out: Path, steps: int) -> Path:
    import torch
    import torchvision

    torch.manual_seed(0)
    x, y = images(1024, seed=0)
    net = torchvision.models.mobilenet_v2(weights=None, num_classes=CLASSES)
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3)
    net.train()
    for step in range(steps):
        i = (step * 32) % len(x)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(torch.from_numpy(x[i:i + 32])), torch.from_numpy(y[i:i + 32])).backward()
        opt.step()
    net.eval()
    model = out / "mobilenet_v2.onnx"
    torch.onnx.export(net, (torch.from_numpy(x[:1]),), str(model), dynamo=False, input_names=["input"],
                      output_names=["logits"], dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
                      opset_version=17)
    return model


def timed_quantize(model: Path, calib: Path, val: Path, out: Path) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "appliance", "quantize", str(model), "--calib", str(calib),
                           "--val", str(val), "--out", str(out)], capture_output=True, text=True)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    report = json.loads((out / "accuracy.json").read_text())
    sens = report.get("sensitivity") or {}
    return {"exit_status": proc.returncode, "wall_s": round(wall, 1), "user_s": round(after.ru_utime - before.ru_utime, 1),
            "fp32_top1": report["fp32"]["top1"], "int8_top1": report["quantized"]["top1"],
            "produced_by": report.get("produced_by"), "float_layers": report.get("float_layers", []),
            "attempts": len(report.get("fallback", {}).get("attempts", [])), "layers": sens.get("layers"),
            "sensitivity_s": sens.get("seconds")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=60, help="training steps of batch 32 (default 60)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = train_and_export(args.out, args.steps)
    x, y = images(640, seed=1)
    np.savez(args.out / "calib.npz", x=x[:128], y=y[:128])
    np.savez(args.out / "val.npz", x=x[128:], y=y[128:])
    dim = (((x[:128] * STD + MEAN) * 0.05 - MEAN) / STD).astype(np.float32)
    np.savez(args.out / "calib-dim.npz", x=dim, y=y[:128])
    result = {"model": "mobilenet_v2", "image_size": SIZE, "validation_samples": 512, "calibration_samples": 128,
              "representative_calibration": timed_quantize(model, args.out / "calib.npz", args.out / "val.npz",
                                                           args.out / "q-good"),
              "dimmed_calibration": timed_quantize(model, args.out / "calib-dim.npz", args.out / "val.npz",
                                                   args.out / "q-dim")}
    (args.out / "quantize_fallback.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
