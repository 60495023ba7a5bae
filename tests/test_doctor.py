"""`appliance doctor` with real probes on this box."""

import json
import os
import platform
import subprocess

import onnxruntime
import torch

from appliance.doctor import probes as doctor
from conftest import VENV_BIN, run_appliance


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


# /proc/driver/nvidia/version as the two kinds of kernel module write it (copied from real boxes).
PROPRIETARY_470 = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  470.82.01  Wed Oct 27 21:21:55 UTC 2021\n"
    "GCC version:  gcc version 9.3.0 (Ubuntu 9.3.0-17ubuntu1~20.04)\n")
OPEN_580 = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.82.07  Release Build  "
    "(dvs-builder@U22-I3-AF03-09-1)  Wed Aug 27 18:33:37 UTC 2025\n"
    "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n")
AARCH64_540 = "NVRM version: NVIDIA UNIX aarch64 Kernel Module  540.4.0  Fri Sep 13 11:41:00 PDT 2024\n"


def _fake_driver(tmp_path, text):
    path = tmp_path / "nvidia-version"
    path.write_text(text)
    return {**os.environ, "APPLIANCE_NVIDIA_VERSION_FILE": str(path)}


def test_driver_version_is_read_from_both_kernel_module_formats():
    assert doctor.parse_nvidia_version(PROPRIETARY_470) == "470.82.01"
    assert doctor.parse_nvidia_version(OPEN_580) == "580.82.07"
    assert doctor.parse_nvidia_version(AARCH64_540) == "540.4.0"
    assert doctor.parse_nvidia_version("GCC version:  gcc version 12\n") is None


def test_required_driver_follows_the_cuda_build_of_torch():
    assert doctor.required_driver("12.4") == ("525.60.13", "550.54.14")
    assert doctor.required_driver("12.7") == ("525.60.13", "560.28.03")  # no 12.7 toolkit: 12.6's
    assert doctor.required_driver("13.0") == ("580.65.06", "580.65.06")
    assert doctor.required_driver("11.8") == ("450.80.02", "520.61.05")


def test_old_driver_on_a_gpu_install_is_a_problem_naming_the_fix(tmp_path):
    # The file format above, read by the same function doctor uses; the gpu_profile decision is
    # what an onnxruntime-gpu install (trainer-cuda) makes.
    with open(_fake_driver(tmp_path, PROPRIETARY_470)["APPLIANCE_NVIDIA_VERSION_FILE"]) as f:
        driver = doctor.parse_nvidia_version(f.read())
    problems, warnings = doctor.driver_check(driver, "2.14.1", "12.4", cuda_available=False, gpu_profile=True)
    assert problems == ["NVIDIA driver 470.82.01 < 525.60.13 required by torch 2.14.1 (CUDA 12.4, cu12): "
                        "update the driver or use the trainer-cpu profile"] and warnings == []
    problems, warnings = doctor.driver_check(driver, "2.14.1", "12.4", cuda_available=False, gpu_profile=False)
    assert problems == [] and "update the driver or use the trainer-cpu profile" in warnings[0]
    # new enough, but CUDA still unusable: a different cause, a different fix
    problems, _ = doctor.driver_check("580.82.07", "2.14.1", "13.0", cuda_available=False, gpu_profile=True)
    assert "cannot use the GPU" in problems[0]
    # minor version compatibility: runs, with a warning
    problems, warnings = doctor.driver_check("550.54.14", "2.14.1", "12.8", cuda_available=True, gpu_profile=True)
    assert problems == [] and "570.26" in warnings[0]
    assert doctor.driver_check("580.82.07", "2.14.1", "13.0", cuda_available=True, gpu_profile=True) == ([], [])


def test_doctor_reads_the_driver_even_when_cuda_fails(tmp_path):
    # This box has no NVIDIA GPU, so CUDA fails here exactly as it does under a too-old driver.
    proc = run_appliance("doctor", "--json", env=_fake_driver(tmp_path, PROPRIETARY_470))
    report = json.loads(proc.stdout)
    assert report["nvidia_driver"]["version"] == "470.82.01"
    assert report["nvidia_driver"]["source"].endswith("nvidia-version")
    assert report["training_device"] == "cpu"
    assert "NVIDIA driver 470.82.01 present but CUDA unusable" in report["gpu_summary"]
    cuda = torch.version.cuda
    if cuda:  # the locked torch (PyPI's Linux build) is a CUDA build
        floor, _ = doctor.required_driver(cuda)
        expected = (f"NVIDIA driver 470.82.01 < {floor} required by torch {torch.__version__.split('+')[0]} "
                    f"(CUDA {cuda}, cu{cuda.split('.')[0]}): update the driver or use the trainer-cpu profile")
        gpu_profile = "CUDAExecutionProvider" in onnxruntime.get_available_providers()
        assert any(line.startswith(expected) for line in report["problems" if gpu_profile else "warnings"]), report
        assert report["nvidia_driver"]["required_minimum"] == floor
    assert proc.returncode == (1 if report["problems"] else 0)

    table = run_appliance("doctor", env=_fake_driver(tmp_path, PROPRIETARY_470))
    assert "470.82.01" in table.stdout


def test_doctor_without_an_nvidia_driver_says_no_gpu(tmp_path):
    proc = run_appliance("doctor", "--json", env=_fake_driver(tmp_path, ""))  # no NVRM line: no driver
    report = json.loads(proc.stdout)
    assert report["nvidia_driver"]["version"] is None
    if not torch.cuda.is_available():
        assert report["gpu_summary"].startswith("no GPU")
    assert not any("NVIDIA driver" in line for line in report["problems"] + report["warnings"])


def test_doctor_k8s_names_what_a_pod_lacks(tmp_path):
    """A pod whose run-directory volume is read-only, whose data volume is missing, whose /dev/shm is
    small and whose name resolves to nothing: one problem line each, exit 1 (in namespaces of its own)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = (f"hostname lost-pod && mount --bind {run_dir} {run_dir} && mount -o remount,bind,ro {run_dir} && "
              "mount -t tmpfs -o size=16m tmpfs /dev/shm && exec "
              f"{VENV_BIN}/appliance doctor --k8s --json --run-dir {run_dir} "
              f"--data-dir {tmp_path / 'data'} --expect-gpus 2")
    proc = subprocess.run(["unshare", "-n", "-u", "-m", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["pod"]["hostname"] == "lost-pod" and report["pod"]["shm_bytes"] == 16 << 20
    assert report["pod"]["volumes"]["run"] == {"path": str(run_dir), "exists": True, "writable": False}
    problems = "\n".join(report["problems"])
    assert "this pod's name lost-pod does not resolve" in problems
    assert "/dev/shm is 16 MiB" in problems and f"the run directory {run_dir} is not writable" in problems
    assert f"the data directory {tmp_path / 'data'} is missing" in problems
    assert ("torch sees 0 GPU(s), the pod asked for 2" in problems) == (not torch.cuda.is_available())
