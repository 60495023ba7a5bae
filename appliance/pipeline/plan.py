"""The pipeline's stages in order: what each reads, which stage function runs it, which result it keeps.

Every stage here calls the same typed stage function as its CLI verb and keeps the typed result
(appliance.core.stage.StageResult) it returns. A stage reads its inputs off the upstream results'
attributes (a clean shard, a model, a library), never by spelling another stage's file names.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from appliance.core.stage import StageResult
from appliance.deploy.compile import CompileResult, compile_stage
from appliance.deploy.openvino_route import compile_target_of
from appliance.deploy.export import ExportResult, export_stage
from appliance.deploy.package import PackageResult, package_stage
from appliance.deploy.quantize import QuantizeResult, quantize_stage
from appliance.deploy.verify import VerifyResult, verify_stage
from appliance.core.errors import GateFailed
from appliance.pipeline.config import PipelineConfig
from appliance.pipeline.qat import qat_after_gate
from appliance.tasks import task_for
from appliance.train.result import TrainResult
from appliance.train.quality import GATE_KEYS, GateResult, Thresholds, gate_stage
from appliance.train.stage import stage_config, train_stage
from appliance.tune.stage import TuneResult, tune_stage
from data_tools.check.stage import CheckResult, check_stage


@dataclass
class Results:
    """The typed results of the stages run (or loaded) so far, in pipeline order."""

    cfg: PipelineConfig
    check: CheckResult | None = None
    tune: TuneResult | None = None
    train: TrainResult | None = None
    gate: GateResult | None = None
    export: ExportResult | None = None
    quantize: QuantizeResult | None = None
    compiled: dict[str, CompileResult] = field(default_factory=dict)  # target -> its build
    package: PackageResult | None = None
    verify: VerifyResult | None = None

    def data(self, split: str) -> list[Path]:
        """The data a later stage reads: the check stage's clean shards, or the files as configured."""
        if self.check is None:
            return list(self.cfg.train_files if split == "train" else self.cfg.val_files)
        return list(self.check.clean.get(split, ()))

    def deployed_model(self) -> Path:
        """The ONNX model the builds compile: the quantized one, or the exported one without quantize."""
        return self.quantize.model if self.quantize is not None else self.export.model

    def items(self) -> list[tuple[str, StageResult]]:
        """(stage name, result) for every stage that has a result, in pipeline order."""
        named = [("check", self.check), ("tune", self.tune), ("train", self.train), ("gate", self.gate), ("export", self.export),
                 ("quantize", self.quantize),
                 *((f"compile-{target}", build) for target, build in self.compiled.items()),
                 ("package", self.package), ("verify", self.verify)]
        return [(name, result) for name, result in named if result is not None]


@dataclass
class Stage:
    """One step: its name, directory and parameters (hashed into its fingerprint); subclasses say
    what it reads (`inputs`), how it runs (`action`) and where its result goes (`keep`)."""

    name: str
    out_dir: Path
    params: dict
    result_type: type  # its StageResult class: `load` rebuilds a skipped stage's result
    resumable: bool = False

    def load(self, out_dir: Path) -> StageResult:
        return self.result_type.load(out_dir)

    def inputs(self, res: Results) -> list[Path]:
        raise NotImplementedError

    def action(self, out_dir: Path, res: Results) -> StageResult:
        raise NotImplementedError

    def keep(self, res: Results, result: StageResult) -> None:
        setattr(res, self.name, result)


def _files_in(directory: Path) -> list[Path]:
    return sorted(p for p in Path(directory).rglob("*") if p.is_file())


class CheckStage(Stage):
    def inputs(self, res: Results) -> list[Path]:
        return [*res.cfg.train_files, *res.cfg.val_files]

    def action(self, out_dir: Path, res: Results) -> CheckResult:
        files = [(p, "train") for p in res.cfg.train_files] + [(p, "val") for p in res.cfg.val_files]
        options = {k: v for k, v in self.params.items() if k not in asdict(res.cfg.check)}  # the task's
        return check_stage(files, out_dir, fail_on=res.cfg.check.fail_on, **options)


class TuneStage(Stage):
    def inputs(self, res: Results) -> list[Path]:
        return [*res.data("train"), *res.data("val")]

    def action(self, out_dir: Path, res: Results) -> TuneResult:
        cfg = res.cfg
        return tune_stage(cfg.training, cfg.source, cfg.tune, out_dir, train_files=res.data("train"),
                          val_files=res.data("val"), check_report=res.check.report_json if res.check else None,
                          nproc_per_node=cfg.pipeline.nproc_per_node)


class TrainStage(Stage):
    # Training reads the data files; their content is in its fingerprint whether or not a check ran,
    # and, after a tune stage, the best config it wrote (its values are the ones trained).
    def inputs(self, res: Results) -> list[Path]:
        return [*res.data("train"), *res.data("val"), *([res.tune.best_config] if res.tune else [])]

    def action(self, out_dir: Path, res: Results) -> TrainResult:
        cfg = res.cfg
        training = res.tune.tuned(cfg.training) if res.tune else cfg.training
        config = stage_config(training, cfg.source, out_dir, train_files=res.data("train"),
                              val_files=res.data("val"), check_report=res.check.report_json if res.check else None)
        return train_stage(config, nproc_per_node=cfg.pipeline.nproc_per_node, max_restarts=cfg.pipeline.max_restarts)


class GateStage(Stage):
    def inputs(self, res: Results) -> list[Path]:
        return [res.train.metrics_path, *_files_in(res.train.model_dir)]

    def action(self, out_dir: Path, res: Results) -> GateResult:
        return gate_stage(res.train, Thresholds(**self.params), out_dir)


class ExportStage(Stage):
    def inputs(self, res: Results) -> list[Path]:
        return [*_files_in(res.train.model_dir), *res.data("val")]

    def action(self, out_dir: Path, res: Results) -> ExportResult:
        e = res.cfg.export
        return export_stage(res.train.model_dir, out_dir, opset=e.opset, sample_files=res.data("val"),
                                   max_rel_error=e.max_rel_error)


class QuantizeStage(Stage):
    def inputs(self, res: Results) -> list[Path]:
        return [res.export.model, *res.data("train"), *res.data("val")]

    def action(self, out_dir: Path, res: Results) -> QuantizeResult:
        q = res.cfg.quantize
        try:
            return quantize_stage(res.export.model, res.data("train"), res.data("val"), out_dir, mode=q.mode,
                                  method=q.method, per_channel=q.per_channel, calib_samples=q.calib_samples,
                                  max_drop=q.max_drop, fallback=q.fallback, max_float_layers=q.max_float_layers,
                                  engine=q.engine)
        except GateFailed:  # PTQ and fallback missed the gate: QAT next, if enabled
            if not (q.qat and q.mode == "int8"):
                raise
        return qat_after_gate(res.train.run_dir, out_dir, res.data("train"), res.data("val"), epochs=q.qat_epochs,
                              lr_scale=q.qat_lr_scale, nproc_per_node=res.cfg.pipeline.nproc_per_node,
                              opset=res.cfg.export.opset)


@dataclass
class CompileStage(Stage):
    target: str = ""

    def inputs(self, res: Results) -> list[Path]:
        return [res.deployed_model(), *res.data("val")]

    def action(self, out_dir: Path, res: Results) -> CompileResult:
        return compile_stage(res.deployed_model(), self.target, out_dir, sample_files=res.data("val"),
                             device_estimate=self.target.startswith("aarch64") and res.cfg.compile.device_estimate,
                             runtime=res.cfg.compile.runtime)

    def keep(self, res: Results, result: CompileResult) -> None:
        res.compiled[self.target] = result


class PackageStage(Stage):
    def inputs(self, res: Results) -> list[Path]:
        build = res.compiled[compile_target_of(res.cfg.package.target)]
        return [build.library, build.report]

    def action(self, out_dir: Path, res: Results) -> PackageResult:
        return package_stage(res.compiled[compile_target_of(res.cfg.package.target)], out_dir,
                             sample_files=res.data("val"))


class VerifyStage(Stage):
    def inputs(self, res: Results) -> list[Path]:
        return [res.package.package, *res.data("val")]

    def action(self, out_dir: Path, res: Results) -> VerifyResult:
        v = res.cfg.verify
        return verify_stage(res.package, out_dir, sample_files=res.data("val"), num_samples=v.samples,
                                   min_agreement=v.min_agreement)


def train_params(cfg: PipelineConfig) -> dict:
    """What decides the weights: neither where the processes talk ([distributed]) nor the gate's
    thresholds do, so changing a threshold reruns the gate only."""
    training = cfg.training
    weights_deciding = {**{k: v for k, v in training.items() if k != "distributed"},
                        "train": {k: v for k, v in training.get("train", {}).items() if k not in GATE_KEYS}}
    return {"training": weights_deciding, "nproc_per_node": cfg.pipeline.nproc_per_node,
            "checked": cfg.check.enabled}


def plan(cfg: PipelineConfig) -> list[Stage]:
    """The stages in order, each with its directory, parameters and result type."""
    out = cfg.out_dir
    stages: list[Stage] = []
    if cfg.check.enabled:
        data = cfg.training.get("data", {})
        num_classes = data.get("num_classes") or len(data.get("classes", ()))
        # segmentation: the mask range, and the class names its report shows
        task_options = task_for(cfg.training.get("task")).check_options(num_classes, data.get("classes", ()))
        stages.append(CheckStage("check", out / "check", {**asdict(cfg.check), **task_options}, CheckResult))
    if cfg.pipeline.tune:
        stages.append(TuneStage("tune", out / "tune", {"training": train_params(cfg), "tune": cfg.tune}, TuneResult,
                                resumable=True))
    stages.append(TrainStage("train", out / "train", train_params(cfg), TrainResult, resumable=True))
    thresholds = Thresholds.of(cfg.training.get("train", {}))
    stages.append(GateStage("gate", out / "gate", asdict(thresholds), GateResult))
    stages.append(ExportStage("export", out / "export", asdict(cfg.export), ExportResult))
    if cfg.quantize.mode != "none":
        # engine "ours" (the default) is left out, so a run made before the key existed is not redone
        params = {k: v for k, v in asdict(cfg.quantize).items() if (k, v) != ("engine", "ours")}
        stages.append(QuantizeStage("quantize", out / "quantize", params, QuantizeResult))
    for target in cfg.compile.targets:
        stages.append(CompileStage(f"compile-{target}", out / f"compile-{target}",
                                   {"target": target, "device_estimate": cfg.compile.device_estimate,
                                    "runtime": cfg.compile.runtime},
                                   CompileResult, target=target))
    stages.append(PackageStage("package", out / "package", asdict(cfg.package), PackageResult))
    stages.append(VerifyStage("verify", out / "verify", asdict(cfg.verify), VerifyResult))
    return stages
