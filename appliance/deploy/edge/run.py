#!/usr/bin/env python3
"""Python edge runner, made by `appliance package`: an image in, the top-k classes out.

    python3 run.py --input image.png [--top-k K] [--model ../model.so] [--output logits.npy] [--masks DIR]

Decodes and preprocesses the image with preprocessing.py (a verbatim copy of the host's), runs
the TVM library through the runtime-only TVM (no compiler needed) and prints one JSON line.
A .npy input is taken as an already preprocessed (N, C, H, W) float32 tensor.
A segmentation model (model.json "task") writes a class map per image instead, DIR/NNNN.png
(8-bit greyscale, one class id per pixel; default masks/), as bin/run does.
"""

import argparse
import binascii
import json
import os
import struct
import sys
import zlib
from pathlib import Path

os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")  # runtime only: fast import, no LLVM on the device
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True)
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--model", default=str(HERE.parent / "model.so"))
    parser.add_argument("--info", default=str(HERE.parent / "model.json"))
    parser.add_argument("--output", help="also write all logits as a float32 .npy (N, classes) or (N, K, H, W)")
    parser.add_argument("--masks", default="masks", help="segmentation: the folder of the class maps (NNNN.png)")
    args = parser.parse_args()

    import numpy as np
    import tvm
    from tvm.runtime.vm import VirtualMachine

    from preprocessing import preprocess_image

    info = json.loads(Path(args.info).read_text())
    if args.input.endswith(".npy"):
        batch = np.load(args.input).astype(np.float32)
    else:
        batch = preprocess_image(Path(args.input).read_bytes(), info["preprocessing"])[None]
    vm = VirtualMachine(tvm.runtime.load_module(args.model), tvm.cpu())
    names = info.get("class_names") or []
    segmentation = (info.get("task") or {}).get("kind") == "segmentation"
    all_logits = []
    for i, x in enumerate(batch):
        logits = vm["main"](tvm.runtime.tensor(np.ascontiguousarray(x[None]))).numpy()[0]
        all_logits.append(logits)
        if segmentation:
            print(json.dumps(write_class_map(logits, i, Path(args.masks))), flush=True)
            continue
        top = np.argsort(-logits, kind="stable")[: args.top_k]
        print(json.dumps({"sample": i, "top_k": [
            {"class": int(c), "name": names[c] if c < len(names) else str(c), "logit": float(logits[c])} for c in top]}),
              flush=True)
    if args.output:
        np.save(args.output, np.stack(all_logits).astype(np.float32))
    return 0


def write_class_map(logits, sample: int, masks: Path) -> dict:
    """The argmax of (K, H, W) logits as DIR/NNNN.png, 8-bit greyscale; the sample's JSON line."""
    import numpy as np

    classes = logits.argmax(0).astype(np.uint8)
    height, width = classes.shape
    raw = b"".join(b"\0" + row.tobytes() for row in classes)  # filter type 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", binascii.crc32(kind + data))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    masks.mkdir(parents=True, exist_ok=True)
    path = masks / f"{sample:04d}.png"
    path.write_bytes(png)
    return {"sample": sample, "mask": str(path), "height": height, "width": width,
            "class_pixels": np.bincount(classes.ravel(), minlength=logits.shape[0]).tolist()}


if __name__ == "__main__":
    sys.exit(main())
