"""Estimated cycles per inference of aarch64 builds on Cortex-A76 and Cortex-A55, with no ARM device.

    PYTHONPATH=. .venv/bin/python benchmarks/arm_cycles.py [--models resnet18 mobilenet_v2] [--size 224]
        [--routes tvm_fp32 tvm_int8 tvm_int8_dotprod ort_fp32 ort_int8] [--json out.json] [--by-function [N]]

--by-function: for the TVM routes, also the estimated cycles per function of model.so (block addresses
mapped through the guest's /proc/self/maps to the library's symbols, `aarch64-linux-gnu-nm`), the N
dearest printed (default 25); code outside model.so is grouped by the file it lies in.

Each route runs once at batch 1 under qemu-aarch64 (`-cpu cortex-a76`: ARMv8.2 with dotprod, no
i8mm or SVE, so onnxruntime picks the kernels such a core gets) and is costed by the product's
estimator, appliance/deploy/edge/cycles.py (the tbcount TCG plugin counts every executed block
between two markers around one inference after a warm-up call; llvm-mca 16 costs each unique block
on `-mcpu=cortex-a76` / `-mcpu=cortex-a55`). Deterministic: one run per build. Costs are cached per
unique block (--cache, default ~/.cache/appliance/arm-cycles).

Routes, from the same untrained model (latency does not depend on the weights): TVM FP32
(`appliance compile --target aarch64`), TVM int8 (the S8S8 QDQ model, int8 compute) for `aarch64` and
`aarch64-dotprod`, and onnxruntime (aarch64 manylinux wheel of the edge wheelhouse, one thread,
all graph optimisations) on the FP32 and the S8S8 QDQ INT8 ONNX models, under the edge sysroot's
arm64 Python 3.11. What the model cannot see (caches, memory bandwidth, threads): benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from collections import Counter

from appliance.deploy.edge.cycles import (CLOCKS_HZ, LLVM_MCA, QEMU_CPU, CostCache, build_plugin, count_model,
                                          default_cache, estimate, guest_python, installed_qemu_version)

ROUTES = ("tvm_fp32", "tvm_int8", "tvm_int8_dotprod", "ort_fp32", "ort_int8")


def build_models(arch: str, size: int, work: Path, routes, log=print) -> dict:
    """{route: (runtime, model file)}: the untrained model exported, quantized (S8S8 QDQ, per-tensor, as
    benchmarks/deploy.py) and compiled for the aarch64 targets the routes name."""
    import numpy as np

    from appliance.deploy.compiler.driver import compile_model
    from appliance.deploy.export import export_model
    from appliance.deploy.quantize import quantize_int8
    from appliance.models import ModelCard, build_model, save_trained_model

    save_trained_model(work / "model", build_model(arch, 1000), ModelCard(arch, 1000, 3, size))
    export_model(work, work / "export", batch=1, max_rel_error=1e-4)
    fp32, int8 = work / "export" / "model.onnx", work / "model.int8.onnx"
    calib = np.random.default_rng(0).standard_normal((8, 3, size, size)).astype(np.float32)
    quantize_int8(fp32, int8, calib, "input", "minmax", per_channel=False)
    models = {"ort_fp32": ("ort", fp32), "ort_int8": ("ort", int8)}
    for route, target, source in (("tvm_fp32", "aarch64", fp32), ("tvm_int8", "aarch64", int8),
                                  ("tvm_int8_dotprod", "aarch64-dotprod", int8)):
        if route in routes:
            start = time.perf_counter()
            compile_model(source, target, work / route, log=lambda line: None)
            log(f"  {arch}: compiled {route} ({target}) in {time.perf_counter() - start:.0f} s")
            models[route] = ("tvm", work / route / "model.so")
    return {route: models[route] for route in routes}


def guest_maps(path: Path) -> list[tuple[int, int, int, str]]:
    """(start, end, file offset, file) of each mapping in a /proc/self/maps text, sorted by start."""
    maps = []
    for line in path.read_text().splitlines():
        fields = line.split(None, 5)
        start, end = (int(a, 16) for a in fields[0].split("-"))
        maps.append((start, end, int(fields[2], 16), fields[5].strip() if len(fields) > 5 else "[anon]"))
    return sorted(maps)


def library_symbols(library: Path) -> tuple[list[int], list[str]]:
    """(sorted addresses, names) of the functions in an aarch64 shared library: its symbols, and the
    targets of `bl` calls that have none (TVM emits a layer's compute function without a symbol and
    calls it from its named `__tvm_ffi_` wrapper: named "<caller> (callee)")."""
    done = subprocess.run(["aarch64-linux-gnu-nm", "--defined-only", "-n", str(library)], capture_output=True,
                          text=True, check=True)
    named = {}
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in "tTwW":
            named.setdefault(int(parts[0], 16), parts[2])
    code = subprocess.run(["aarch64-linux-gnu-objdump", "-d", "--no-show-raw-insn", str(library)], capture_output=True,
                          text=True, check=True).stdout
    # TVM's parallel loops are closures without a symbol whose address the named wrapper passes to the
    # runtime's parallel launch: adrp + add of an address in .text, or a direct bl.
    caller, callees, pages = "?", {}, {}
    sections = subprocess.run(["aarch64-linux-gnu-readelf", "-S", "-W", str(library)], capture_output=True, text=True,
                              check=True).stdout
    text = re.search(r"\.text\s+PROGBITS\s+([0-9a-f]+)\s+[0-9a-f]+\s+([0-9a-f]+)", sections)
    low, high = (int(text.group(1), 16), int(text.group(1), 16) + int(text.group(2), 16)) if text else (0, 0)
    for line in code.splitlines():
        head = re.match(r"^([0-9a-f]+) <([^>]+)>:$", line)
        if head:
            caller, pages = head.group(2), {}
            continue
        insn = re.match(r"^\s+[0-9a-f]+:\s+(\w+)\s+(.*)$", line)
        if not insn:
            continue
        op, args = insn.groups()
        target = None
        if op == "adrp":
            reg, page = re.match(r"(\w+), ([0-9a-f]+)", args).groups()
            pages[reg] = int(page, 16)
        elif op == "add" and (m := re.match(r"(\w+), (\w+), #0x([0-9a-f]+)$", args)) and m.group(2) in pages:
            target = pages.pop(m.group(2)) + int(m.group(3), 16)
        elif op == "bl" and (m := re.match(r"([0-9a-f]+) ", args)):
            target = int(m.group(1), 16)
        if target is not None and target not in named and low <= target < high:
            callees.setdefault(target, f"{caller} (callee)")
    functions = sorted({**callees, **named}.items())
    return [a for a, _ in functions], [n for _, n in functions]


def by_function(counts: Counter, maps: list, library: Path, cache: Path) -> list[dict]:
    """Estimated cycles per function of library (per file outside it), dearest first."""
    codes = sorted({code for _, code in counts})
    costs = {cpu: CostCache(cache, cpu).cost(codes) for cpu in CLOCKS_HZ}
    starts = [m[0] for m in maps]
    bias = next((m[0] - m[2] for m in maps if Path(m[3]).resolve() == library.resolve() and m[2] == 0), None)
    addrs, names = library_symbols(library)
    rows: dict[str, dict] = {}
    for (vaddr, code), n in counts.items():
        i = bisect.bisect_right(starts, vaddr) - 1
        where = maps[i][3] if i >= 0 and vaddr < maps[i][1] else "[unmapped]"
        if bias is not None and Path(where).resolve() == library.resolve():
            j = bisect.bisect_right(addrs, vaddr - bias) - 1
            name = names[j] if j >= 0 else "model.so:?"
        else:
            name = f"[{Path(where).name}]"
        row = rows.setdefault(name, {"function": name, "instructions": 0, **{cpu: 0.0 for cpu in CLOCKS_HZ}})
        row["instructions"] += n * len(code) // 8
        for cpu in CLOCKS_HZ:
            row[cpu] += n * costs[cpu][code]
    return sorted(rows.values(), key=lambda r: -r["cortex-a76"])


def function_table(arch: str, route: str, rows: list[dict], top: int) -> str:
    total = sum(r["cortex-a76"] for r in rows) or 1.0
    lines = [f"{arch} {route}: estimated cycles by function ({top} dearest of {len(rows)})",
             "| function | cortex-a76 Mcycles | share | cortex-a55 Mcycles | M instructions |", "|---|---|---|---|---|"]
    for r in rows[:top]:
        lines.append(f"| {r['function'][:90]} | {r['cortex-a76'] / 1e6:.2f} | {r['cortex-a76'] / total * 100:.1f} % | "
                     f"{r['cortex-a55'] / 1e6:.2f} | {r['instructions'] / 1e6:.2f} |")
    return "\n".join(lines)


def run_model(arch: str, size: int, routes, work: Path, guest, cache: Path, log=print, functions: int = 0) -> dict:
    models = build_models(arch, size, work, routes, log)
    result = {}
    for route, (runtime, path) in models.items():
        start = time.perf_counter()
        maps = work / f"{route}.maps" if functions and runtime == "tvm" else None
        counts = count_model(runtime, path, (1, 3, size, size), guest, work, maps=maps)
        counted = time.perf_counter() - start
        per_block = counts
        if maps is not None:
            per_block = Counter()
            for (_, code), n in counts.items():
                per_block[code] += n
        result[route] = estimate(per_block, cache=cache, progress=lambda line: log(f"  {arch} {route}: {line}"))
        if maps is not None:
            result[route]["functions"] = by_function(counts, guest_maps(maps), path, cache)
            log(function_table(arch, route, result[route]["functions"], functions))
        a76, a55 = result[route]["cortex-a76"], result[route]["cortex-a55"]
        log(f"  {arch} {route}: {result[route]['instructions'] / 1e6:.1f} M instructions in "
            f"{result[route]['blocks']} unique blocks (counted in {counted:.0f} s under qemu); cortex-a76 "
            f"{a76['cycles'] / 1e6:.1f} M cycles = {a76['ms']:.2f} ms; cortex-a55 {a55['cycles'] / 1e6:.1f} M cycles "
            f"= {a55['ms']:.2f} ms")
    return result


def table(results: dict) -> str:
    """Markdown table: estimated cycles (M) and ms per cpu, and each route's ratio to ORT FP32 and INT8."""
    head = ["model", "route", *(f"{cpu} Mcycles ({CLOCKS_HZ[cpu] / 1e9:g} GHz ms)" for cpu in CLOCKS_HZ),
            "x ORT FP32 (a76)", "x ORT INT8 (a76)", "x ORT FP32 (a55)"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arch, routes in results.items():
        for route, r in routes.items():
            cells = [arch, route, *(f"{r[cpu]['cycles'] / 1e6:.1f} ({r[cpu]['ms']:.2f})" for cpu in CLOCKS_HZ)]
            for base, cpu in (("ort_fp32", "cortex-a76"), ("ort_int8", "cortex-a76"), ("ort_fp32", "cortex-a55")):
                b = routes.get(base)
                cells.append(f"{r[cpu]['cycles'] / b[cpu]['cycles']:.2f}" if b else "-")
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2"])
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--routes", nargs="+", default=list(ROUTES), choices=ROUTES)
    parser.add_argument("--cache", type=Path, default=None, help="llvm-mca costs per block (default "
                        "~/.cache/appliance/arm-cycles)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--by-function", type=int, nargs="?", const=25, default=0, metavar="N",
                        help="TVM routes: estimated cycles per function of model.so, the N dearest (default 25)")
    args = parser.parse_args()
    cache = args.cache or default_cache()
    start = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory(prefix="arm-cycles-") as tmp:
        guest = guest_python(Path(tmp) / "guest")
        print(f"plugin {build_plugin(cache).name} for qemu {installed_qemu_version()} (-cpu {QEMU_CPU}); "
              f"{LLVM_MCA}; clocks {', '.join(f'{c} {h / 1e9:g} GHz' for c, h in CLOCKS_HZ.items())}", flush=True)
        for i, arch in enumerate(args.models):
            print(f"[{i + 1}/{len(args.models)}] {arch} at {args.size} px: {', '.join(args.routes)}", flush=True)
            work = Path(tmp) / arch
            work.mkdir()
            results[arch] = run_model(arch, args.size, args.routes, work, guest, cache,
                                      log=lambda line: print(line, flush=True), functions=args.by_function)
            if args.json:  # after every model: a long run keeps what it has
                args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
