"""benchmarks/gpu_check.py on a box without a GPU (CI): its skip mode, its arguments, its JSON,
the budget that stops a hanging check, and the CPU reference training numbers."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def run_check(tmp_path, *args, hide_gpu=True, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if hide_gpu:  # CI may one day have a GPU: the skip mode is what is under test here
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out"), *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=tmp_path)
    report = tmp_path / "out" / "gpu_check.json"
    return proc, (json.loads(report.read_text()) if report.exists() else None)


def test_without_a_gpu_it_says_why_it_skipped_and_exits_zero(tmp_path):
    proc, report = run_check(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("gpu_check: skipped: no CUDA GPU here")
    assert len(proc.stdout.strip().splitlines()) == 1
    assert report["skipped"] is True and report["mode"] == "gpu" and report["checks"] == {}
    assert report["gpu"]["available"] is False and "no CUDA GPU" in report["reason"]
    assert report["params"]["archs"] == ["small_cnn", "resnet18"]
    assert report["params"]["precisions"] == ["fp32", "bf16", "fp16"] and report["params"]["image_size"] == 224


def test_bad_arguments_are_refused_before_anything_runs(tmp_path):
    cases = [(["--checks", "train,warp"], "unknown warp"),
             (["--archs", "resnet9000"], "unknown resnet9000"),
             (["--cpu-reference", "--precisions", "fp16"], "fp16 needs CUDA"),
             (["--cpu-reference", "--checks", "tensorrt"], "only the train"),
             (["--steps", "10", "--warmup", "10"], "--warmup must be smaller"),
             (["--budget-s", "0"], "--budget-s must be positive")]
    for args, message in cases:
        proc, report = run_check(tmp_path, *args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert message in proc.stderr, (args, proc.stderr)
        assert report is None, args


def test_cpu_reference_measures_training_through_appliance_train(tmp_path):
    # With the loader check (benchmarks/loader.py, decode cpu against gpu: here the tensor path on the CPU).
    proc, report = run_check(tmp_path, "--cpu-reference", "--precisions", "fp32", "--steps", "8", "--warmup", "3",
                             "--batch", "8", "--image-size", "32", "--checks", "train,loader")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("gpu_check: cpu-reference on CPU; checks train")
    assert lines[1].startswith("gpu_check: train") and " ok " in lines[1] and "small_cnn: fp32" in lines[1]
    train = report["checks"]["train"]
    assert report["mode"] == "cpu-reference" and report["skipped"] is False
    assert train["status"] == "ok" and train["device"] == "cpu" and train["image_size"] == 32
    (run,) = train["runs"]
    assert run["arch"] == "small_cnn" and run["precision"] == "fp32"
    assert run["steps_per_s"] > 0 and run["images_per_s"] == run["steps_per_s"] * 8
    assert run["peak_memory_mb"] > 0 and 0 <= run["data_wait_pct"] <= 100
    assert report["elapsed_s"] >= train["seconds"] > 0
    assert (tmp_path / "out" / "logs" / "train.log").read_text().count("$ ") == 1  # one `appliance train` run
    loader = report["checks"]["loader"]
    assert loader["status"] == "ok" and loader["target"] is None  # the 8,000 img/s target is the GPU's
    (case,) = loader["results"]
    assert case["case"] == "32px-1w" and case["device"] == "cpu"
    assert case["cpu_img_per_s"] > 0 and case["gpu_img_per_s"] > 0 and len(case["ratios"]) == 1
    assert case["pixel_diff_levels"] == {"mean": 0.0, "max": 0.0}  # augmented, on CPU tensors: bit-identical
    bench = json.loads((tmp_path / "out" / "loader" / "loader.json").read_text())
    assert bench["results"] == loader["results"] and (tmp_path / "out" / "loader" / "loader.html").is_file()


def test_the_budget_kills_a_check_that_overruns_and_the_next_is_skipped(tmp_path):
    # 20000 steps cannot finish in the budget: the train check (and its torchrun tree) is killed,
    # recorded as a timeout, and the resume check after it is skipped, not started. The budget counts
    # from the start (the GPU probe, seconds of a loaded box, included): 30 s leaves the train check
    # at least the 10 s a check needs to start at all.
    proc, report = run_check(tmp_path, "--cpu-reference", "--checks", "train,resume", "--precisions", "fp32",
                             "--steps", "20000", "--batch", "8", "--image-size", "32", "--budget-s", "30")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    checks = report["checks"]
    assert list(checks) == ["train", "resume"]
    # Stopped at what the budget left it, not finished and not failed early. No upper bound on the kill's
    # own time: a loaded box slows it, and a kill that missed the torchrun tree would hold the pipe for
    # the 20000 steps (hours), which run_check's timeout turns into a failure anyway.
    # (The check process stops its own run 3 s before its timeout and says so; else the parent kills it.)
    assert checks["train"]["status"] == "timeout", checks["train"]
    assert checks["resume"]["status"] == "skip" and "budget" in checks["resume"]["summary"]
    assert "FAILED: train" in proc.stdout.strip().splitlines()[-1]


def test_the_shell_wrapper_writes_into_the_lease_out_folder(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["sh", str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "gpu_check: skipped: no CUDA GPU here" in proc.stdout
    assert json.loads((tmp_path / "gpu-check" / "gpu_check.json").read_text())["skipped"] is True


def test_cpu_reference_profiles_a_run_through_appliance_train(tmp_path):
    """The profile check (its CUDA figures come from a GPU box) runs the real --profile path here."""
    proc, report = run_check(tmp_path, "--cpu-reference", "--checks", "profile", "--precisions", "fp32",
                             "--steps", "8", "--warmup", "3", "--batch", "8", "--image-size", "32")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check = report["checks"]["profile"]
    assert check["status"] == "ok", check
    profile = check["profile"]
    assert profile["device"] == "cpu" and profile["activities"] == ["CPU"] and profile["profiled_steps"] == 8
    assert abs(sum(profile["share"].values()) - 1) < 1e-6
    assert "samples/s" in check["summary"] and "recommendations:" in check["summary"]


def test_the_graphs_check_is_skipped_not_started_with_less_than_it_needs_and_says_how_to_run_it(tmp_path):
    # It compiles resnet18 (minutes cold): started with less than NEEDS_S it would be cut off and read
    # as a failure. (The check itself ran here: --cpu-reference --checks graphs, 45 s with a warm cache.)
    proc, report = run_check(tmp_path, "--cpu-reference", "--checks", "graphs", "--budget-s", "120")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    graphs = report["checks"]["graphs"]
    assert graphs["status"] == "skip" and graphs["seconds"] == 0.0
    assert "needs 300 s: `sh benchmarks/gpu_check.sh --checks graphs` runs it alone" in graphs["summary"]
