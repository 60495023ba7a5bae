"""`appliance doctor`: is this box ready to train and deploy? The facts come from appliance.doctor.probes;
this module judges them (problems block training, warnings deploy steps) and writes the report.

Heavy components (torch, onnxruntime, TVM) are probed in parallel subprocesses with a
timeout, so a broken install or a hanging driver shows up as a problem line instead of
taking the doctor down with it.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import platform
import sys
from dataclasses import dataclass, field

from appliance.core import values
from appliance.doctor.pod import pod_facts, pod_problems, pod_rows
from appliance.doctor.probes import (ORT_PROBE, TORCH_PROBE, TVM_PROBE, cpu_facts, disk_facts, driver_check,
                                     memory_facts, network_state, nvidia_driver, pretrained_weights, required_driver,
                                     run_probe, tool_facts)

MAX_GPUS_PER_POD = 64  # --expect-gpus: nvidia.com/gpu of one pod, far above any node's


@dataclass
class Report:
    facts: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # block training: exit non-zero
    warnings: list[str] = field(default_factory=list)  # block deploy steps only


def collect() -> Report:
    report = Report()
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(run_probe, code)
                   for name, code in (("torch", TORCH_PROBE), ("onnxruntime", ORT_PROBE), ("tvm", TVM_PROBE))}
        libc, libc_version = platform.libc_ver()
        report.facts.update({
            "python": {"version": platform.python_version(), "executable": sys.executable},
            "os": {"system": platform.system(), "release": platform.release(),
                   "distro": platform.freedesktop_os_release().get("PRETTY_NAME", "") if hasattr(platform, "freedesktop_os_release") else ""},
            "glibc": libc_version if libc == "glibc" else None,
            "cpu": cpu_facts(),
            "memory": memory_facts(),
            "disk": disk_facts(os.getcwd()),
            "cross_compiler": tool_facts("aarch64-linux-gnu-g++"),
            "qemu_aarch64": tool_facts("qemu-aarch64"),
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


def run_pod(args) -> int:
    """`appliance doctor --k8s`: only what training in this pod needs (torch, GPUs, network, shm, volumes)."""
    torch_facts = run_probe(TORCH_PROBE)
    facts = pod_facts(args.run_dir, args.data_dir)
    gpus = len(torch_facts.get("gpus", [])) if torch_facts.get("cuda_available") else 0
    problems = pod_problems(facts, gpus, args.expect_gpus)
    if "error" in torch_facts:
        problems.insert(0, f"torch is not usable ({torch_facts['error']})")
    if args.json:
        print(json.dumps({"pod": facts, "torch": torch_facts, "problems": problems, "ready_to_train": not problems},
                         indent=2))
        return 0 if not problems else 1
    rows = [*pod_rows(facts), ("torch", torch_facts.get("version", "unusable")),
            ("GPUs", f"{gpus}" + (f" (expected {args.expect_gpus})" if args.expect_gpus is not None else ""))]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows] + [f"PROBLEM: {p}" for p in problems]
    print("\n".join([*lines, "ready to train" if not problems else "NOT ready to train"]))
    return 0 if not problems else 1


def run(args) -> int:
    if args.k8s:
        return run_pod(args)
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
    p.add_argument("--k8s", action="store_true", help="inside a training pod: its name and address, the NCCL/Gloo "
                   "interface, /dev/shm, the volumes, GPUs (what `appliance train k8s` pods check first)")
    p.add_argument("--run-dir", default="", metavar="DIR", help="--k8s: the run directory, which must be writable")
    p.add_argument("--data-dir", default="", metavar="DIR", help="--k8s: the data directory, which must be mounted")
    p.add_argument("--expect-gpus", type=values.int_in(values.Range(ge=0, le=MAX_GPUS_PER_POD), "a GPU count"), default=None, metavar="N",
                   help="--k8s: GPUs the pod asked for (nvidia.com/gpu)")
    p.set_defaults(func=run)
