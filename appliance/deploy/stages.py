"""The deploy stages as typed functions: export, quantize, compile, package, verify.

Each takes typed inputs (paths, settings, an upstream stage's result) and returns a result
holding its output paths and figures; `Result.load(out_dir)` rebuilds the same result from a
finished output directory, so a caller that skips an unchanged stage still gets it. The file
names of each stage's outputs are known here and in the stage's own module, nowhere else.
Gates raise GateFailed (exit status 3) after their report is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from appliance.core.errors import DataError, GateFailed
from appliance.deploy.export import export_model
from appliance.deploy.quantize import quantize_model
from appliance.deploy.compiler.driver import compile_model
from appliance.deploy.tolerance import refuse_failed_gate
from appliance.deploy.package import build_package
from appliance.core.manifest import atomic_write_text, write_manifest
from appliance.deploy.verify import verify_package

EXPORTED_MODEL = "model.onnx"
PARITY_JSON = "parity.json"
ACCURACY_JSON = "accuracy.json"
ACCURACY_HTML = "accuracy.html"
COMPILED_LIBRARY = "model.so"
COMPILE_JSON = "compile.json"
VERIFY_JSON = "verify.json"
PACKAGE_RESULT_JSON = "package.json"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path}: missing (is {path.parent} the output of that stage?)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: damaged ({err}); rerun that stage") from None


@dataclass(frozen=True)
class ExportResult:
    out_dir: Path
    model: Path
    bytes: int
    parity: dict

    @classmethod
    def load(cls, out_dir: Path) -> "ExportResult":
        out_dir = Path(out_dir)
        model = out_dir / EXPORTED_MODEL
        return cls(out_dir, model, model.stat().st_size if model.exists() else 0, _read_json(out_dir / PARITY_JSON))

    def figures(self) -> dict:
        return {"model": str(self.model), "bytes": self.bytes, "parity": self.parity}


def export_stage(model_dir: Path, out_dir: Path, *, opset: int, sample_files, max_rel_error: float,
                 batch: int | None = None, num_samples: int = 64) -> ExportResult:
    """Export model_dir (a run or trained-model directory) to ONNX; DataError when parity fails.
    batch: None for a dynamic batch axis."""
    export_model(model_dir, out_dir, opset=opset, batch=batch, sample_files=list(sample_files or []) or None,
                 num_samples=num_samples, max_rel_error=max_rel_error)
    return ExportResult.load(out_dir)


@dataclass(frozen=True)
class QuantizeResult:
    out_dir: Path
    model: Path
    mode: str
    report: dict

    @property
    def gate_passed(self) -> bool:
        return bool(self.report["gate_passed"])

    @classmethod
    def load(cls, out_dir: Path) -> "QuantizeResult":
        out_dir = Path(out_dir)
        report = _read_json(out_dir / ACCURACY_JSON)
        return cls(out_dir, Path(report["quantized"]["model"]), report["mode"], report)

    @property
    def html(self) -> Path:
        return self.out_dir / ACCURACY_HTML

    def figures(self) -> dict:
        return {"model": str(self.model), "report": self.report}


def quantize_stage(model: Path, calib_files, val_files, out_dir: Path, *, mode: str, method: str,
                   per_channel: bool, calib_samples: int, max_drop: float, scheme: str = "s8s8",
                   val_samples: int = 1_000_000, on_result=None, fallback: str = "auto",
                   max_float_layers: int = 10, **options) -> QuantizeResult:
    """Quantize, then measure on val_files (default: calib_files); GateFailed when top-1 drops more than
    max_drop points (after --fallback auto found no INT8 model within it). on_result(result) is called
    before the gate is applied (the CLI prints it)."""
    quantize_model(model, list(calib_files), out_dir, val_files=list(val_files) if val_files else None, mode=mode,
                   method=method, per_channel=per_channel, scheme=scheme, calib_samples=calib_samples,
                   val_samples=val_samples, max_drop=max_drop, fallback=fallback, max_float_layers=max_float_layers,
                   **options)
    result = QuantizeResult.load(out_dir)
    if on_result is not None:
        on_result(result)
    if not result.gate_passed:
        raise GateFailed(f"{result.model}: {mode} top-1 dropped {result.report['top1_drop_points']:.2f} points, "
                         f"more than --max-drop {max_drop:g} (see {result.html})")
    return result


@dataclass(frozen=True)
class CompileResult:
    out_dir: Path
    target: str
    library: Path
    info: dict

    @classmethod
    def load(cls, out_dir: Path) -> "CompileResult":
        out_dir = Path(out_dir)
        info = _read_json(out_dir / COMPILE_JSON)
        return cls(out_dir, info["target"], out_dir / COMPILED_LIBRARY, info)

    @property
    def report(self) -> Path:
        """compile.json: what a package of this build records as its input beside the library."""
        return self.out_dir / COMPILE_JSON

    def figures(self) -> dict:
        return {"target": self.target, "library": str(self.library), "report": self.info}


def compile_stage(model: Path, target: str, out_dir: Path, *, sample_files, allow_failed_gate: bool = False,
                  **options) -> CompileResult:
    """Compile model with TVM for target (options: those of compiler.driver.compile_model); refuses a
    quantized model that failed its accuracy gate unless allow_failed_gate."""
    if not allow_failed_gate:
        refuse_failed_gate(model)
    compile_model(model, target, out_dir, sample_files=list(sample_files) if sample_files else None, **options)
    return CompileResult.load(out_dir)


@dataclass(frozen=True)
class PackageResult:
    out_dir: Path
    package: Path
    target: str
    bytes: int
    info: dict = field(default_factory=dict)

    @classmethod
    def load(cls, out_dir: Path) -> "PackageResult":
        record = _read_json(Path(out_dir) / PACKAGE_RESULT_JSON)
        return cls(Path(out_dir), Path(out_dir) / record["package"], record["target"], record["bytes"],
                   record.get("info", {}))

    def figures(self) -> dict:
        return {"package": str(self.package), "bytes": self.bytes, "info": self.info}


def package_file_name(target: str) -> str:
    return f"edge-package-{target}.tar"


def package_stage(compiled: CompileResult, out_dir: Path, *, sample_files=None) -> PackageResult:
    """The edge package of a compiled model (its self-test samples from sample_files), with a stage
    manifest (its lineage assembled by write_manifest)."""
    out_dir = Path(out_dir)
    tar = out_dir / package_file_name(compiled.target)
    info = build_package(compiled.out_dir, tar, sample_files=list(sample_files) if sample_files else None)
    record = {"package": tar.name, "target": compiled.target, "bytes": tar.stat().st_size, "info": info}
    atomic_write_text(out_dir / PACKAGE_RESULT_JSON, json.dumps(record, indent=2) + "\n")
    # The package carries its own manifest inside; this one describes the stage directory.
    write_manifest(out_dir, "package", [compiled.library, compiled.report],
                   {"target": compiled.target})
    return PackageResult.load(out_dir)


@dataclass(frozen=True)
class VerifyResult:
    out_dir: Path
    report: dict

    @property
    def passed(self) -> bool:
        return bool(self.report["passed"])

    @classmethod
    def load(cls, out_dir: Path) -> "VerifyResult":
        return cls(Path(out_dir), _read_json(Path(out_dir) / VERIFY_JSON))

    def figures(self) -> dict:
        return {"report": self.report}


def verify_stage(package: PackageResult, out_dir: Path, *, sample_files, num_samples: int,
                 min_agreement: float) -> VerifyResult:
    """Run the package under qemu on validation samples; GateFailed when it disagrees with the host."""
    verify_package(package.package, sample_files=list(sample_files), num_samples=num_samples or 1_000_000,
                   min_agreement=min_agreement, out_dir=out_dir)
    result = VerifyResult.load(out_dir)
    if not result.passed:
        selftest = result.report.get("selftest") or {}
        if selftest and not selftest.get("passed", False):
            raise GateFailed(f"{Path(out_dir) / VERIFY_JSON}: the package's on-device self-test failed under qemu "
                             f"({selftest.get('error') or selftest})")
        worst = min(r["top1_agreement"] for r in result.report["routes"])
        raise GateFailed(f"{Path(out_dir) / VERIFY_JSON}: the edge build disagrees with the host "
                         f"(top-1 agreement {worst:.4f} < {min_agreement})")
    return result
