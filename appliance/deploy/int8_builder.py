"""Many INT8 QDQ variants of one FP32 model: prepared once, calibrated once per method.

Sensitivity and fallback build dozens of variants (one layer quantized, one layer in float, the
most sensitive layers in float); each is a real onnxruntime `quantize_static` QDQ model, with
`nodes_to_quantize` / `nodes_to_exclude` naming the layers. Calibration is the slow part, so its
ranges are kept per method (onnxruntime's calibration cache, where this onnxruntime has one).
"""

from __future__ import annotations

import inspect
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
METHODS = ("minmax", "entropy", "percentile")


class CalibrationSet:
    """onnxruntime CalibrationDataReader over preprocessed samples, one tensor per call."""

    def __init__(self, input_name: str, x):
        self.input_name, self.x, self.i = input_name, x, 0

    def get_next(self):
        if self.i >= len(self.x):
            return None
        self.i += 1
        return {self.input_name: self.x[self.i - 1:self.i]}

    def rewind(self):
        self.i = 0


@dataclass(frozen=True)
class Recipe:
    """How one INT8 model is made: calibration method, weight scales, the layers kept in float, and
    whether activations are quantized symmetrically (zero point 0; onnxruntime's ActivationSymmetric)."""
    method: str = "minmax"
    per_channel: bool = False
    float_layers: tuple[str, ...] = ()
    symmetric_activations: bool = False

    def label(self) -> str:
        text = f"{self.method}{', per-channel' if self.per_channel else ''}"
        text += ", symmetric activations" if self.symmetric_activations else ""
        return text + (f", {len(self.float_layers)} float layer{'s' * (len(self.float_layers) != 1)}"
                       if self.float_layers else "")


@dataclass
class Layer:
    """A quantized layer: a node of the prepared model that reads at least one DequantizeLinear output."""
    name: str
    op_type: str
    weight_elements: int  # elements of its quantized initializers (what float costs in size: 3 bytes each)
    extra: dict = field(default_factory=dict)


class Int8Builder:
    """Builds QDQ models of model_path; call close() (or use `with`) to drop the prepared copy."""

    def __init__(self, model_path: Path, calib_x, input_name: str, scheme: str = "s8s8"):
        import onnx
        from onnxruntime.quantization.shape_inference import quant_pre_process

        self.calib_x, self.input_name, self.scheme = calib_x, input_name, scheme
        self.work = Path(tempfile.mkdtemp(prefix="appliance-int8-"))
        self.prepared = self.work / "prepared.onnx"
        # Folds and infers shapes first, as onnxruntime recommends before static quantization.
        quant_pre_process(str(model_path), str(self.prepared), skip_symbolic_shape=True)
        model = onnx.load(str(self.prepared))
        # nodes_to_exclude names nodes: a node without a name could never be kept in float.
        seen = set()
        for i, node in enumerate(model.graph.node):
            if not node.name or node.name in seen:
                node.name = f"{node.op_type}_{i}"
            seen.add(node.name)
        onnx.save(model, str(self.prepared))
        self._cache = "calibration_cache_path" in inspect.signature(_quantize_static()).parameters

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def build(self, out_path: Path, recipe: Recipe, only: tuple[str, ...] | None = None) -> Path:
        """Write the QDQ model of recipe to out_path; only: quantize just these layers."""
        from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType

        quantize_static = _quantize_static()
        extra = {}
        if self._cache:  # one calibration per method, however many variants
            extra["calibration_cache_path"] = str(self.work / f"ranges-{recipe.method}.json")
        if recipe.symmetric_activations:  # scales only: the calibrated ranges are the same either way
            extra["extra_options"] = {"ActivationSymmetric": True}
        quantize_static(
            str(self.prepared), str(out_path), CalibrationSet(self.input_name, self.calib_x),
            quant_format=QuantFormat.QDQ, weight_type=QuantType.QInt8, per_channel=recipe.per_channel,
            activation_type=QuantType.QInt8 if self.scheme == "s8s8" else QuantType.QUInt8,
            reduce_range=self.scheme == "u8s8",
            nodes_to_quantize=list(only) if only is not None else None,
            nodes_to_exclude=list(recipe.float_layers) or None,
            calibrate_method={"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
                              "percentile": CalibrationMethod.Percentile}[recipe.method], **extra)
        for leftover in Path(out_path).parent.glob("*augmented_model.onnx"):
            leftover.unlink()
        return Path(out_path)


def _quantize_static():
    from onnxruntime.quantization import quantize_static

    return quantize_static


def quantized_layers(qdq_model) -> list[Layer]:
    """The layers of a QDQ model in graph order: every non-Q/DQ node fed by a DequantizeLinear."""
    producers = {out: node for node in qdq_model.graph.node for out in node.output}
    initializers = {t.name: t for t in qdq_model.graph.initializer}
    layers = []
    for node in qdq_model.graph.node:
        if node.op_type in QDQ_OPS:
            continue
        dq = [producers[i] for i in node.input if i in producers and producers[i].op_type == "DequantizeLinear"]
        if not dq:
            continue
        weights = 0
        for d in dq:
            if d.input[0] in initializers:
                weights += _elements(initializers[d.input[0]])
        layers.append(Layer(node.name, node.op_type, weights))
    return layers


def _elements(tensor) -> int:
    n = 1
    for d in tensor.dims:
        n *= d
    return n
