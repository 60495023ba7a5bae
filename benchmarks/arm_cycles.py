"""Estimated cycles per inference of aarch64 builds on Cortex-A76 and Cortex-A55, with no ARM device.

    PYTHONPATH=. .venv/bin/python benchmarks/arm_cycles.py [--models resnet18 mobilenet_v2] [--size 224]
        [--routes tvm_fp32 tvm_int8 tvm_int8_dotprod ort_fp32 ort_int8] [--json out.json]

Each route runs once at batch 1 under qemu-aarch64 (`-cpu cortex-a76`: ARMv8.2 with dotprod, no
i8mm or SVE, so onnxruntime picks the kernels such a core gets) with the tbcount TCG plugin
(qemu_plugin/tbcount.c, built here against the qemu-plugin.h of the installed qemu), which counts
every executed translation block between two markers the guest driver (qemu_plugin/driver.py)
sets around one inference after a warm-up call. Every unique block is disassembled (llvm-mc) and
costed by llvm-mca (LLVM 16, `-mcpu=cortex-a76` / `-mcpu=cortex-a55`) as its steady-state cycles
per pass (100 iterations / 100); the estimate is sum(executions x cycles per pass). Deterministic:
one run per build. Costs are cached per unique block (--cache, default ~/.cache/appliance/arm-cycles).

Routes, from the same untrained model (latency does not depend on the weights): TVM FP32
(`appliance compile --target aarch64`), TVM int8 (the S8S8 QDQ model, int8 compute) for `aarch64` and
`aarch64-dotprod`, and onnxruntime (aarch64 manylinux wheel of the edge wheelhouse, one thread,
all graph optimisations) on the FP32 and the S8S8 QDQ INT8 ONNX models, under the edge sysroot's
arm64 Python 3.11. What the model cannot see (caches, memory bandwidth, threads): benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROJECT = HERE.parent
PLUGIN_SOURCE = HERE / "qemu_plugin" / "tbcount.c"
DRIVER = HERE / "qemu_plugin" / "driver.py"
LLVM_MC, LLVM_MCA = "llvm-mc-16", "llvm-mca-16"
QEMU_CPU = "cortex-a76"
# Stated clocks: Raspberry Pi 5 (Cortex-A76 at 2.4 GHz); Cortex-A55 at 1.8 GHz (e.g. RK3588's little cores).
CLOCKS_HZ = {"cortex-a76": 2.4e9, "cortex-a55": 1.8e9}
MCA_ITERATIONS = 100
SENTINEL = "brk\t#0xbeef"  # between blocks in one llvm-mc run, to split its output again
GUEST_WHEELS = ("numpy-", "ml_dtypes-", "apache_tvm-", "apache_tvm_ffi-", "onnxruntime-", "protobuf-",
                "typing_extensions-", "flatbuffers-", "packaging-")
CORTEX_A76_CPUINFO = ("processor\t: 0\nBogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 "
                      "atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp\nCPU implementer\t: 0x41\n"
                      "CPU architecture: 8\nCPU variant\t: 0x4\nCPU part\t: 0xd0b\nCPU revision\t: 1\n\n")
ROUTES = ("tvm_fp32", "tvm_int8", "tvm_int8_dotprod", "ort_fp32", "ort_int8")


class ToolMissing(RuntimeError):
    pass


def default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "appliance" / "arm-cycles"


def installed_qemu_version() -> str:
    done = subprocess.run(["dpkg-query", "-W", "-f=${source:Version}", "qemu-user"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def qemu_header_dir() -> Path:
    """The folder with qemu-plugin.h of the installed qemu (qemu_plugin/fetch_header.sh puts it there)."""
    candidates = [Path(os.environ["ARM_CYCLES_QEMU_HEADER"])] if os.environ.get("ARM_CYCLES_QEMU_HEADER") else []
    candidates += [PROJECT / "wheelhouse" / "qemu-plugin", Path(sys.prefix).parent / "wheelhouse" / "qemu-plugin"]
    version = installed_qemu_version()
    for c in candidates:
        if (c / "qemu-plugin.h").is_file():
            made_for = (c / "VERSION").read_text().strip() if (c / "VERSION").is_file() else version
            if made_for != version:
                raise ToolMissing(f"{c / 'qemu-plugin.h'}: made for qemu {made_for}, installed is {version}; run "
                                  "benchmarks/qemu_plugin/fetch_header.sh again")
            return c
    raise ToolMissing("qemu-plugin.h: not found (run benchmarks/qemu_plugin/fetch_header.sh on a connected host, "
                      "or installer/bootstrap.sh --system)")


def build_plugin(cache: Path) -> Path:
    """libtbcount.so in the cache, rebuilt when its source, the header or qemu changes."""
    header = qemu_header_dir()
    key = hashlib.sha256(PLUGIN_SOURCE.read_bytes() + (header / "qemu-plugin.h").read_bytes()
                         + installed_qemu_version().encode()).hexdigest()[:16]
    lib = cache / f"libtbcount-{key}.so"
    if lib.exists():
        return lib
    glib = subprocess.run(["pkg-config", "--cflags", "--libs", "glib-2.0"], capture_output=True, text=True)
    if glib.returncode != 0:
        raise ToolMissing("glib-2.0: pkg-config finds no development files (apt-get install libglib2.0-dev)")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_suffix(".tmp")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-Wall", f"-I{header}", str(PLUGIN_SOURCE), "-o", str(tmp),
                    *glib.stdout.split()], check=True)
    tmp.replace(lib)
    return lib


def read_snapshot(path: Path) -> Counter:
    """{instruction bytes (hex): executions} summed over the blocks of one snapshot file."""
    counts = Counter()
    for line in path.read_text().splitlines():
        n, _, code = line.split()
        counts[code] += int(n)
    return counts


def count_blocks(argv: list[str], work: Path, *, sysroot: str, env=None, timeout: float = 7200) -> Counter:
    """{block bytes: executions between the guest's two markers} for `qemu-aarch64 ... argv`."""
    qemu = shutil.which("qemu-aarch64")
    if qemu is None:
        raise ToolMissing("qemu-aarch64: not found (installer/bootstrap.sh --system)")
    out = work / f"blocks-{time.monotonic_ns()}.txt"
    cmd = [qemu, "-cpu", QEMU_CPU, "-L", sysroot, "-plugin", f"{build_plugin(default_cache())},out={out}", *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{argv[0]}: failed under qemu (exit {done.returncode}): {tail}")
    first, second = Path(f"{out}.1"), Path(f"{out}.2")
    if not (first.exists() and second.exists()):
        raise RuntimeError(f"{argv[0]}: the guest set no two markers (lseek(-1, 0x5eed0a11, 0))")
    before, after = read_snapshot(first), read_snapshot(second)
    return Counter({code: n - before.get(code, 0) for code, n in after.items() if n > before.get(code, 0)})


def disassemble(codes: list[str]) -> dict[str, list[str]]:
    """{block bytes: its instructions as llvm-mc prints them}; one llvm-mc run, blocks split by a sentinel."""
    sentinel = bytes.fromhex("e0dd37d4")  # brk #0xbeef
    text = "\n".join(" ".join(f"0x{b:02x}" for b in bytes.fromhex(code) + sentinel) for code in codes)
    done = subprocess.run([LLVM_MC, "--disassemble", "-triple=aarch64", "-mattr=+v8.2a,+dotprod,+fullfp16,+rcpc"],
                          input=text, capture_output=True, text=True)
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip() and not line.strip().startswith(".")]
    out, block, it = {}, [], iter(codes)
    for line in lines:
        if line == SENTINEL:
            out[next(it)] = block
            block = []
        else:
            block.append(line)
    if len(out) != len(codes):
        raise RuntimeError(f"{LLVM_MC}: split {len(out)} of {len(codes)} blocks")
    return out


def assemblable(lines: list[str]) -> set[int]:
    """Indexes of the lines llvm-mc cannot assemble again (they are left out of the costing)."""
    done = subprocess.run([LLVM_MC, "-triple=aarch64", "-mattr=+v8.2a,+dotprod,+fullfp16,+rcpc", "-o", "/dev/null"],
                          input="\n".join(lines) + "\n", capture_output=True, text=True)
    return {int(m.group(1)) - 1 for m in re.finditer(r"<stdin>:(\d+):\d+: error", done.stderr)}


def mca_cycles(blocks: dict[str, list[str]], cpu: str) -> dict[str, float]:
    """{block: llvm-mca's cycles per pass on cpu}, all blocks as code regions of one llvm-mca run."""
    keys = list(blocks)
    lines, owner = [], []
    for i, key in enumerate(keys):
        lines.append(f"# LLVM-MCA-BEGIN r{i}")
        owner.append(None)
        for insn in blocks[key]:
            # llvm-mca 16 gives every call a fixed 100-cycle latency ("not correctly modeled"): cost a
            # call as the branch it is (bl -> b, blr -> br: the same branch unit); the callee's blocks
            # are counted on their own.
            lines.append(re.sub(r"^bl(r?)\b", lambda m: "br" if m.group(1) else "b", insn))
            owner.append(i)
        lines.append("# LLVM-MCA-END")
        owner.append(None)
    bad = assemblable(lines)
    kept = [line for j, line in enumerate(lines) if j not in bad]
    for _ in range(100):
        done = subprocess.run([LLVM_MCA, "-mtriple=aarch64", f"-mcpu={cpu}", f"-iterations={MCA_ITERATIONS}",
                               "-instruction-info=0", "-resource-pressure=0"], input="\n".join(kept) + "\n",
                              capture_output=True, text=True)
        unsupported = re.search(r"unsupported instruction.*\nnote: instruction:\s+(\S+)", done.stderr)
        if unsupported is None:
            break
        # No scheduling data for this mnemonic on cpu (LLVM 16's Cortex-A57-based model lacks e.g. the
        # LSE atomics): left out of the costing, like an unassemblable line.
        mnemonic = unsupported.group(1)
        kept = [line for line in kept if line.split(None, 1)[0] != mnemonic]
    if done.returncode != 0 or " error: " in done.stderr:
        errors = [line for line in done.stderr.splitlines() if " error: " in line or line.startswith("error")]
        raise RuntimeError(f"{LLVM_MCA} -mcpu={cpu}: {(errors or ['exit ' + str(done.returncode)])[0]}")
    cycles = {}
    for m in re.finditer(r"Code Region - r(\d+)\s+Iterations:\s+(\d+)\s+Instructions:\s+\d+\s+Total Cycles:\s+(\d+)",
                         done.stdout):
        cycles[keys[int(m.group(1))]] = int(m.group(3)) / int(m.group(2))
    for key in keys:  # a region left empty (all its lines unassemblable) costs nothing; llvm-mca skips it
        cycles.setdefault(key, 0.0)
    return cycles


class CostCache:
    """llvm-mca cycles per pass of each block, per cpu, in a JSON file keyed by the block's bytes."""

    def __init__(self, directory: Path, cpu: str):
        self.path = directory / f"mca-{cpu}-llvm16.json"
        self.cpu = cpu
        self.costs = json.loads(self.path.read_text()) if self.path.exists() else {}

    def cost(self, codes, progress=None) -> dict[str, float]:
        missing = [c for c in codes if c not in self.costs]
        for start in range(0, len(missing), 2000):
            chunk = missing[start:start + 2000]
            self.costs.update(mca_cycles(disassemble(chunk), self.cpu))
            if progress:
                progress(f"llvm-mca {self.cpu}: {min(start + 2000, len(missing))}/{len(missing)} new blocks")
        if missing:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.costs))
            tmp.replace(self.path)
        return {c: self.costs[c] for c in codes}


def estimate(counts: Counter, cpus=tuple(CLOCKS_HZ), cache: Path | None = None, progress=None) -> dict:
    """{cpu: {"cycles", "ms" at the stated clock}} plus the executed instruction and block counts."""
    codes = sorted(counts)
    result = {"instructions": sum(n * len(c) // 8 for c, n in counts.items()), "blocks": len(codes)}
    for cpu in cpus:
        per_pass = CostCache(cache or default_cache(), cpu).cost(codes, progress)
        cycles = sum(counts[c] * per_pass[c] for c in codes)
        result[cpu] = {"cycles": cycles, "ms": cycles / CLOCKS_HZ.get(cpu, 1e9) * 1e3,
                       "clock_ghz": CLOCKS_HZ.get(cpu, 1e9) / 1e9}
    return result


def wheelhouse(name: str) -> Path:
    for c in (PROJECT / "wheelhouse" / name, Path(sys.prefix).parent / "wheelhouse" / name):
        if c.is_dir() and any(c.iterdir()):
            return c
    raise ToolMissing(f"wheelhouse/{name}: missing (installer/bootstrap.sh --edge-wheels --edge-sysroot)")


def guest_python(into: Path) -> tuple[Path, dict]:
    """(the arm64 sysroot with python3.11, the environment for the driver): Debian's arm64 .debs of the
    edge sysroot unpacked with dpkg -x, the edge wheels (TVM runtime, onnxruntime, numpy) on PYTHONPATH."""
    sysroot, site = into / "sysroot", into / "site"
    if not (sysroot / "usr" / "bin" / "python3.11").exists():
        sysroot.mkdir(parents=True, exist_ok=True)
        for deb in sorted(wheelhouse("edge-sysroot-arm64").glob("*.deb")):
            subprocess.run(["dpkg", "-x", str(deb), str(sysroot)], check=True)
        wheels = sorted(wheelhouse("edge-aarch64").glob("*.whl"))
        for prefix in GUEST_WHEELS:
            wheel = next((w for w in wheels if w.name.startswith(prefix)), None)
            if wheel is None:
                raise ToolMissing(f"wheelhouse/edge-aarch64: no {prefix.rstrip('-')} wheel")
            with zipfile.ZipFile(wheel) as z:  # the TVM compiler library is not needed with TVM_USE_RUNTIME_LIB
                z.extractall(site, [n for n in z.namelist() if not n.endswith("libtvm_compiler.so")])
    # qemu-user 7.2 shows the guest the host's (x86) /proc/cpuinfo; onnxruntime's cpuinfo then finds no
    # ARM core and crashes. qemu looks up absolute paths under -L first: a Cortex-A76's lines, one core.
    (sysroot / "proc").mkdir(exist_ok=True)
    (sysroot / "proc" / "cpuinfo").write_text(CORTEX_A76_CPUINFO)
    (sysroot / "sys" / "devices" / "system" / "cpu").mkdir(parents=True, exist_ok=True)
    for name in ("possible", "present", "online"):
        (sysroot / "sys" / "devices" / "system" / "cpu" / name).write_text("0\n")
    env = {**os.environ, "PYTHONPATH": str(site), "TVM_USE_RUNTIME_LIB": "1", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
           "TVM_NUM_THREADS": "1"}
    return sysroot, env


def count_route(runtime: str, model: Path, shape, guest: tuple[Path, dict], work: Path) -> Counter:
    sysroot, env = guest
    argv = [str(sysroot / "usr" / "bin" / "python3.11"), "-s", str(DRIVER), runtime, str(model),
            "--shape", ",".join(map(str, shape))]
    return count_blocks(argv, work, sysroot=str(sysroot), env=env)


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


def run_model(arch: str, size: int, routes, work: Path, guest, cache: Path, log=print) -> dict:
    models = build_models(arch, size, work, routes, log)
    result = {}
    for route, (runtime, path) in models.items():
        start = time.perf_counter()
        counts = count_route(runtime, path, (1, 3, size, size), guest, work)
        counted = time.perf_counter() - start
        result[route] = estimate(counts, cache=cache, progress=lambda line: log(f"  {arch} {route}: {line}"))
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
                                      log=lambda line: print(line, flush=True))
            if args.json:  # after every model: a long run keeps what it has
                args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
