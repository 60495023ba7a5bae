"""`appliance train --profile [STEPS]` and `[profile]`: real torchrun runs whose profile.json splits the
step time into phases that add up, whose recommendations follow the data (a planted expensive decode
asks for more workers, a well-fed run does not), whose traces load, whose report renders, and which
train exactly the weights an unprofiled run trains."""

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from appliance.train.profile_report import DATA_WAIT_MAX
from appliance.train.profiling import PHASES, _merge, _subtract, exposed_communication, window
from conftest import appliance_cmd, offline_cmd, run_appliance
from train_data import make_config

# 256 records, batch 16: 16 steps an epoch on one process, 8 on two. One epoch, no validation in
# the window (it runs after the last step), a checkpoint only at the end.
TINY = {"train": {"epochs": 1}, "checkpoint": {"every_steps": 1000}}
WINDOW = {"wait": 2, "warmup": 1}
ACTIVE = 4


def _train(tmp_path: Path, config: Path, nproc: int, *extra: str, env: dict | None = None) -> Path:
    proc = subprocess.run(offline_cmd(appliance_cmd("train", str(config), "--nproc-per-node", str(nproc), *extra),
                                      loopback=True),
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Kineto's own log lines (USDT profiler_start/stop, ERROR gpuGetDeviceCount) are noise without a GPU.
    assert not re.search(r"^(USDT|STAGE|ERROR|WARNING):", proc.stderr, re.M), proc.stderr[-3000:]
    return config.parent / "runs" / config.stem


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same config trained two ways, unprofiled and profiled with --profile (2 processes, loader
    workers); and one profiled from [profile], decoding in the training process with a planted slow
    decode (1 process)."""
    base = tmp_path_factory.mktemp("profile")
    fed = {"num_workers": 2}  # decoding ahead of the steps
    plain = make_config(base, name="plain", data=fed, **TINY)
    profiled = make_config(base, name="profiled", profile=WINDOW, data=fed, **TINY)
    slow = make_config(base, name="slow", profile={**WINDOW, "steps": ACTIVE}, data={"num_workers": 0}, **TINY)
    return {"plain": _train(base, plain, 2),
            "profiled": _train(base, profiled, 2, "--profile", str(ACTIVE)),
            "slow": _train(base, slow, 1, env={"APPLIANCE_TEST_SLOW_DECODE": "0.02"})}


def _profile(run_dir: Path) -> dict:
    return json.loads((run_dir / "profile.json").read_text())


def test_profiling_changes_neither_the_weights_nor_the_steps(runs):
    plain, profiled = runs["plain"], runs["profiled"]
    assert not (plain / "profile.json").exists() and not (plain / "tb" / "profile").exists()  # off by default
    assert (plain / "model" / "model.safetensors").read_bytes() == (profiled / "model" / "model.safetensors").read_bytes()

    def steps(run_dir):
        return [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]

    assert steps(plain) == steps(profiled) and steps(plain)[-1] == 8
    manifest = json.loads((profiled / "manifest.json").read_text())
    assert manifest["params"]["steps"] == 8
    assert {"profile.json", "profile.html"} <= {os.path.basename(o["path"]) for o in manifest["outputs"]}


@pytest.mark.parametrize("name", ["profiled", "slow"])
def test_every_phase_is_there_and_the_shares_add_up(runs, name):
    report = _profile(runs[name])
    assert report["phases"] == list(PHASES)
    assert report["profiled_steps"] == ACTIVE
    assert report["steps"] == [WINDOW["wait"] + WINDOW["warmup"] + 1, WINDOW["wait"] + WINDOW["warmup"] + ACTIVE]
    assert len(report["ranks"]) == (2 if name == "profiled" else 1)  # every rank's summary reached rank 0
    for rank in report["ranks"]:
        assert set(rank["share"]) == set(PHASES) and all(v >= 0 for v in rank["share"].values())
        assert sum(rank["share"].values()) == pytest.approx(1.0, abs=1e-6)
        assert sum(rank["phase_s"].values()) == pytest.approx(rank["total_s"], rel=1e-6)
        assert rank["total_s"] == pytest.approx(sum(rank["step_ms"]) / 1e3, rel=1e-6)
        assert min(rank["phase_s"][p] for p in ("data_wait", "forward", "backward", "optimizer")) > 0
        assert rank["memory"]["kind"] == "rss" and rank["memory"]["peak_mb"] > 0  # no GPU on this machine
    assert sum(report["share"].values()) == pytest.approx(1.0, abs=1e-6)
    assert report["samples_per_s"] > 0 and report["activities"] == ["CPU"]
    assert report["top_operators"] and all(o["self_cpu_ms"] >= 0 for o in report["top_operators"])


def test_two_processes_show_gradient_communication(runs):
    report = _profile(runs["profiled"])
    for rank in report["ranks"]:
        # DDP's all-reduce and buffer broadcast ran; only their part not hidden behind compute is a phase.
        assert 0 < rank["phase_s"]["allreduce"] <= rank["communication_s"] + 1e-9
    assert not [r for r in report["recommendations"] if r["rule"] == "gpu_memory"]  # CPU run: no GPU advice
    # One process: DDP still calls c10d (its buffer broadcast), with no peer to wait for.
    assert _profile(runs["slow"])["share"]["allreduce"] < min(r["share"]["allreduce"] for r in report["ranks"])


def test_a_slow_decode_asks_for_workers_and_a_well_fed_run_does_not(runs):
    slow, fed = _profile(runs["slow"]), _profile(runs["profiled"])
    assert slow["share_max_over_ranks"]["data_wait"] > fed["share_max_over_ranks"]["data_wait"]
    [advice] = [r for r in slow["recommendations"] if r["rule"] == "data_wait"]
    assert advice["figure"] == slow["share_max_over_ranks"]["data_wait"] > advice["threshold"]
    assert f"data wait is {advice['figure']:.0%}" in advice["advice"] and "num_workers (now 0" in advice["advice"]
    assert not [r for r in fed["recommendations"] if r["rule"] == "data_wait"]
    assert fed["share_max_over_ranks"]["data_wait"] <= DATA_WAIT_MAX
    page = (runs["slow"] / "profile.html").read_text()
    assert 'data-rule="data_wait"' in page and 'data-rule="data_wait"' not in (runs["profiled"] / "profile.html").read_text()


def test_each_rank_writes_a_trace_that_loads(runs):
    run_dir = runs["profiled"]
    report = _profile(run_dir)
    traces = [run_dir / t for t in report["traces"]]
    assert sorted(p.name.split(".")[0] for p in traces) == ["rank0", "rank1"]
    for path in traces:
        assert path.parent == run_dir / "tb" / "profile" and path.name.endswith(".pt.trace.json")
        trace = json.loads(path.read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        # Our phase ranges are in the trace, one per phase and step.
        steps = [e for e in trace["traceEvents"] if e.get("name") == "appliance/forward" and e.get("ph") == "X"]
        assert len(steps) >= ACTIVE and {"appliance/backward", "appliance/optimizer", "appliance/data_wait"} <= names
    page = (run_dir / "profile.html").read_text()
    assert all(t in page for t in report["traces"])  # the report says where they are


def test_profile_report_renders_in_chromium(runs, tmp_path):
    from test_reports_html import assert_readable, measure

    report = _profile(runs["profiled"])
    page = tmp_path / "profile.html"
    page.write_text((runs["profiled"] / "profile.html").read_text())
    m = measure(page, tmp_path)
    assert_readable(m, "profile.html")
    charts = {s["id"]: s for s in m["svgs"]}
    assert charts["chart-steps"]["marks"] == ACTIVE  # one column per profiled step
    written = re.findall(r'<rect class="phase" data-phase="(\w+)"', page.read_text())
    assert charts["chart-phases"]["marks"] == len(written) + len(PHASES)  # the stacked bars, and the legend's swatches
    assert written.count("forward") == written.count("backward") == len(report["ranks"])  # one bar per rank
    assert {p for r in report["ranks"] for p in PHASES if r["share"][p] >= 0.01} <= set(written)
    assert f"{report['samples_per_s']:.1f} samples/s" in m["text"] and "Top operators" in m["text"]


def test_profile_flag_reaches_every_worker(tmp_path):
    config = make_config(tmp_path, name="flag")
    proc = run_appliance("train", str(config), "--dry-run", "--profile")
    assert proc.returncode == 0, proc.stderr
    cmd = shlex.split(proc.stdout)
    assert cmd[cmd.index("appliance.train.loop"):][-2:] == ["--profile", "10"]
    assert "--profile" not in run_appliance("train", str(config), "--dry-run").stdout
    bad = run_appliance("train", str(config), "--dry-run", "--profile", "0")
    assert bad.returncode != 0 and "--profile" in bad.stderr


def test_exposed_allreduce_advice_names_the_bucket_size_knob(tmp_path):
    from appliance.train.config import load_config
    from appliance.train.profile_report import ALLREDUCE_MAX, recommendations

    cfg = load_config(make_config(tmp_path, name="comm", distributed={"bucket_cap_mb": 5}, train={"grad_accum": 2}))
    share = {p: 0.0 for p in PHASES}
    report = {"share_max_over_ranks": {**share, "allreduce": 0.45, "backward": 0.55}, "world_size": 2, "device": "cpu",
              "ranks": [{"rank": 0, "memory": {"kind": "rss", "peak_mb": 100.0}, "step_ms": [10.0, 10.0, 10.0]}]}
    [advice] = recommendations(report, cfg)
    assert advice["rule"] == "allreduce" and advice["figure"] == 0.45 and advice["threshold"] == ALLREDUCE_MAX
    assert "45%" in advice["advice"] and "grad_accum (now 2)" in advice["advice"]
    assert "[distributed] bucket_cap_mb (now 5 MiB)" in advice["advice"] and "fixed" not in advice["advice"]
    quiet = {**report, "share_max_over_ranks": {**share, "allreduce": ALLREDUCE_MAX, "backward": 0.7}}
    assert recommendations(quiet, cfg) == []


def test_the_window_shrinks_to_the_steps_left():
    assert window(10, 5, 2, remaining=100) == (5, 2, 10)
    assert window(10, 5, 2, remaining=12) == (0, 2, 10)  # wait goes first
    assert window(10, 5, 2, remaining=3) == (0, 0, 3)


def test_exposed_time_is_what_compute_leaves_uncovered():
    comm = _merge([(0, 10), (20, 30)])
    compute = _merge([(2, 4), (3, 6), (25, 40)])
    assert _subtract(comm, compute) == [(0, 2), (6, 10), (20, 25)]


def _event(name, start, end, device="CPU", thread=1):
    import torch
    from types import SimpleNamespace

    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), thread=thread,
                           device_type=getattr(torch.autograd.DeviceType, device))


def test_exposed_communication_on_cpu_and_on_cuda():
    # The profiler's events as torch.profiler gives them (microseconds); CUDA cannot run on this machine.
    cpu = [_event("appliance/backward", 0, 100), _event("aten::convolution_backward", 0, 50),
           _event("gloo:all_reduce", 40, 90, thread=7), _event("autograd::engine::evaluate_function: X", 60, 70),
           _event("appliance/forward", 100, 150), _event("c10d::broadcast_", 100, 110)]
    exposed, total = exposed_communication(cpu, cuda=False)
    assert exposed == {"backward": pytest.approx(30e-6), "forward": pytest.approx(10e-6)}  # 50-60, 70-90; 100-110
    assert total == pytest.approx(60e-6)
    gpu = [_event("appliance/backward", 0, 100), _event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 60, 100, "CUDA"),
           _event("void cudnn::conv_bwd_kernel", 0, 80, "CUDA"), _event("nccl:all_reduce", 55, 56)]
    exposed, total = exposed_communication(gpu, cuda=True)
    assert exposed == {"backward": pytest.approx(20e-6)} and total == pytest.approx(40e-6)


def test_a_profiled_run_killed_and_resumed_ends_with_the_same_weights(runs):
    # Rank 1 is SIGKILLed after step 3, in the first attempt's profiler warm-up; torchrun restarts
    # both ranks, which resume from step 2 and profile a window that fits the 6 steps left.
    base = runs["plain"].parent.parent
    config = make_config(base, name="resumed", profile=WINDOW, data={"num_workers": 2},
                         **{**TINY, "checkpoint": {"every_steps": 2}})
    run_dir = _train(base, config, 2, "--profile", str(ACTIVE), "--max-restarts", "1",
                     env={"APPLIANCE_TEST_FAULT": "step:3:1"})
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("resumed_from", "").endswith("step-00000002") for r in records)
    assert (run_dir / "model" / "model.safetensors").read_bytes() == \
        (runs["plain"] / "model" / "model.safetensors").read_bytes()
    report = _profile(run_dir)
    assert report["steps"] == [8 - ACTIVE + 1, 8] and report["profiled_steps"] == ACTIVE
