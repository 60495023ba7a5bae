"""Estimated cycles per inference of an aarch64 build on Cortex-A76 and Cortex-A55, with no ARM device.

The build runs once at batch 1 under qemu-aarch64 (`-cpu cortex-a76`: ARMv8.2 with dotprod) with
the tbcount TCG plugin (tbcount.c beside this file, built against the qemu-plugin.h of the installed
qemu), which counts every executed translation block between two markers that the guest driver
(cycles_driver.py) sets around one inference after a warm-up call. Every unique block is
disassembled (llvm-mc) and costed by llvm-mca (LLVM 16, `-mcpu=cortex-a76` / `-mcpu=cortex-a55`) as
its steady-state cycles per pass; the estimate is sum(executions x cycles per pass). Deterministic:
one run per build. Costs are cached per unique block (~/.cache/appliance/arm-cycles).
What it cannot see (caches, memory bandwidth, threads): benchmarks/README.md. Shared by
`appliance compile` (compile.json's device_estimate), `appliance edge estimate` and
benchmarks/arm_cycles.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import time
import zipfile
from collections import Counter
from pathlib import Path

from appliance import beside_venv
from appliance.core.errors import EnvironmentProblem

HERE = Path(__file__).resolve().parent
PROJECT = HERE.parents[2]
PLUGIN_SOURCE = HERE / "tbcount.c"
DRIVER = HERE / "cycles_driver.py"
LLVM_MC, LLVM_MCA = "llvm-mc-16", "llvm-mca-16"
QEMU_CPU = "cortex-a76"
# Stated clocks: Raspberry Pi 5 (Cortex-A76 at 2.4 GHz); Cortex-A55 at 1.8 GHz (e.g. RK3588's little cores).
CLOCKS_HZ = {"cortex-a76": 2.4e9, "cortex-a55": 1.8e9}
MCA_ITERATIONS = 100
SENTINEL = "brk\t#0xbeef"  # between blocks in one llvm-mc run, to split its output again
TVM_WHEELS = ("numpy-", "ml_dtypes-", "apache_tvm-", "apache_tvm_ffi-", "typing_extensions-", "packaging-")
ORT_WHEELS = ("onnxruntime-", "protobuf-", "flatbuffers-")
CORTEX_A76_CPUINFO = ("processor\t: 0\nBogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 "
                      "atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp\nCPU implementer\t: 0x41\n"
                      "CPU architecture: 8\nCPU variant\t: 0x4\nCPU part\t: 0xd0b\nCPU revision\t: 1\n\n")
METHOD = "qemu-aarch64 block counts (tbcount plugin) costed by llvm-mca-16; L1 hits only, one thread"


def default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "appliance" / "arm-cycles"


def installed_qemu_version() -> str:
    done = subprocess.run(["dpkg-query", "-W", "-f=${source:Version}", "qemu-user"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def qemu_header_dir() -> Path:
    """The folder with qemu-plugin.h of the installed qemu (fetch_qemu_header.sh puts it there)."""
    candidates = [PROJECT / "wheelhouse" / "qemu-plugin", *beside_venv("wheelhouse/qemu-plugin", "ARM_CYCLES_QEMU_HEADER")]
    if os.environ.get("ARM_CYCLES_QEMU_HEADER"):
        candidates.insert(0, Path(os.environ["ARM_CYCLES_QEMU_HEADER"]))
    version = installed_qemu_version()
    for c in candidates:
        if (c / "qemu-plugin.h").is_file():
            made_for = (c / "VERSION").read_text().strip() if (c / "VERSION").is_file() else version
            if made_for != version:
                raise EnvironmentProblem(f"{c / 'qemu-plugin.h'}: made for qemu {made_for}, installed is {version}; "
                                         "run appliance/deploy/edge/fetch_qemu_header.sh again")
            return c
    raise EnvironmentProblem("qemu-plugin.h: not found (installer/bootstrap.sh --system fetches it)")


def check_tools() -> None:
    """One EnvironmentProblem line naming the first tool the estimate lacks."""
    for tool, hint in (("qemu-aarch64", "Debian's qemu-user"), (LLVM_MC, "Debian's llvm-16"),
                       (LLVM_MCA, "Debian's llvm-16"), ("gcc", "gcc"), ("pkg-config", "pkg-config")):
        if shutil.which(tool) is None:
            raise EnvironmentProblem(f"{tool}: not found (install {hint})")
    qemu_header_dir()


def build_plugin(cache: Path | None = None) -> Path:
    """libtbcount.so in the cache, rebuilt when its source, the header or qemu changes."""
    cache = cache or default_cache()
    header = qemu_header_dir()
    key = hashlib.sha256(PLUGIN_SOURCE.read_bytes() + (header / "qemu-plugin.h").read_bytes()
                         + installed_qemu_version().encode()).hexdigest()[:16]
    lib = cache / f"libtbcount-{key}.so"
    if lib.exists():
        return lib
    glib = subprocess.run(["pkg-config", "--cflags", "--libs", "glib-2.0"], capture_output=True, text=True)
    if glib.returncode != 0:
        raise EnvironmentProblem("glib-2.0: pkg-config finds no development files (apt-get install libglib2.0-dev)")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-Wall", f"-I{header}", str(PLUGIN_SOURCE), "-o", str(tmp),
                    *glib.stdout.split()], check=True)
    tmp.replace(lib)
    return lib


def read_snapshot(path: Path, by_address: bool = False) -> Counter:
    """{instruction bytes (hex): executions} summed over the blocks of one snapshot file; with by_address
    keyed by (guest vaddr, bytes) instead (benchmarks/arm_cycles.py --by-function)."""
    counts = Counter()
    for line in path.read_text().splitlines():
        n, vaddr, code = line.split()
        counts[(int(vaddr, 16), code) if by_address else code] += int(n)
    return counts


def count_blocks(argv: list[str], work: Path, *, sysroot: str, env=None, timeout: float = 7200,
                 by_address: bool = False) -> Counter:
    """{block bytes: executions between the guest's two markers} for `qemu-aarch64 ... argv` (keyed by
    (vaddr, bytes) with by_address)."""
    qemu = shutil.which("qemu-aarch64")
    if qemu is None:
        raise EnvironmentProblem("qemu-aarch64: not found (installer/bootstrap.sh --system)")
    out = work / f"blocks-{time.monotonic_ns()}.txt"
    cmd = [qemu, "-cpu", QEMU_CPU, "-L", sysroot, "-plugin", f"{build_plugin()},out={out}", *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{argv[0]}: failed under qemu (exit {done.returncode}): {tail}")
    first, second = Path(f"{out}.1"), Path(f"{out}.2")
    if not (first.exists() and second.exists()):
        raise RuntimeError(f"{argv[0]}: the guest set no two markers (lseek(-1, 0x5eed0a11, 0))")
    before, after = read_snapshot(first, by_address), read_snapshot(second, by_address)
    for path in (out, first, second):
        path.unlink(missing_ok=True)
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


def unassemblable(lines: list[str]) -> set[int]:
    """Indexes of the lines llvm-mc cannot assemble again (they are left out of the costing)."""
    done = subprocess.run([LLVM_MC, "-triple=aarch64", "-mattr=+v8.2a,+dotprod,+fullfp16,+rcpc", "-o", "/dev/null"],
                          input="\n".join(lines) + "\n", capture_output=True, text=True)
    return {int(m.group(1)) - 1 for m in re.finditer(r"<stdin>:(\d+):\d+: error", done.stderr)}


def mca_cycles(blocks: dict[str, list[str]], cpu: str) -> dict[str, float]:
    """{block: llvm-mca's cycles per pass on cpu}, all blocks as code regions of one llvm-mca run."""
    keys = list(blocks)
    lines = []
    for i, key in enumerate(keys):
        lines.append(f"# LLVM-MCA-BEGIN r{i}")
        # llvm-mca 16 gives every call a fixed 100-cycle latency ("not correctly modeled"): cost a
        # call as the branch it is (bl -> b, blr -> br: the same branch unit); the callee's blocks
        # are counted on their own.
        lines += [re.sub(r"^bl(r?)\b", lambda m: "br" if m.group(1) else "b", insn) for insn in blocks[key]]
        lines.append("# LLVM-MCA-END")
    bad = unassemblable(lines)
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
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.costs))
            tmp.replace(self.path)
        return {c: self.costs[c] for c in codes}


def estimate(counts: Counter, cpus=tuple(CLOCKS_HZ), cache: Path | None = None, progress=None) -> dict:
    """{cpu: {"cycles", "ms" at the stated clock, "clock_ghz"}} plus the executed instruction and block counts."""
    codes = sorted(counts)
    result = {"instructions": sum(n * len(c) // 8 for c, n in counts.items()), "blocks": len(codes)}
    for cpu in cpus:
        per_pass = CostCache(cache or default_cache(), cpu).cost(codes, progress)
        cycles = sum(counts[c] * per_pass[c] for c in codes)
        result[cpu] = {"cycles": cycles, "ms": cycles / CLOCKS_HZ.get(cpu, 1e9) * 1e3,
                       "clock_ghz": CLOCKS_HZ.get(cpu, 1e9) / 1e9}
    return result


def wheelhouse(name: str) -> Path:
    for c in (PROJECT / "wheelhouse" / name, *beside_venv(f"wheelhouse/{name}")):
        if c.is_dir() and any(c.iterdir()):
            return c
    raise EnvironmentProblem(f"wheelhouse/{name}: missing (installer/bootstrap.sh --edge-wheels --edge-sysroot)")


def guest_python(into: Path, wheels=TVM_WHEELS + ORT_WHEELS) -> tuple[Path, dict]:
    """(the arm64 sysroot with python3.11, the environment for the driver): Debian's arm64 .debs of the
    edge sysroot unpacked with dpkg -x, the edge wheels (TVM runtime, onnxruntime, numpy) on PYTHONPATH."""
    sysroot, site = into / "sysroot", into / "site"
    if not (sysroot / "usr" / "bin" / "python3.11").exists():
        sysroot.mkdir(parents=True, exist_ok=True)
        for deb in sorted(wheelhouse("edge-sysroot-arm64").glob("*.deb")):
            subprocess.run(["dpkg", "-x", str(deb), str(sysroot)], check=True)
        found = sorted(wheelhouse("edge-aarch64").glob("*.whl"))
        for prefix in wheels:
            wheel = next((w for w in found if w.name.startswith(prefix)), None)
            if wheel is None:
                raise EnvironmentProblem(f"wheelhouse/edge-aarch64: no {prefix.rstrip('-')} wheel")
            with zipfile.ZipFile(wheel) as z:  # the TVM compiler library is not needed with TVM_USE_RUNTIME_LIB
                z.extractall(site, [n for n in z.namelist() if not n.endswith("libtvm_compiler.so")])
    arm_cpu_files(sysroot)
    env = {**os.environ, "PYTHONPATH": str(site), "TVM_USE_RUNTIME_LIB": "1", "OMP_NUM_THREADS": "1",
           "PYTHONHASHSEED": "0", "TVM_NUM_THREADS": "1"}
    return sysroot, env


def arm_cpu_files(sysroot: Path) -> None:
    """qemu-user 7.2 shows the guest the host's (x86) /proc/cpuinfo; onnxruntime's cpuinfo then finds no
    ARM core and crashes. qemu looks up absolute paths under -L first: a Cortex-A76's lines, one core."""
    (sysroot / "proc").mkdir(parents=True, exist_ok=True)
    (sysroot / "proc" / "cpuinfo").write_text(CORTEX_A76_CPUINFO)
    (sysroot / "sys" / "devices" / "system" / "cpu").mkdir(parents=True, exist_ok=True)
    for name in ("possible", "present", "online"):
        (sysroot / "sys" / "devices" / "system" / "cpu" / name).write_text("0\n")


def count_model(runtime: str, model: Path, shape, guest: tuple[Path, dict], work: Path, maps: Path | None = None
                ) -> Counter:
    """Block counts of one inference of model ("tvm": a model.so; "ort": an ONNX file) in the guest Python;
    with maps, keyed by (vaddr, bytes) and the guest's /proc/self/maps written there (to name functions)."""
    sysroot, env = guest
    argv = [str(sysroot / "usr" / "bin" / "python3.11"), "-s", str(DRIVER), runtime, str(model),
            "--shape", ",".join(map(str, shape)), *(["--maps", str(maps)] if maps else [])]
    return count_blocks(argv, work, sysroot=str(sysroot), env=env, by_address=maps is not None)


def figures(result: dict) -> dict:
    """compile.json's device_estimate from estimate()'s result: cycles and ms per core at its stated clock."""
    return {"estimated": True, "method": METHOD, "instructions": result["instructions"],
            **{cpu: {k: round(v, 4) if k == "ms" else v for k, v in result[cpu].items()} for cpu in CLOCKS_HZ}}


def not_estimated(reason: str) -> dict:
    return {"estimated": False, "reason": reason}


def describe(device: dict | None) -> str:
    """One line for summaries: 'cortex-a76 12.3 ms at 2.4 GHz, cortex-a55 ...' or 'not estimated: <reason>'."""
    if not isinstance(device, dict):
        return "not estimated: no estimate recorded"
    if not device.get("estimated"):
        return f"not estimated: {device.get('reason', '?')}"
    try:
        return ", ".join(f"{cpu} {float(device[cpu]['ms']):.2f} ms at {float(device[cpu]['clock_ghz']):g} GHz "
                         f"({float(device[cpu]['cycles']) / 1e6:.1f} M cycles)" for cpu in CLOCKS_HZ if cpu in device)
    except (KeyError, TypeError, ValueError):
        return "not estimated: the recorded estimate is malformed"


def estimate_build(library: Path, shape, runtime: str = "tvm") -> dict:
    """compile.json's device_estimate of an aarch64 build (a TVM model.so, or an ONNX file with runtime "ort"):
    the figures, or not_estimated(<the one-line reason>) where a tool, the sysroot or the run fails."""
    try:
        check_tools()
        wheels = TVM_WHEELS if runtime == "tvm" else TVM_WHEELS + ORT_WHEELS
        debs = sorted(p.name for p in wheelhouse("edge-sysroot-arm64").glob("*.deb"))
        found = sorted(p.name for p in wheelhouse("edge-aarch64").glob("*.whl") if p.name.startswith(wheels))
        guest_dir = default_cache() / f"guest-{hashlib.sha256(json.dumps([debs, found]).encode()).hexdigest()[:12]}"
        guest = guest_python(guest_dir, wheels)
        work = default_cache() / "runs"
        work.mkdir(parents=True, exist_ok=True)
        return figures(estimate(count_model(runtime, Path(library).resolve(), shape, guest, work)))
    except (EnvironmentProblem, RuntimeError, OSError, subprocess.SubprocessError) as e:
        return not_estimated(str(e).splitlines()[0] if str(e) else type(e).__name__)
