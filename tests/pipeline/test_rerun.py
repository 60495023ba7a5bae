"""The pipeline's rerun logic, fast: the real plan, real data files and the real check stage, with
the heavy stages (torchrun, TVM, qemu) replaced by small actions that write their stage's output
contract (the files its result loader reads, and a manifest) from their inputs' bytes."""

import hashlib
import json
import sys
from pathlib import Path

import pytest

from appliance.deploy.compile import COMPILED_LIBRARY, COMPILE_JSON, CompileResult
from appliance.deploy.export import EXPORTED_MODEL, ExportResult, PARITY_JSON
from appliance.deploy.package import PACKAGE_RESULT_JSON, PackageResult, package_file_name
from appliance.deploy.quantize import ACCURACY_JSON, QuantizeResult
from appliance.deploy.verify import VERIFY_JSON, VerifyResult
from appliance.core.manifest import atomic_write_text, sha256_file, write_manifest
from appliance.pipeline.config import load_pipeline_config
from appliance.pipeline.runner import build_summary, plan, run_stages
from appliance.train.launcher import TrainResult
from data_tools.tfrecord import write_records

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from train_data import image_records  # noqa: E402  (tests/train/train_data.py)

CONFIG = """
[pipeline]
out = "out"
[check]
enabled = {check}
fail_on = "corrupt>0"
[run]
name = "ignored"
seed = 1
[data]
train = ["data/train-*.tfrecord"]
val = ["data/val-*.tfrecord"]
classes = ["left", "right", "top"]
image_size = 8
channels = 1
mean = [0.3]
std = [0.25]
[optimizer]
lr = {lr}
[train]
epochs = 1
{train_extra}
[compile]
targets = ["aarch64"]
"""


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
    return h.hexdigest()


def _inputs_digest(paths) -> str:
    return _digest(*(sha256_file(p) for p in paths))


def fake_train(cfg):
    def action(d: Path, results) -> TrainResult:
        files = [*results.data("train"), *results.data("val")]
        (d / "model").mkdir(parents=True, exist_ok=True)
        (d / "model" / "weights.bin").write_text(_digest(json.dumps(cfg.training, sort_keys=True),
                                                          _inputs_digest(files)))
        # 7 of 8 right: the confusion counts [true][predicted] the real loop writes with val_acc.
        (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "epoch": 0, "val_loss": 0.5, "val_acc": 0.875,
                                                     "val_confusion": [[3, 0, 0], [0, 2, 0], [0, 1, 2]]}) + "\n")
        write_manifest(d, "train", files, {"steps": 1}, outputs=[d / "model" / "weights.bin", d / "metrics.jsonl"])
        return TrainResult.from_run_dir(d)
    return action


def fake_export(d: Path, results) -> ExportResult:
    (d / EXPORTED_MODEL).write_text(_inputs_digest(sorted((results.train.model_dir).iterdir())))
    atomic_write_text(d / PARITY_JSON, json.dumps({"passed": True, "max_rel_error": 0.0}))
    write_manifest(d, "export", [results.train.model_dir / "weights.bin"], {})
    return ExportResult.load(d)


def fake_quantize(d: Path, results) -> QuantizeResult:
    model = d / "model.int8.onnx"
    model.write_text(_inputs_digest([results.export.model]))
    side = {"top1": 0.875, "bytes": 10, "latency_ms_median": 0.1}
    atomic_write_text(d / ACCURACY_JSON, json.dumps({
        "mode": "int8", "fp32": {"model": str(results.export.model), **side},
        "quantized": {"model": str(model), **side}, "top1_drop_points": 0.0, "gate_passed": True}))
    write_manifest(d, "quantize", [results.export.model], {})
    return QuantizeResult.load(d)


def fake_compile(target):
    def action(d: Path, results) -> CompileResult:
        (d / COMPILED_LIBRARY).write_text(_inputs_digest([results.quantize.model]))
        atomic_write_text(d / COMPILE_JSON, json.dumps({"target": target}))
        write_manifest(d, "compile", [results.quantize.model], {"target": target})
        return CompileResult.load(d)
    return action


def fake_package(d: Path, results) -> PackageResult:
    compiled = results.compiled["aarch64"]
    tar = d / package_file_name("aarch64")
    tar.write_text(_inputs_digest([compiled.library]))
    atomic_write_text(d / PACKAGE_RESULT_JSON, json.dumps(
        {"package": tar.name, "target": "aarch64", "bytes": tar.stat().st_size}))
    write_manifest(d, "package", [compiled.library], {"target": "aarch64", "lineage": []})
    return PackageResult.load(d)


def fake_verify(d: Path, results) -> VerifyResult:
    atomic_write_text(d / VERIFY_JSON, json.dumps({"passed": True, "samples": 6, "routes": [
        {"runner": "native", "top1_agreement": 1.0, "max_logit_diff": 0.0, "seconds": 0.1}]}))
    write_manifest(d, "verify", [results.package.package], {})
    return VerifyResult.load(d)


def write_shard(path: Path, n: int, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_records(path, list(image_records(n, seed)))


@pytest.fixture
def site(tmp_path):
    write_shard(tmp_path / "data" / "train-0.tfrecord", 24, 1)
    write_shard(tmp_path / "data" / "val-0.tfrecord", 6, 2)
    return tmp_path


def run(site: Path, check: bool = True, lr: float = 0.003, train_extra: str = ""):
    path = site / "pipeline.toml"
    path.write_text(CONFIG.format(check="true" if check else "false", lr=lr, train_extra=train_extra))
    cfg = load_pipeline_config(path)
    stages = plan(cfg)
    fakes = {"train": fake_train(cfg), "export": fake_export, "quantize": fake_quantize,
             "compile-aarch64": fake_compile("aarch64"), "package": fake_package, "verify": fake_verify}
    for stage in stages:
        if stage.name in fakes:
            stage.action = fakes[stage.name]
    results, ran = run_stages(cfg, stages)
    return cfg, results, ran


ALL = ["check", "train", "gate", "export", "quantize", "compile-aarch64", "package", "verify"]
AFTER_CHECK = ALL[1:]


@pytest.mark.parametrize("check", [True, False])
def test_nothing_changed_reruns_nothing(site, check):
    _, _, ran = run(site, check)
    assert ran == (ALL if check else AFTER_CHECK)
    _, _, ran = run(site, check)
    assert ran == []


@pytest.mark.parametrize("check", [True, False])
def test_a_changed_data_file_reruns_training_and_what_follows(site, check):
    run(site, check)
    write_shard(site / "data" / "train-0.tfrecord", 24, 99)  # same name, new content
    _, _, ran = run(site, check)
    assert ran == (ALL if check else AFTER_CHECK)


@pytest.mark.parametrize("check", [True, False])
def test_an_added_data_file_reruns_training_and_what_follows(site, check):
    run(site, check)
    write_shard(site / "data" / "train-1.tfrecord", 12, 5)  # matched by the glob
    _, results, ran = run(site, check)
    assert ran == (ALL if check else AFTER_CHECK)
    inputs = {i["path"] for i in json.loads((results.train.manifest_path).read_text())["inputs"]}
    assert any("train-1" in p for p in inputs)


def test_a_changed_training_parameter_reruns_train_and_later_only(site):
    run(site)
    _, _, ran = run(site, lr=0.01)
    assert ran == AFTER_CHECK


def test_a_changed_gate_threshold_reruns_the_gate_only_and_can_stop_the_pipeline(site):
    from appliance.core.errors import GateFailed

    run(site)
    _, _, ran = run(site, train_extra="baseline_margin = 0.5")  # 87.5 % top-1 still closes 0.5 of the gap
    assert ran == ["gate"]
    with pytest.raises(GateFailed, match=r"run .*/out/train: val top-1 87.5 % vs majority-class baseline 37.5 %"):
        run(site, train_extra="min_val_acc = 0.9")
    assert json.loads((site / "out" / "gate" / "quality.json").read_text())["passed"] is False


def test_the_summary_carries_the_quality_gate_figures(site):
    cfg, results, ran = run(site)
    summary = build_summary(cfg, results, ran, 1.0)
    assert summary["accuracy"]["val_majority_baseline_top1"] == 3 / 8
    assert summary["stages"]["gate"]["passed"] is True and summary["quality_gate"]["passed"] is True


def test_summary_carries_the_training_accuracy(site):
    cfg, results, ran = run(site)
    summary = build_summary(cfg, results, ran, 1.0)
    assert summary["accuracy"]["train_val_top1"] == 0.875
    assert summary["stages"]["train"]["val_acc"] == 0.875
    assert summary["artifacts"]["package"] == str(cfg.out_dir / "package")


def test_a_damaged_output_reruns_that_stage(site):
    cfg, _, _ = run(site)
    (cfg.out_dir / "compile-aarch64" / COMPILED_LIBRARY).write_text("tampered")
    _, _, ran = run(site)
    assert ran == ["compile-aarch64"]  # rebuilt bit-identical, so package and verify stay


def test_every_stage_result_keeps_the_one_contract_and_loads_back_equal(site):
    from appliance.core.stage import StageResult, is_flat

    _, results, _ = run(site)
    for name, result in results.items():
        assert isinstance(result, StageResult), name
        assert isinstance(result.out_dir, Path) and is_flat(result.figures()), name
        again = type(result).load(result.out_dir)
        assert again.figures() == result.figures(), name


def test_the_index_page_links_every_stage_and_shows_the_summary_figures(site):
    from appliance.pipeline.summary import index_html

    cfg, results, ran = run(site)
    page = index_html(build_summary(cfg, results, ran, 1.0), results)
    for name in ALL:
        assert f"<td>{name}</td>" in page and f'href="{name}/"' in page
    assert 'href="check/report.html"' in page  # the data check's own report, found through its manifest
    assert "87.50 %" in page  # the training's validation top-1, as the summary has it
    _, results, ran = run(site)
    assert "<td>unchanged</td>" in index_html(build_summary(cfg, results, ran, 1.0), results)
