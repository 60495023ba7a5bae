#!/usr/bin/env python3
"""OpenVINO server runner, made by `appliance package --target x86_64-openvino`: images in, top-k out.

    python3 python/run.py --input image.png|batch.npy [--top-k K] [--output logits.npy] [--masks DIR]
    python3 python/run.py --selftest [--json]       the golden samples against the host's outputs
    python3 python/run.py --bench [--runs N] [--hint LATENCY|THROUGHPUT] [--json]

Needs only the openvino and numpy wheels (the bundle's `openvino` profile) and, for images,
preprocessing.py beside it (a verbatim copy of the host's). The IR runs in float32 arithmetic
(INFERENCE_PRECISION_HINT f32): OpenVINO's default on CPUs with AVX-512 BF16 or AMX is bfloat16,
about 1e-3 relative off, which no check here would allow. `appliance compile --target openvino`
times the build with the functions below, so the host's figures and the server's are made alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
HINTS = ("LATENCY", "THROUGHPUT")
INFERENCE_PRECISION = "f32"


def compile_ir(xml, hint: str = "LATENCY", threads: int | None = None):
    """The IR compiled for this host's CPU under an OpenVINO performance hint (threads: all if None)."""
    import openvino as ov

    config = {"PERFORMANCE_HINT": hint, "INFERENCE_PRECISION_HINT": INFERENCE_PRECISION}
    if threads:
        config["INFERENCE_NUM_THREADS"] = int(threads)
    core = ov.Core()
    return core.compile_model(core.read_model(str(xml)), "CPU", config)


def infer(compiled, x):
    """Outputs for x (N, C, H, W), fed in batches of the IR's fixed batch size."""
    import numpy as np

    batch = compiled.inputs[0].get_shape()[0]
    request = compiled.create_infer_request()
    outs = []
    for i in range(0, len(x), batch):
        chunk = x[i:i + batch]
        short = batch - len(chunk)
        if short:  # a last partial batch is padded, its padding dropped again
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], short, 0)])
        result = request.infer({0: np.ascontiguousarray(chunk, dtype=np.float32)})
        outs.append(np.array(result[compiled.outputs[0]])[:batch - short])
    return np.concatenate(outs)


def latency(compiled, runs: int = 20, warmup: int = 3, budget_s: float | None = None) -> dict:
    """Per-call milliseconds of one synchronous request (median, p90, p99), as a LATENCY-hint server sees them."""
    import numpy as np

    shape = list(compiled.inputs[0].get_shape())
    x = np.zeros(shape, np.float32)
    request = compiled.create_infer_request()
    for _ in range(warmup):
        request.infer({0: x})
    times, start = [], time.perf_counter()
    while len(times) < runs and (budget_s is None or len(times) < 3 or time.perf_counter() - start < budget_s):
        t = time.perf_counter()
        request.infer({0: x})
        times.append((time.perf_counter() - t) * 1000)
    times.sort()
    median, p99 = statistics.median(times), times[int(0.99 * (len(times) - 1))]
    return {"runs": len(times), "median_ms": round(median, 4), "p90_ms": round(times[int(0.9 * (len(times) - 1))], 4),
            "p99_ms": round(p99, 4), "fluctuation": round((p99 - median) / median, 4) if median > 0 else 0.0}


def throughput(compiled, seconds: float = 1.0) -> dict:
    """Inferences per second with as many requests in flight as the compiled model asks for
    (OPTIMAL_NUMBER_OF_INFER_REQUESTS, the THROUGHPUT hint's streams), for about `seconds`."""
    import numpy as np
    import openvino as ov

    shape = list(compiled.inputs[0].get_shape())
    x = np.zeros(shape, np.float32)
    requests = int(compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS"))
    queue = ov.AsyncInferQueue(compiled, requests)
    for _ in range(requests):  # warm-up: every request once
        queue.start_async({0: x})
    queue.wait_all()
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(requests):
            queue.start_async({0: x})
        queue.wait_all()
        done += requests
    elapsed = time.perf_counter() - start
    return {"requests": requests, "streams": int(compiled.get_property("NUM_STREAMS")),
            "inferences_per_s": round(done * shape[0] / elapsed, 2), "seconds": round(elapsed, 2)}


def selftest(root: Path, compiled) -> dict:
    """The golden samples (selftest/) against the host's outputs recorded at packaging, gated as
    model.json's selftest says (max |diff| allowed, top-1 or per-pixel agreement)."""
    import numpy as np

    entry = json.loads((root / "model.json").read_text())["selftest"]
    x, expected = np.load(root / entry["inputs"]), np.load(root / entry["expected"])
    got = infer(compiled, x)
    diff = float(np.abs(got.astype(np.float64) - expected).max()) if got.shape == expected.shape else None
    result = {"runner": "python/run.py --selftest (OpenVINO)", "samples": int(len(x)), "max_abs_diff": diff,
              "allowed_abs_diff": float(entry["max_abs_diff"])}
    if diff is None:
        return {**result, "error": f"outputs {list(got.shape)}, expected {list(expected.shape)}", "passed": False}
    if "masks" in entry:
        agreement = float((got.argmax(1) == np.load(root / entry["masks"])).mean())
        result.update({"pixel_agreement": agreement, "passed": diff <= entry["max_abs_diff"]
                       and agreement >= entry["min_pixel_agreement"]})
    else:
        agreement = float((got.argmax(1) == expected.argmax(1)).mean())
        result.update({"top1_agreement": agreement, "passed": diff <= entry["max_abs_diff"]
                       and agreement >= entry["min_top1_agreement"]})
    return result


def write_class_map(logits, sample: int, masks: Path) -> dict:
    """The argmax of (K, H, W) logits as DIR/NNNN.png (8-bit greyscale), as the edge runners write it."""
    import binascii
    import struct
    import zlib

    import numpy as np

    classes = logits.argmax(0).astype(np.uint8)
    height, width = classes.shape
    raw = b"".join(b"\0" + row.tobytes() for row in classes)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", binascii.crc32(kind + data))

    masks.mkdir(parents=True, exist_ok=True)
    path = masks / f"{sample:04d}.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return {"sample": sample, "mask": str(path), "height": height, "width": width}


def classify(args, info: dict, compiled) -> None:
    import numpy as np

    if args.input.endswith(".npy"):
        batch = np.load(args.input).astype(np.float32)
    else:
        sys.path.insert(0, str(HERE))
        from preprocessing import preprocess_image

        batch = preprocess_image(Path(args.input).read_bytes(), info["preprocessing"])[None]
    logits = infer(compiled, batch)
    names = info.get("class_names") or []
    segmentation = (info.get("task") or {}).get("kind") == "segmentation"
    for i, row in enumerate(logits):
        if segmentation:
            print(json.dumps(write_class_map(row, i, Path(args.masks))), flush=True)
            continue
        top = np.argsort(-row, kind="stable")[: args.top_k]
        print(json.dumps({"sample": i, "top_k": [{"class": int(c), "name": names[c] if c < len(names) else str(c),
                                                  "logit": float(row[c])} for c in top]}), flush=True)
    if args.output:
        np.save(args.output, logits.astype(np.float32))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", help="an image, or a preprocessed (N, C, H, W) float32 .npy")
    parser.add_argument("--selftest", action="store_true")
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--output", help="also write all outputs as a float32 .npy")
    parser.add_argument("--masks", default="masks", help="segmentation: the folder of the class maps (NNNN.png)")
    parser.add_argument("--hint", choices=HINTS, default="LATENCY", help="OpenVINO performance hint")
    parser.add_argument("--threads", type=int, help="inference threads (default: all cores)")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--root", default=str(HERE.parent), help="the unpacked package (default: this file's ../)")
    args = parser.parse_args()
    root = Path(args.root)
    info = json.loads((root / "model.json").read_text())
    compiled = compile_ir(root / info["ir"]["xml"], args.hint, args.threads)
    if args.selftest:
        result = selftest(root, compiled)
        print(json.dumps(result) if args.json else
              f"selftest: {result['samples']} golden samples, max diff {result['max_abs_diff']} "
              f"(allowed {result['allowed_abs_diff']:.3g}): {'PASS' if result['passed'] else 'FAIL'}")
        return 0 if result["passed"] else 3
    if args.bench:
        result = {"hint": args.hint, **latency(compiled, args.runs, args.warmup)}
        if args.hint == "THROUGHPUT":
            result["throughput"] = throughput(compiled)
        print(json.dumps(result) if args.json else
              f"bench ({args.hint}): {result['runs']} runs, median {result['median_ms']:.3f} ms, "
              f"p90 {result['p90_ms']:.3f} ms")
        return 0
    if not args.input:
        parser.error("give --input, --selftest or --bench")
    classify(args, info, compiled)
    return 0


if __name__ == "__main__":
    sys.exit(main())
