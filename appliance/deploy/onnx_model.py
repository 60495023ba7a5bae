"""Reading an ONNX model the way every deploy stage needs it: checked, with its one image input.

Stages after export accept any ONNX file a user hands them, so the checks here turn the
usual protobuf/onnxruntime tracebacks into one line that names the file.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

from appliance.core.errors import DataError
from appliance.models import check_tensor_sizes

METADATA_KEYS = ("appliance.preprocessing", "appliance.class_names", "appliance.model_card")


@dataclass
class ModelInput:
    name: str
    shape: list  # ints, or strings for symbolic axes ("batch")


def load_onnx(path):
    """The onnx.ModelProto at path, checked with onnx.checker; DataError for anything else."""
    import onnx

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: " + ("not a regular file (a folder, device or pipe)" if Path(path).exists() else "no such file"))
    try:
        model = onnx.load(str(path))
        onnx.checker.check_model(model)
    except Exception as err:  # onnx raises DecodeError, ValidationError, and plain ones
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"{path}: not a valid ONNX model ({first})") from None
    if not model.graph.node:
        raise DataError(f"{path}: not a valid ONNX model (the graph has no nodes)")
    check_tensor_sizes(model, path)
    _check_no_loops(model.graph, path)
    _check_finite_weights(model, path)
    return model


LOOPING_OPS = ("Loop", "Scan")


def _check_no_loops(graph, path) -> None:
    """A Loop or Scan (in the graph or any branch of it) runs as often as its data says: a trip count
    of 2^40 hangs onnxruntime's calibration, and TVM cannot import either; an image model has none."""
    for node in graph.node:
        if node.op_type in LOOPING_OPS:
            raise DataError(f"{path}: {node.op_type} node {node.name or node.output[0]!r}: a loop in the graph "
                            "(an image model needs none; TVM cannot compile it, onnxruntime would run it as long "
                            "as its trip count says)")
        for attribute in node.attribute:
            for sub in [attribute.g, *attribute.graphs] if attribute.HasField("g") else attribute.graphs:
                _check_no_loops(sub, path)


def _check_finite_weights(model, path) -> None:
    """NaN or infinite weights named as such, not as a calibration assertion or a runtime mismatch later."""
    import numpy as np
    from onnx import numpy_helper

    for tensor in model.graph.initializer:
        values = numpy_helper.to_array(tensor)
        if values.dtype.kind != "f" or values.size == 1:  # a lone +-inf is a bound (Clip, a mask), not a weight
            continue
        bad = int(values.size - np.isfinite(values).sum())
        if bad:
            raise DataError(f"{path}: initializer {tensor.name!r} holds {bad} NaN or infinite value(s) of "
                            f"{values.size}: not usable weights (a diverged training run?)")


def image_input(model, path) -> ModelInput:
    """The model's single float image input (batch, C, H, W), or one line saying what is there."""
    from onnx import TensorProto

    initializers = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializers]
    found = ", ".join(f"{i.name}{_shape(i)}" for i in inputs) or "none"
    images = [i for i in inputs if i.type.tensor_type.elem_type in (TensorProto.FLOAT, TensorProto.FLOAT16)
              and len(i.type.tensor_type.shape.dim) == 4]
    if len(inputs) != 1 or len(images) != 1:
        raise DataError(f"{path}: expected one float image input shaped (batch, C, H, W); found inputs: {found}")
    shape = _shape(images[0])
    if any(isinstance(d, int) and d <= 0 for d in shape):
        raise DataError(f"{path}: input {images[0].name!r} is shaped {shape}: an image input's sizes are positive")
    return ModelInput(images[0].name, shape)


def _shape(value_info) -> list:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
            for d in value_info.type.tensor_type.shape.dim]


def precision(model) -> str:
    """"fp16" when the weights are float16 (outputs then differ from other runtimes by ~1e-3 relative)."""
    from onnx import TensorProto

    return "fp16" if any(t.data_type == TensorProto.FLOAT16 for t in model.graph.initializer) else "fp32"


def default_tolerance(model_precision: str) -> float:
    """Allowed max |a - b| logit between two runtimes, times max(1, max |logit|)."""
    return 1e-2 if model_precision == "fp16" else 1e-4


def metadata(model) -> dict:
    """Our metadata_props (preprocessing, class names, model card) decoded from JSON."""
    props = {p.key: p.value for p in model.metadata_props}
    return {key.split(".", 1)[1]: json.loads(props[key]) for key in METADATA_KEYS if key in props}


def ort_session(path, optimize: bool = True, spinning: bool = True):
    """An onnxruntime CPU session. optimize=False keeps QDQ nodes as written (what TVM imports);
    spinning=False: its threads do not spin after a call (for benchmarks that alternate routes)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as err:
        raise DataError(f"{path}: onnxruntime cannot load it ({str(err).splitlines()[0]})") from None


def run_ort(session, x, batch: int | None = None):
    """Logits for x (N,C,H,W), fed in chunks of `batch` when the model has a fixed batch size."""
    import numpy as np

    name = session.get_inputs()[0].name
    dtype = np.float16 if "float16" in session.get_inputs()[0].type else np.float32
    fixed = session.get_inputs()[0].shape[0]
    step = fixed if isinstance(fixed, int) and fixed > 0 else (batch or len(x))
    outs = []
    for i in range(0, len(x), step):
        chunk = x[i:i + step].astype(dtype)
        if len(chunk) < step:  # a fixed batch axis: pad the last chunk, keep only the real rows
            chunk = np.concatenate([chunk, np.zeros((step - len(chunk), *chunk.shape[1:]), dtype)])
        outs.append(session.run(None, {name: chunk})[0][:len(x) - i])
    return np.concatenate(outs).astype(np.float32)


def quantize_fp16(model, out_path: Path) -> int:
    """model (an onnx ModelProto) as FP16 with float32 inputs and outputs, saved to out_path; returns the
    number of weights clamped to float16's range."""
    import onnx
    from onnxconverter_common import float16

    # keep_io_types: callers still feed float32 tensors and read float32 logits. The converter warns
    # once per weight it clamps to float16's range; the accuracy report measures what that costs.
    with warnings.catch_warnings(record=True) as clamped:
        warnings.simplefilter("always", UserWarning)
        onnx.save(float16.convert_float_to_float16(model, keep_io_types=True), str(out_path))
    return len(clamped)
