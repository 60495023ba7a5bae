"""`appliance doctor`: is this box ready to train and deploy?

Heavy components (torch, onnxruntime, TVM) are probed in parallel subprocesses with a
timeout, so a broken install or a hanging driver shows up as a problem line instead of
taking the doctor down with it.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field

from appliance.core.errors import ApplianceError
from appliance.assets.weights import weights_dirs, read_index

PROBE_TIMEOUT_S = 120

# Each probe prints one JSON object on stdout.
TORCH_PROBE = r"""
import json, torch, torch.distributed as dist
out = {"version": torch.__version__, "cuda_build": torch.version.cuda,
       "cuda_available": torch.cuda.is_available(), "gpus": [],
       "nccl_available": bool(dist.is_available() and dist.is_nccl_available()),
       "gloo_available": bool(dist.is_available() and dist.is_gloo_available()),
       "bf16_cpu": True}
if out["cuda_available"]:
    out["cuda_runtime"] = torch.version.cuda
    try:
        out["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as err:
        out["nccl_version"] = None
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out["gpus"].append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                            "capability": f"{p.major}.{p.minor}"})
print(json.dumps(out))
"""

ORT_PROBE = r"""
import json, onnxruntime as ort
print(json.dumps({"version": ort.__version__, "providers": ort.get_available_providers(),
                  "device": ort.get_device()}))
"""

TVM_PROBE = r"""
import json, tvm
info = tvm.support.libinfo()
llvm = None
if info.get("USE_LLVM") not in (None, "OFF"):
    from tvm.target import codegen
    llvm = str(codegen.llvm_version_major())
print(json.dumps({"version": tvm.__version__, "llvm": llvm, "cuda": info.get("USE_CUDA")}))
"""


@dataclass
class Report:
    facts: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # block training: exit non-zero
    warnings: list[str] = field(default_factory=list)  # block deploy steps only


def _run_probe(code: str) -> dict:
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"probe did not answer within {PROBE_TIMEOUT_S} s"}
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return {"error": lines[-1] if lines else f"exit status {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cpu() -> dict:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    model = value.strip()
                elif key in ("flags", "Features"):
                    flags = set(value.split())
                if model and flags and key == "":
                    break
    except OSError:
        pass
    return {
        "model": model,
        "arch": platform.machine(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "avx2": "avx2" in flags,
        "avx512": "avx512f" in flags,
        "vnni": bool({"avx512_vnni", "avx_vnni"} & flags),
        "neon": bool({"asimd", "neon"} & flags),
    }


def _memory() -> dict:
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    info[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    gib = lambda b: round(b / 2**30, 1) if b is not None else None  # noqa: E731
    return {"total_gib": gib(info.get("MemTotal")), "available_gib": gib(info.get("MemAvailable"))}


def _disk(path: str) -> dict:
    usage = shutil.disk_usage(path)
    return {"path": path, "free_gib": round(usage.free / 2**30, 1), "total_gib": round(usage.total / 2**30, 1)}


def _tool(name: str, version_flag: str = "--version") -> dict:
    path = shutil.which(name)
    if not path:
        return {"present": False}
    try:
        out = subprocess.run([path, version_flag], capture_output=True, text=True, timeout=10).stdout
        first = out.strip().splitlines()[0] if out.strip() else ""
    except (OSError, subprocess.TimeoutExpired):
        first = ""
    return {"present": True, "path": path, "version": first}


# The NVIDIA driver reports itself here as soon as its kernel module is loaded, whether or not
# CUDA works (a too-old driver is exactly the case where it does not).
NVIDIA_VERSION_FILE = "/proc/driver/nvidia/version"
NVIDIA_VERSION_FILE_ENV = "APPLIANCE_NVIDIA_VERSION_FILE"  # tests point it at a fake file

# Minimum Linux x86_64 driver per CUDA toolkit, from NVIDIA's CUDA Toolkit release notes
# (Table 3, "CUDA Toolkit and Corresponding Driver Versions"). A wheel built for CUDA X.Y runs
# on any driver of the same major's floor (MINOR_COMPAT_FLOOR, "minor version compatibility"),
# but PTX JIT and some newer APIs need the toolkit's own driver.
CUDA_TOOLKIT_DRIVER = {
    "11.0": "450.36.06", "11.8": "520.61.05",
    "12.0": "525.60.13", "12.1": "530.30.02", "12.2": "535.54.03", "12.3": "545.23.06",
    "12.4": "550.54.14", "12.5": "555.42.02", "12.6": "560.28.03", "12.8": "570.26", "12.9": "575.51.03",
    "13.0": "580.65.06",
}
MINOR_COMPAT_FLOOR = {"11": "450.80.02", "12": "525.60.13", "13": "580.65.06"}


def parse_nvidia_version(text: str) -> str | None:
    """The driver version in /proc/driver/nvidia/version's first line, e.g. '535.129.03'.

    'NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.129.03  Thu Oct 19 ...' (proprietary) or
    'NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.14  Release Build ...' (open).
    """
    import re

    for line in text.splitlines():
        if line.startswith("NVRM version:"):
            m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)*)\b", line)
            return m.group(1) if m else None
    return None


def _nvml_driver() -> str | None:
    """nvmlSystemGetDriverVersion through ctypes, when libnvidia-ml is installed (no CUDA needed)."""
    import ctypes

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    try:
        if nvml.nvmlInit_v2() != 0:
            return None
        buf = ctypes.create_string_buffer(96)
        ok = nvml.nvmlSystemGetDriverVersion(buf, ctypes.c_uint(len(buf))) == 0
        nvml.nvmlShutdown()
        return buf.value.decode() if ok else None
    except (AttributeError, OSError):
        return None


def _smi_driver() -> str | None:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=15,
        ).stdout.strip()
        return out.splitlines()[0] if out else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def nvidia_driver() -> dict:
    """{"version", "source"} of the loaded NVIDIA driver; version None when there is none."""
    override = os.environ.get(NVIDIA_VERSION_FILE_ENV)
    path = override or NVIDIA_VERSION_FILE
    try:
        with open(path) as f:
            version = parse_nvidia_version(f.read())
        if version or override:
            return {"version": version, "source": path}
    except OSError:
        if override:
            return {"version": None, "source": path}
    for source, probe in (("nvml", _nvml_driver), ("nvidia-smi", _smi_driver)):
        version = probe()
        if version:
            return {"version": version, "source": source}
    return {"version": None, "source": None}


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(".") if x.isdigit())


def required_driver(cuda_build: str) -> tuple[str, str | None]:
    """(floor of the CUDA major, the toolkit's own driver or None) for torch.version.cuda."""
    major = cuda_build.split(".")[0]
    floor = MINOR_COMPAT_FLOOR.get(major)
    if floor is None:  # a CUDA newer than this table: the newest entry is the best lower bound we know
        floor = max(MINOR_COMPAT_FLOOR.values(), key=_version_tuple)
    known = [v for v in CUDA_TOOLKIT_DRIVER if v.split(".")[0] == major
             and _version_tuple(v) <= _version_tuple(cuda_build)]
    toolkit = CUDA_TOOLKIT_DRIVER[max(known, key=_version_tuple)] if known else None
    return floor, toolkit


def driver_check(driver: str | None, torch_version: str, cuda_build: str | None, cuda_available: bool,
                 gpu_profile: bool) -> tuple[list[str], list[str]]:
    """(problems, warnings) about the NVIDIA driver against the CUDA build of the installed torch.

    gpu_profile: this install is meant to train on the GPU (onnxruntime-gpu installed, the
    trainer-cuda profile); a trainer-cpu install on a GPU box only gets warnings.
    """
    if not driver or not cuda_build:
        return [], []
    floor, toolkit = required_driver(cuda_build)
    major = cuda_build.split(".")[0]
    torch_version = torch_version.split("+")[0]  # "2.14.1+cu130": the CUDA part is named below
    if _version_tuple(driver) < _version_tuple(floor):
        line = (f"NVIDIA driver {driver} < {floor} required by torch {torch_version} (CUDA {cuda_build}, cu{major}): "
                "update the driver or use the trainer-cpu profile")
        return ([line], []) if gpu_profile else ([], [line + " (training uses the CPU)"])
    if not cuda_available:
        line = (f"NVIDIA driver {driver} is new enough for torch {torch_version} (CUDA {cuda_build}) but torch "
                "cannot use the GPU: check /dev/nvidia* permissions, CUDA_VISIBLE_DEVICES, and `nvidia-smi`")
        return ([line], []) if gpu_profile else ([], [line])
    if toolkit and _version_tuple(driver) < _version_tuple(toolkit):
        return [], [f"NVIDIA driver {driver} < {toolkit} of CUDA {cuda_build}: runs by minor version "
                    "compatibility, but kernels JIT-compiled from PTX may fail; update the driver"]
    return [], []


def network_state() -> dict:
    """Whether any route leaves this box. Sends no packet and cannot hang.

    A UDP connect() only asks the kernel for a route; 192.0.2.1 is TEST-NET-1
    (RFC 5737), which is never a real destination.
    """
    interfaces = []
    try:
        for name in sorted(os.listdir("/sys/class/net")):
            if name == "lo":
                continue
            with open(f"/sys/class/net/{name}/operstate") as f:
                if f.read().strip() in ("up", "unknown"):
                    interfaces.append(name)
    except OSError:
        pass
    routed = False
    for family, addr in ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((addr, 9))
                routed = True
        except OSError:
            continue
    state = "routed" if routed else "none"
    return {"state": state, "interfaces_up": interfaces,
            "summary": "no network (expected on an air-gapped appliance)" if not routed
            else f"a route leaves this box via {', '.join(interfaces) or 'an interface'}"}


def pretrained_weights() -> dict:
    """The pretrained weight files this install carries (appliance.assets.weights's search order), by name.

    Sizes are checked here; the sha256 is checked whenever training loads one (find_weights).
    """
    found, problems = {}, []
    for directory in weights_dirs():
        try:
            index = read_index(directory)
        except ApplianceError as err:
            problems.append(str(err))
            continue
        for name, entry in index.items():
            if name in found:
                continue  # an earlier directory wins, as in find_weights
            path = directory / str(entry.get("file", ""))
            size = path.stat().st_size if path.is_file() else None
            found[name] = {"file": str(path), "weights": entry.get("weights", ""), "bytes": size,
                           "num_classes": entry.get("num_classes")}
            if size is None:
                problems.append(f"{path}: listed in {directory / 'index.json'} for {name} but missing")
            elif entry.get("bytes") not in (None, size):
                problems.append(f"{path}: {size} bytes, {directory / 'index.json'} says {entry['bytes']}; "
                                "the file is damaged")
    return {"dirs": [str(d) for d in weights_dirs()], "models": found, "problems": problems}


def collect() -> Report:
    report = Report()
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(_run_probe, code)
                   for name, code in (("torch", TORCH_PROBE), ("onnxruntime", ORT_PROBE), ("tvm", TVM_PROBE))}
        libc, libc_version = platform.libc_ver()
        report.facts.update({
            "python": {"version": platform.python_version(), "executable": sys.executable},
            "os": {"system": platform.system(), "release": platform.release(),
                   "distro": platform.freedesktop_os_release().get("PRETTY_NAME", "") if hasattr(platform, "freedesktop_os_release") else ""},
            "glibc": libc_version if libc == "glibc" else None,
            "cpu": _cpu(),
            "memory": _memory(),
            "disk": _disk(os.getcwd()),
            "cross_compiler": _tool("aarch64-linux-gnu-g++"),
            "qemu_aarch64": _tool("qemu-aarch64"),
            "network": network_state(),
            "pretrained": pretrained_weights(),
        })
        for name, fut in futures.items():
            report.facts[name] = fut.result()

    torch_facts = report.facts["torch"]
    if "error" in torch_facts:
        report.problems.append(f"torch is not usable ({torch_facts['error']}): run installer/bootstrap.sh")
        device = None
    elif torch_facts["cuda_available"]:
        device = "cuda"
        if not torch_facts["nccl_available"]:
            report.problems.append("CUDA is present but NCCL is not: multi-GPU training needs a torch build with NCCL")
    else:
        device = "cpu"
        if not torch_facts.get("gloo_available"):
            report.problems.append("torch.distributed has no gloo backend: install the locked torch build")
    report.facts["training_device"] = device
    driver = nvidia_driver()
    report.facts["nvidia_driver"] = driver
    if "error" not in torch_facts:
        torch_facts["driver"] = driver["version"]
        gpu_profile = "CUDAExecutionProvider" in report.facts["onnxruntime"].get("providers", [])
        problems, warnings = driver_check(driver["version"], torch_facts["version"], torch_facts.get("cuda_build"),
                                          torch_facts["cuda_available"], gpu_profile)
        report.problems += problems
        report.warnings += warnings
        if driver["version"] and torch_facts.get("cuda_build"):
            floor, toolkit = required_driver(torch_facts["cuda_build"])
            driver.update({"cuda_build": torch_facts["cuda_build"], "required_minimum": floor,
                           "toolkit_driver": toolkit})
    report.facts["gpu_summary"] = (
        f"{len(torch_facts['gpus'])} GPU(s): " + ", ".join(g["name"] for g in torch_facts["gpus"])
        if device == "cuda" else
        f"NVIDIA driver {driver['version']} present but CUDA unusable: training selects the CPU (gloo backend, bf16 autocast)"
        if driver["version"] and device == "cpu" else
        "no GPU: training selects the CPU (gloo backend, bf16 autocast)"
    )
    if sys.version_info < (3, 10):
        report.problems.append(f"Python {platform.python_version()} is too old: 3.10 or newer is required")
    if report.facts["disk"]["free_gib"] < 2:
        report.problems.append(f"only {report.facts['disk']['free_gib']} GiB free in {os.getcwd()}: "
                               "checkpoints need space; free at least 2 GiB")

    report.warnings += [f"pretrained weights: {p}" for p in report.facts["pretrained"]["problems"]]
    for name in ("onnxruntime", "tvm"):
        if "error" in report.facts[name]:
            report.warnings.append(f"{name} is not usable ({report.facts[name]['error']}): "
                                   "export/quantize/compile will fail; run installer/bootstrap.sh")
    if not report.facts["cross_compiler"]["present"]:
        report.warnings.append("aarch64-linux-gnu-g++ not found: ARM compile needs it "
                               "(apt-get install g++-aarch64-linux-gnu)")
    if not report.facts["qemu_aarch64"]["present"]:
        report.warnings.append("qemu-aarch64 not found: `appliance edge verify` needs it (apt-get install qemu-user)")
    return report


def format_table(report: Report) -> str:
    f = report.facts
    t, o, v = f["torch"], f["onnxruntime"], f["tvm"]
    cpu = f["cpu"]
    cpu_flags = ", ".join(k.upper() for k in ("avx2", "avx512", "vnni", "neon") if cpu[k]) or "none"

    def component(d, text):
        return f"unusable: {d['error']}" if "error" in d else text

    def tool(d):
        return f"{d['path']} ({d['version']})" if d["present"] else "missing"

    rows = [
        ("Python", f"{f['python']['version']} ({f['python']['executable']})"),
        ("OS", f"{f['os']['distro'] or f['os']['system']} {f['os']['release']}"),
        ("glibc", f["glibc"] or "not glibc"),
        ("CPU", f"{cpu['model']}, {cpu['usable_cores']}/{cpu['cores']} cores usable; flags: {cpu_flags}"),
        ("Memory", f"{f['memory']['total_gib']} GiB total, {f['memory']['available_gib']} GiB available"),
        ("Disk", f"{f['disk']['free_gib']} GiB free of {f['disk']['total_gib']} GiB in {f['disk']['path']}"),
        ("torch", component(t, f"{t.get('version')} (CUDA build {t.get('cuda_build') or 'none'}); "
                               f"NCCL {'yes' if t.get('nccl_available') else 'no'}, gloo {'yes' if t.get('gloo_available') else 'no'}")),
        ("GPUs", f["gpu_summary"] + (f"; driver {t.get('driver')}" if f["training_device"] == "cuda" and t.get("driver") else "")),
        ("Training device", f["training_device"] or "none"),
        ("onnxruntime", component(o, f"{o.get('version')}; providers: {', '.join(o.get('providers', []))}")),
        ("TVM", component(v, f"{v.get('version')}; LLVM {v.get('llvm')}")),
        ("aarch64 g++", tool(f["cross_compiler"])),
        ("qemu-aarch64", tool(f["qemu_aarch64"])),
        ("Network", f["network"]["summary"]),
        ("Pretrained", ", ".join(f"{n} ({m['weights'] or '?'}, {m['bytes'] / 1e6:.1f} MB)" if m["bytes"] is not None
                                 else f"{n} (missing)" for n, m in f["pretrained"]["models"].items())
         or "none (`appliance bundle build --weights NAME,...` carries them)"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {val}" for k, val in rows]
    for p in report.problems:
        lines.append(f"PROBLEM: {p}")
    for w in report.warnings:
        lines.append(f"warning: {w}")
    lines.append("ready to train" if not report.problems else "NOT ready to train")
    return "\n".join(lines)


def run(args) -> int:
    report = collect()
    if args.json:
        print(json.dumps({**report.facts, "problems": report.problems, "warnings": report.warnings,
                          "ready_to_train": not report.problems}, indent=2))
    else:
        print(format_table(report))
    return 0 if not report.problems else 1


def register(subparsers) -> None:
    p = subparsers.add_parser("doctor", help="report whether this box is ready to train and deploy",
                              description="Probe Python, OS, CPU, memory, disk, torch/CUDA/NCCL, "
                              "onnxruntime, TVM, the aarch64 cross compiler, qemu and the network. "
                              "Exit 0 when training can run here.")
    p.add_argument("--json", action="store_true", help="print JSON for machines instead of a table")
    p.set_defaults(func=run)
