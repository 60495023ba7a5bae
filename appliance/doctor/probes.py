"""The doctor's probes: what this box has (CPU, memory, disk, tools, network, the NVIDIA driver, the
pretrained weights) and, in subprocesses with a timeout, what torch, onnxruntime and TVM say about
themselves. Each returns plain facts; appliance.doctor judges them and writes the report.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import sys

from appliance.core.errors import ApplianceError
from appliance.assets.weights import read_index, weights_dirs

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


def run_probe(code: str) -> dict:
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


def cpu_facts() -> dict:
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


def memory_facts() -> dict:
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


def disk_facts(path: str) -> dict:
    usage = shutil.disk_usage(path)
    return {"path": path, "free_gib": round(usage.free / 2**30, 1), "total_gib": round(usage.total / 2**30, 1)}


def tool_facts(name: str, version_flag: str = "--version") -> dict:
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
