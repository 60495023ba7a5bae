"""`appliance quantize`: FP32 ONNX -> INT8 (onnxruntime static QDQ) or FP16, gated on top-1 drop.

INT8 is S8S8 QDQ by default: onnxruntime's U8S8 kernels saturate on AVX2 CPUs without VNNI
(measured up to 7.7 % output error) unless weights use 7 bits (`--scheme u8s8`, reduce_range),
and QDQ is the form TVM can import. Calibration and evaluation tensors go
through the same preprocessing as export and the edge runner.
"""

from __future__ import annotations

from pathlib import Path

from appliance.core.errors import DataError
from appliance.deploy.accuracy_report import compare, evaluate, write_reports
from appliance.deploy.onnx_model import image_input, load_onnx, metadata, ort_session, quantize_fp16
from appliance.deploy.samples import check_input_shape, load_samples
from appliance.core.manifest import write_manifest



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


def quantize_int8(model_path: Path, out_path: Path, calib_x, input_name: str, method: str, per_channel: bool,
                  scheme: str = "s8s8"):
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    prepared = out_path.with_name(".prepared.onnx")
    try:
        # Folds and infers shapes first, as onnxruntime recommends before static quantization.
        quant_pre_process(str(model_path), str(prepared), skip_symbolic_shape=True)
        quantize_static(str(prepared), str(out_path), CalibrationSet(input_name, calib_x),
                        quant_format=QuantFormat.QDQ, weight_type=QuantType.QInt8, per_channel=per_channel,
                        activation_type=QuantType.QInt8 if scheme == "s8s8" else QuantType.QUInt8,
                        reduce_range=scheme == "u8s8",
                        calibrate_method={"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
                                          "percentile": CalibrationMethod.Percentile}[method])
    finally:
        prepared.unlink(missing_ok=True)
        for leftover in out_path.parent.glob("*augmented_model.onnx"):
            leftover.unlink()


def quantize_model(model_path, calib_files, out_dir, *, val_files=None, mode="int8", method="minmax",
                   per_channel=False, scheme="s8s8", calib_samples=128, val_samples=1000, max_drop=1.0) -> dict:
    import onnx

    model_path, out_dir = Path(model_path), Path(out_dir)
    model = load_onnx(model_path)
    inp = image_input(model, model_path)
    preprocessing = metadata(model).get("preprocessing", {})
    calib = load_samples(calib_files, preprocessing, limit=calib_samples)
    check_input_shape(calib, inp.shape, inp.name, model_path)
    val = load_samples(val_files or calib_files, preprocessing, limit=val_samples)
    check_input_shape(val, inp.shape, inp.name, model_path)
    if val.y is None:
        raise DataError(f"{val.files[0]}: validation data has no labels (need image/class/label, or 'y' in the .npz)")

    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / f"model.{mode}.onnx"
    tmp = out_dir / f".model.{mode}.onnx.tmp"
    clamped = 0
    if mode == "int8":
        quantize_int8(model_path, tmp, calib.x, inp.name, method, per_channel, scheme)
    else:
        clamped = quantize_fp16(model, tmp)
    quantized = onnx.load(str(tmp))
    del quantized.metadata_props[:]
    quantized.metadata_props.extend(model.metadata_props)  # preprocessing and class names travel on
    quantized.producer_name = f"appliance quantize --mode {mode}"
    onnx.save(quantized, str(tmp))
    tmp.replace(out_path)

    report = compare(model_path, out_path, evaluate(ort_session(model_path), val.x, val.y),
                     evaluate(ort_session(out_path), val.x, val.y), mode, len(val.x), max_drop)
    report.update({"method": method if mode == "int8" else None, "per_channel": per_channel,
                   "format": f"QDQ {scheme.upper()}{' reduce_range' if scheme == 'u8s8' else ''}" if mode == "int8" else "float16, float32 inputs/outputs",
                   "calibration_samples": int(len(calib.x)), "fp16_clamped_weight_warnings": clamped,
                   "validation_source": "calibration data (no --val given)" if not val_files else "--val"})
    write_reports(out_dir, report)
    write_manifest(out_dir, "quantize", [model_path, *calib.files, *(val.files if val_files else [])],
                   {"mode": mode, "method": method, "per_channel": per_channel, "scheme": scheme, "calib_samples": calib_samples,
                    "max_drop": max_drop, "gate_passed": report["gate_passed"]})
    return report
