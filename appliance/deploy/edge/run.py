#!/usr/bin/env python3
"""Python edge runner, made by `appliance package`: an image in, the top-k classes out.

    python3 run.py --input image.png [--top-k K] [--model ../model.so] [--output logits.npy] [--masks DIR]
        [--runtime tvm|onnxruntime]
    python3 run.py --selftest

Decodes and preprocesses the image with preprocessing.py (a verbatim copy of the host's), runs
the model on the runtime model.json names (`appliance compile` chose it: the TVM library through the
runtime-only TVM, no compiler needed, or onnxruntime on reference/model.onnx where our build is the
slower) and prints one JSON line. --selftest runs the golden samples (selftest/) and exits 1 unless
they agree with the host's outputs within model.json's tolerance, as `bin/run --selftest` does.
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
    parser.add_argument("--input")
    parser.add_argument("--selftest", action="store_true", help="the golden samples against the host's outputs")
    parser.add_argument("--runtime", choices=("tvm", "onnxruntime"), help="default: model.json's runtime")
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--model", help="default: ../model.so (tvm), model.json's onnx_model (onnxruntime)")
    parser.add_argument("--info", default=str(HERE.parent / "model.json"))
    parser.add_argument("--output", help="also write all logits as a float32 .npy (N, classes) or (N, K, H, W)")
    parser.add_argument("--masks", default="masks", help="segmentation: the folder of the class maps (NNNN.png)")
    args = parser.parse_args()

    import numpy as np

    from preprocessing import preprocess_image

    info = json.loads(Path(args.info).read_text())
    runtime = args.runtime or info.get("runtime", "tvm")
    default = "model.so" if runtime == "tvm" else info.get("onnx_model", "reference/model.onnx")
    model = infer_function(runtime, args.model or str(HERE.parent / default))
    if args.selftest:
        return selftest(model, info, runtime)
    if not args.input:
        parser.error("--input is required (or --selftest)")
    if args.input.endswith(".npy"):
        batch = np.load(args.input).astype(np.float32)
    else:
        batch = preprocess_image(Path(args.input).read_bytes(), info["preprocessing"])[None]
    names = info.get("class_names") or []
    segmentation = (info.get("task") or {}).get("kind") == "segmentation"
    all_logits = []
    for i, x in enumerate(batch):
        logits = model(np.ascontiguousarray(x[None]))[0]
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


def infer_function(runtime: str, path: str):
    """x (1, C, H, W) float32 -> outputs, on the TVM library or on onnxruntime (the device's cores)."""
    if runtime == "onnxruntime":
        import onnxruntime

        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        return lambda x: session.run(None, {name: x})[0]
    import tvm
    from tvm.runtime.vm import VirtualMachine

    vm = VirtualMachine(tvm.runtime.load_module(path), tvm.cpu())
    return lambda x: vm["main"](tvm.runtime.tensor(x)).numpy()


def selftest(model, info: dict, runtime: str) -> int:
    """The golden samples against the host's outputs: one JSON line; 0 when within model.json's tolerance."""
    import numpy as np

    test = info["selftest"]
    x, expected = np.load(HERE.parent / test["inputs"]), np.load(HERE.parent / test["expected"])
    got = np.concatenate([model(np.ascontiguousarray(x[i:i + 1])) for i in range(len(x))])
    diff = float(np.abs(got.astype(np.float64) - expected).max())
    agreement = float((got.argmax(1) == expected.argmax(1)).mean())
    need = test.get("min_top1_agreement", test.get("min_pixel_agreement", 1.0))
    passed = diff <= test["max_abs_diff"] and agreement >= need
    print(json.dumps({"selftest": "python/run.py", "runtime": runtime, "samples": int(len(x)), "max_abs_diff": diff,
                      "allowed_abs_diff": test["max_abs_diff"], "agreement": agreement, "passed": passed}), flush=True)
    return 0 if passed else 1


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
