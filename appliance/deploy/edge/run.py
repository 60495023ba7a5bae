#!/usr/bin/env python3
"""Python edge runner, made by `appliance package`: an image in, the top-k classes out.

    python3 run.py --input image.png [--top-k K] [--model ../model.so] [--output logits.npy]

Decodes and preprocesses the image with preprocessing.py (a verbatim copy of the host's), runs
the TVM library through the runtime-only TVM (no compiler needed) and prints one JSON line.
A .npy input is taken as an already preprocessed (N, C, H, W) float32 tensor.
"""

import argparse
import json
import os
import sys
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
    parser.add_argument("--output", help="also write all logits as a float32 .npy (N, classes)")
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
    all_logits = []
    for i, x in enumerate(batch):
        logits = vm["main"](tvm.runtime.tensor(np.ascontiguousarray(x[None]))).numpy()[0]
        all_logits.append(logits)
        top = np.argsort(-logits, kind="stable")[: args.top_k]
        print(json.dumps({"sample": i, "top_k": [
            {"class": int(c), "name": names[c] if c < len(names) else str(c), "logit": float(logits[c])} for c in top]}),
              flush=True)
    if args.output:
        np.save(args.output, np.stack(all_logits).astype(np.float32))
    return 0


if __name__ == "__main__":
    sys.exit(main())
