"""`appliance doctor` with real probes on this box."""

import json
import platform

import onnxruntime
import torch

from conftest import run_appliance


def test_doctor_json_reports_the_components_of_this_box():
    proc = run_appliance("doctor", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["python"]["version"] == platform.python_version()
    assert report["glibc"] == platform.libc_ver()[1]
    assert report["torch"]["version"] == torch.__version__
    assert report["torch"]["cuda_available"] == torch.cuda.is_available()
    assert report["onnxruntime"]["version"] == onnxruntime.__version__
    assert "CPUExecutionProvider" in report["onnxruntime"]["providers"]
    assert report["tvm"]["version"].startswith("0.27")
    assert report["tvm"]["llvm"]
    flags = open("/proc/cpuinfo").read()
    assert report["cpu"]["avx2"] == (" avx2" in flags)
    assert report["cpu"]["avx512"] == (" avx512f" in flags)
    assert report["memory"]["total_gib"] > 0 and report["disk"]["free_gib"] > 0
    for tool in ("cross_compiler", "qemu_aarch64"):
        assert isinstance(report[tool]["present"], bool)
    assert report["ready_to_train"] is True and report["problems"] == []
    if not torch.cuda.is_available():
        assert report["training_device"] == "cpu"
        assert "no GPU" in report["gpu_summary"]


def test_doctor_offline_exits_zero_and_says_no_network():
    proc = run_appliance("doctor", "--json", offline=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["network"]["state"] == "none"
    assert "no network" in report["network"]["summary"]
    assert not any("network" in p for p in report["problems"])

    table = run_appliance("doctor", offline=True)
    assert table.returncode == 0
    assert "no network" in table.stdout
    assert "ready to train" in table.stdout


def test_doctor_table_names_each_component():
    proc = run_appliance("doctor")
    assert proc.returncode == 0, proc.stderr
    for label in ("Python", "glibc", "CPU", "Memory", "Disk", "torch", "GPUs", "onnxruntime", "TVM",
                  "aarch64 g++", "qemu-aarch64", "Network"):
        assert any(line.startswith(label) for line in proc.stdout.splitlines()), label
