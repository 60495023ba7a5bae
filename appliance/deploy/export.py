"""`appliance export`: a trained model -> ONNX, checked and proven equal to PyTorch on samples."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

from appliance.core.errors import DataError
from appliance.deploy.options import DEFAULT_MAX_REL_ERROR, OPSETS
from appliance.models import CARD_NAME, WEIGHTS_NAME, ModelCard, load_trained_model
from appliance.tasks import task_of_card
from appliance.deploy.qat import fold_constant_quantization
from appliance.deploy.onnx_model import load_onnx, ort_session, run_ort
from data_tools.preprocessing import preprocessing_of
from appliance.deploy.samples import load_samples, synthetic_samples
from appliance.core.manifest import atomic_write_text, write_manifest
from appliance.core.html_report import columns_svg, page
from appliance import __version__
from appliance.core.stage import Figures, flat_figures, read_result_json

EXPORTED_MODEL = "model.onnx"
QAT_CARD_KEY = "qat"  # appliance.tasks.fake_quant.CARD_KEY: a card of a quantization-aware run
# A QAT model's default parity bound: torch and onnxruntime may round a value exactly between two INT8
# steps apart (one step of one activation), which the exact-float bound would call a failed export.
QAT_MAX_REL_ERROR = 1e-2
PARITY_JSON = "parity.json"
PARITY_HTML = "parity.html"



def find_model_dir(path) -> Path:
    """RUN_DIR -> RUN_DIR/model; a trained-model or checkpoint directory -> itself."""
    path = Path(path)
    for candidate in (path, path / "model"):
        if (candidate / CARD_NAME).is_file():
            return candidate
    raise DataError(f"{path}: not a run directory or trained-model directory (no {CARD_NAME} "
                    f"in it or in {path / 'model'})")


def parse_batch(text: str):
    if text == "dynamic":
        return None
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise DataError(f"--batch: expected 'dynamic' or a positive integer, got {text!r}")


def export_model(model_path, out_dir, *, opset=17, batch=None, sample_files=None, num_samples=64,
                 max_rel_error=DEFAULT_MAX_REL_ERROR) -> dict:
    import numpy as np

    import onnx
    import torch

    problem = OPSETS.problem(opset)
    if problem:
        raise DataError(f"opset {problem}")
    model_dir = find_model_dir(model_path)
    card = ModelCard.read(model_dir / CARD_NAME)
    build = task_of_card(card).build_model  # the task's architectures
    qat = QAT_CARD_KEY in card.extra
    if qat and max_rel_error == DEFAULT_MAX_REL_ERROR:
        max_rel_error = QAT_MAX_REL_ERROR
    if qat:  # a quantization-aware run: its fake-quantized model, exported as QDQ
        from appliance.tasks.fake_quant import insert_fake_quant  # late: torch, as above

        def build(*args, _plain=build, **kwargs):
            return insert_fake_quant(_plain(*args, **kwargs))
    model, card = load_trained_model(model_dir, build=build)
    preprocessing = preprocessing_of(card)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    samples = (load_samples(sample_files, preprocessing, limit=num_samples) if sample_files
               else synthetic_samples(preprocessing, card.in_channels, 16))
    c, s = card.in_channels, card.image_size
    if samples.x.shape[1:] != (c, s, s):
        raise DataError(f"{samples.files[0] if samples.files else 'samples'}: samples have shape "
                        f"{tuple(samples.x.shape[1:])}, the model card says ({c}, {s}, {s})")

    onnx_path, tmp = out_dir / "model.onnx", out_dir / ".model.onnx.tmp"
    example = torch.from_numpy(samples.x[: batch or 1])
    if len(example) < (batch or 1):
        example = torch.zeros((batch, c, s, s))
    dynamic = None if batch else {"input": {0: "batch"}, "logits": {0: "batch"}}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        # The TorchScript exporter: the dynamo one needs onnxscript, which the appliance does not ship.
        torch.onnx.export(model, (example,), str(tmp), dynamo=False, input_names=["input"],
                          output_names=["logits"], dynamic_axes=dynamic, opset_version=opset)
    proto = onnx.load(str(tmp))
    if qat:
        fold_constant_quantization(proto)  # int8 weight initializers, as PTQ writes them
    proto = onnx.shape_inference.infer_shapes(proto, strict_mode=True)
    proto.producer_name, proto.producer_version = "appliance export", _version()
    proto.doc_string = f"{card.architecture} exported from {model_dir.resolve()} by appliance export"
    for key, value in (("appliance.preprocessing", preprocessing),
                       ("appliance.class_names", list(card.class_names)),
                       ("appliance.model_card", json.loads(card.to_json()))):
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, json.dumps(value)
    onnx.save(proto, str(tmp))
    load_onnx(tmp)  # checker + our input rules, before it replaces a previous good export
    tmp.replace(onnx_path)

    with torch.no_grad():
        expected = torch.cat([model(torch.from_numpy(samples.x[i:i + 64])) for i in range(0, len(samples.x), 64)]).numpy()
    got = run_ort(ort_session(onnx_path), samples.x, batch=batch)
    parity = parity_report(expected, got, samples.source, max_rel_error)
    report = {"made_by": "appliance export", "model_dir": str(model_dir.resolve()), "opset": opset,
              "batch": batch or "dynamic", "preprocessing": preprocessing,
              "class_names": list(card.class_names), "parity": parity}
    atomic_write_text(out_dir / PARITY_JSON, json.dumps(report, indent=2) + "\n")
    task = card.extra.get("task")
    if isinstance(task, dict):  # a segmentation model: logits (N, K, H, W), agreement per pixel
        report["task"] = {**task, "output": "logits [N, K, H, W]"}
    atomic_write_text(out_dir / PARITY_HTML,
                      parity_html(report, np.abs(expected - got).reshape(len(expected), -1).max(1)))
    atomic_write_text(out_dir / CARD_NAME, card.to_json())
    write_manifest(out_dir, "export", [model_dir / WEIGHTS_NAME, model_dir / CARD_NAME, *samples.files],
                   {"opset": opset, "batch": batch or "dynamic", "max_rel_error": max_rel_error,
                    "preprocessing": preprocessing, "class_names": list(card.class_names)})
    if not parity["passed"]:
        raise DataError(f"{onnx_path}: ONNX differs from PyTorch: max relative error "
                        f"{parity['max_rel_error']:.3g} > {max_rel_error:g} (see {out_dir / PARITY_JSON}; "
                        "--max-rel-error to accept)")
    return report


def parity_report(expected, got, source: str, max_rel_error: float) -> dict:
    import numpy as np

    diff = np.abs(expected.astype(np.float64) - got.astype(np.float64))
    scale = max(float(np.abs(expected).max()), 1e-12)
    max_rel = float(diff.max() / scale)
    return {"samples": int(len(expected)), "source": source, "max_abs_error": float(diff.max()),
            "max_rel_error": max_rel, "relative_to": "max |pytorch logit|",
            "top1_agreement": float((expected.argmax(1) == got.argmax(1)).mean()),
            "max_rel_error_allowed": max_rel_error, "passed": bool(max_rel <= max_rel_error)}


def parity_html(report: dict, per_sample) -> str:
    p = report["parity"]
    body = (f"<p>{p['samples']} {p['source']} samples through PyTorch and onnxruntime: max abs error "
            f"{p['max_abs_error']:.3g}, max relative error {p['max_rel_error']:.3g} (allowed "
            f"{p['max_rel_error_allowed']:g}, relative to the largest PyTorch logit), top-1 agreement "
            f"{p['top1_agreement'] * 100:.2f}%.</p>"
            + columns_svg("max |pytorch - onnxruntime| logit per sample", [float(v) for v in per_sample]))
    return page("ONNX export parity", "appliance export", PARITY_JSON, p["passed"], body)


def _version() -> str:
    return __version__


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
        return cls(out_dir, model, model.stat().st_size if model.exists() else 0, read_result_json(out_dir / PARITY_JSON))

    def figures(self) -> Figures:
        """The model, its size and parity.json flat ("parity.top1_agreement", "parity.max_rel_error", ...)."""
        return {"model": str(self.model), "bytes": self.bytes, **flat_figures(self.parity)}


def export_stage(model_dir: Path, out_dir: Path, *, opset: int, sample_files, max_rel_error: float,
                 batch: int | None = None, num_samples: int = 64) -> ExportResult:
    """Export model_dir (a run or trained-model directory) to ONNX; DataError when parity fails.
    batch: None for a dynamic batch axis."""
    export_model(model_dir, out_dir, opset=opset, batch=batch, sample_files=list(sample_files or []) or None,
                 num_samples=num_samples, max_rel_error=max_rel_error)
    return ExportResult.load(out_dir)
