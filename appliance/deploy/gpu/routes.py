"""`appliance compile --target cuda-ort | tensorrt`: the GPU deploy routes beside TVM.

cuda-ort: the model as FP16 ONNX (float32 inputs/outputs) on onnxruntime-gpu's CUDA execution
provider. tensorrt: a serialized TensorRT engine built from the ONNX model with FP16 kernels,
and with --int8-calib also an INT8 engine. INT8 is explicit quantization: the calibration data
sets symmetric Q/DQ scales with onnxruntime (TensorRT accepts zero points of 0 only, and
implicit calibrators are deprecated since TensorRT 10), then TensorRT builds from the QDQ model.

Each build is compared with onnxruntime's CPU provider on the FP32 model (the same parity gate
as the TVM x86_64 build) and, on labelled samples, gets the accuracy report of `appliance
quantize` (accuracy.json, accuracy.html). Without a usable NVIDIA GPU both refuse with one line.
"""

from __future__ import annotations

import ctypes
import json
import statistics
import time
from pathlib import Path

from appliance.core.errors import DataError, EnvironmentProblem
from appliance.deploy.options import GPU_TARGETS  # noqa: F401 (the routes this module serves; tests list them here)
from appliance.deploy.accuracy_report import compare, write_reports
from appliance.deploy.onnx_model import image_input, load_onnx, metadata, ort_session, precision, quantize_fp16, run_ort
from appliance.deploy.samples import check_input_shape, load_samples
from appliance.core.manifest import atomic_write_text, write_manifest
from appliance.deploy.compiled import COMPILE_JSON

OPT_BATCH = 32  # TensorRT optimisation profile: batch 1..OPT_BATCH, tuned for OPT_BATCH
WORKSPACE_BYTES = 2 << 30


def cuda_devices() -> int:
    """Number of CUDA devices the NVIDIA driver reports; EnvironmentProblem saying why when none."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        raise EnvironmentProblem("no NVIDIA driver (libcuda.so.1 not found)") from None
    rc = libcuda.cuInit(0)
    if rc == 100:
        raise EnvironmentProblem("the NVIDIA driver sees no CUDA device (CUDA_ERROR_NO_DEVICE)")
    if rc != 0:
        raise EnvironmentProblem(f"cuInit failed with CUDA error {rc} (`appliance doctor` checks the driver)")
    count = ctypes.c_int(0)
    if libcuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
        raise EnvironmentProblem("the NVIDIA driver sees no CUDA device")
    return count.value


def require_gpu(target: str, model_path) -> None:
    """Refuse with one line, before touching the output directory, when the route cannot run here."""
    try:
        cuda_devices()
        if target == "cuda-ort":
            import onnxruntime as ort

            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise EnvironmentProblem(f"onnxruntime {ort.__version__} has no CUDAExecutionProvider "
                                         "(the trainer-cuda profile installs onnxruntime-gpu)")
        else:
            try:
                import tensorrt  # noqa: F401
            except ImportError as err:
                raise EnvironmentProblem(f"tensorrt does not import ({err}; the trainer-cuda profile "
                                         "carries tensorrt-cu13)") from None
    except EnvironmentProblem as err:
        raise EnvironmentProblem(f"{model_path}: --target {target} needs an NVIDIA GPU: {err}; build on the "
                                 "GPU host, or use --target x86_64/aarch64 (TVM)") from None


def build_lines(info: dict) -> list[str]:
    """What `appliance compile` prints for a GPU route's compile.json: one line per build."""
    lines = []
    for build in info["builds"]:
        c = build["check"]
        acc = build.get("accuracy")
        line = (f"wrote {build['artifact']} ({info['target']} {build['precision']}, {build['bytes'] / 1e6:.2f} MB) in "
                f"{build['build_seconds']:.1f} s; vs onnxruntime CPU FP32 on {c['samples']} samples: max abs diff "
                f"{c['max_abs_diff']:.3g}, top-1 agreement {c['top1_agreement']:.4f}; latency "
                f"{build['latency_ms']['batch1_median']:.3f} ms (batch 1)")
        if acc:
            line += f"; top-1 {acc['fp32']['top1'] * 100:.2f}% -> {acc['quantized']['top1'] * 100:.2f}%"
        lines.append(line)
    return lines


# --- the two runtimes, behind one callable: x (N,C,H,W float32) -> logits float32 -----------------

def cuda_ort_session(path):
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):  # onnxruntime >= 1.21: CUDA/cuDNN from the nvidia-* wheels torch uses
        try:
            ort.preload_dlls()
        except Exception:  # the session below says whether the CUDA provider started
            pass
    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(str(path), options,
                                       providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    except Exception as err:
        raise DataError(f"{path}: onnxruntime-gpu cannot load it ({str(err).splitlines()[0]})") from None
    if "CUDAExecutionProvider" not in session.get_providers():  # onnxruntime falls back to CPU silently
        raise EnvironmentProblem(f"{path}: onnxruntime's CUDA execution provider did not start "
                                 "(CUDA/cuDNN libraries or driver: see `appliance doctor`)")
    return session


class TensorRTEngine:
    """A deserialized engine with one image input and one logits output; buffers are torch CUDA tensors."""

    def __init__(self, engine_bytes: bytes, path):
        import tensorrt as trt

        self.runtime = trt.Runtime(trt.Logger(trt.Logger.ERROR))
        self.engine = self.runtime.deserialize_cuda_engine(engine_bytes)
        if self.engine is None:
            raise DataError(f"{path}: TensorRT cannot deserialize the engine")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        modes = {n: self.engine.get_tensor_mode(n) for n in names}
        self.input = next(n for n in names if modes[n] == trt.TensorIOMode.INPUT)
        self.output = next(n for n in names if modes[n] == trt.TensorIOMode.OUTPUT)

    def __call__(self, x, batch: int = OPT_BATCH):
        import numpy as np
        import torch

        outs = []
        stream = torch.cuda.current_stream()
        for i in range(0, len(x), batch):
            chunk = torch.from_numpy(np.ascontiguousarray(x[i:i + batch], dtype=np.float32)).cuda()
            self.context.set_input_shape(self.input, tuple(chunk.shape))
            out = torch.empty(tuple(self.context.get_tensor_shape(self.output)), dtype=torch.float32, device="cuda")
            self.context.set_tensor_address(self.input, chunk.data_ptr())
            self.context.set_tensor_address(self.output, out.data_ptr())
            if not self.context.execute_async_v3(stream.cuda_stream):
                raise EnvironmentProblem("TensorRT execute_async_v3 failed")
            stream.synchronize()
            outs.append(out.cpu().numpy())
        return np.concatenate(outs)


def weakly_typed() -> bool:
    """TensorRT still chooses precisions itself (BuilderFlag.FP16); newer releases build strongly typed
    networks only, where the ONNX model's own types (FP16 weights, Q/DQ nodes) decide."""
    import tensorrt as trt

    return hasattr(trt.BuilderFlag, "FP16")


def build_trt_engine(onnx_path: Path, input_name: str, chw: list, int8: bool) -> bytes:
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    weak = weakly_typed()
    # explicit batch is the only mode since TensorRT 10 (flags 0)
    flags = 0 if weak else 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_path.read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise DataError(f"{onnx_path}: TensorRT cannot parse it ({errors.splitlines()[0] if errors else 'no detail'})")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
    if weak:
        config.set_flag(trt.BuilderFlag.FP16)
        if int8 and hasattr(trt.BuilderFlag, "INT8"):
            config.set_flag(trt.BuilderFlag.INT8)  # Q/DQ nodes in the model say where; FP16 elsewhere
    profile = builder.create_optimization_profile()
    profile.set_shape(input_name, (1, *chw), (OPT_BATCH, *chw), (OPT_BATCH, *chw))
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise DataError(f"{onnx_path}: TensorRT could not build an engine (see the TensorRT messages above)")
    return bytes(serialized)


def symmetric_qdq(model_path: Path, out_path: Path, calib_x, input_name: str) -> None:
    """INT8 Q/DQ with zero points of 0 (what TensorRT accepts), calibrated on calib_x."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader:
        def __init__(self):
            self.i = 0

        def get_next(self):
            if self.i >= len(calib_x):
                return None
            self.i += 1
            return {input_name: calib_x[self.i - 1:self.i]}

        def rewind(self):
            self.i = 0

    prepared = out_path.with_name(".prepared.onnx")
    try:
        quant_pre_process(str(model_path), str(prepared), skip_symbolic_shape=True)
        quantize_static(str(prepared), str(out_path), Reader(), quant_format=QuantFormat.QDQ,
                        weight_type=QuantType.QInt8, activation_type=QuantType.QInt8, per_channel=True,
                        calibrate_method=CalibrationMethod.MinMax,
                        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})
    finally:
        prepared.unlink(missing_ok=True)
        for leftover in out_path.parent.glob("*augmented_model.onnx"):
            leftover.unlink()


# --- the build: artifacts, parity gate, accuracy report, manifest ----------------------------------

def _latency_ms(fn, x) -> dict:
    one, full = x[:1], x[:OPT_BATCH]
    for _ in range(5):
        fn(one)
    times = []
    for _ in range(30):
        start = time.perf_counter()
        fn(one)
        times.append((time.perf_counter() - start) * 1000)
    start = time.perf_counter()
    for _ in range(5):
        fn(full)
    batch_ms = (time.perf_counter() - start) * 1000 / 5
    return {"batch1_median": statistics.median(times), f"batch{len(full)}_mean": batch_ms,
            "samples_per_s": len(full) / (batch_ms / 1000)}


def _parity(got, expected, tolerance: float | None) -> dict:
    """max |got - expected| against tolerance x max(1, max |logit|); None: no logit bound (INT8)."""
    import numpy as np

    diff = float(np.abs(got.astype(np.float64) - expected).max())
    allowed = None if tolerance is None else tolerance * max(1.0, float(np.abs(expected).max()))
    return {"samples": int(len(got)), "max_abs_diff": diff, "allowed": allowed,
            "top1_agreement": float((got.argmax(1) == expected.argmax(1)).mean()),
            "passed": allowed is None or diff <= allowed}


def _accuracy(model_path, artifact, fp32_logits, logits, y, fp32_latency, latency, mode, max_drop) -> dict:
    fp32 = {"predictions": fp32_logits.argmax(1), "top1": float((fp32_logits.argmax(1) == y).mean()),
            "latency_ms_median": fp32_latency}
    built = {"predictions": logits.argmax(1), "top1": float((logits.argmax(1) == y).mean()),
             "latency_ms_median": latency}
    report = compare(model_path, artifact, fp32, built, mode, len(y), max_drop)
    report["made_by"] = "appliance compile"
    report["fp32"]["runtime"] = "onnxruntime CPUExecutionProvider"
    return report


def compile_gpu(model_path, target: str, out_dir, *, sample_files=None, tolerance=None, calib_files=None,
                max_drop: float = 1.0) -> dict:
    """The compile stage's builder for the GPU targets: refuses with one line, before touching out_dir,
    when this host cannot run target; returns compile.json's content."""
    import numpy as np

    require_gpu(target, model_path)
    model_path, out_dir = Path(model_path), Path(out_dir)
    model = load_onnx(model_path)
    inp = image_input(model, model_path)
    meta = metadata(model)
    preprocessing = meta.get("preprocessing", {})
    chw = [_dim(d, preprocessing, model_path, inp.name) for d in inp.shape[1:]]
    if sample_files:
        samples = load_samples(sample_files, preprocessing, limit=256)
        check_input_shape(samples, [1, *chw], inp.name, model_path)
        x, y = samples.x, samples.y
    else:
        x, y = np.random.default_rng(0).standard_normal((64, *chw)).astype(np.float32), None
    if precision(model) != "fp32":
        raise DataError(f"{model_path}: the GPU routes build FP16/INT8 themselves from the FP32 model of "
                        "`appliance export`; pass that one")
    out_dir.mkdir(parents=True, exist_ok=True)
    reference = ort_session(model_path)
    expected = run_ort(reference, x, batch=OPT_BATCH)
    cpu_ms = _latency_ms(lambda t: run_ort(reference, t, batch=OPT_BATCH), x)

    inputs = [model_path, *(Path(f) for f in sample_files or [])]
    if target == "cuda-ort":
        builds = _cuda_ort_builds(model, out_dir)
    else:
        builds, calib_inputs = _tensorrt_builds(model, model_path, out_dir, inp.name, chw, preprocessing, calib_files)
        inputs += calib_inputs
    results = [_measured(build, x, y, expected, cpu_ms, model_path, out_dir, target, tolerance, max_drop,
                         several=len(builds) > 1) for build in builds]

    info = {"made_by": "appliance compile", "source_model": str(model_path.resolve()), "target": target,
            "input": {"name": inp.name, "shape": ["batch", *chw], "dtype": "float32"},
            "reference": {"runtime": "onnxruntime CPUExecutionProvider, FP32", "latency_ms": cpu_ms},
            "versions": _runtime_versions(target), "builds": results, **meta}
    atomic_write_text(out_dir / COMPILE_JSON, json.dumps(info, indent=2, default=float) + "\n")
    write_manifest(out_dir, "compile", inputs, {"target": target, "input_shape": ["batch", *chw],
                                                "tolerance": tolerance, "max_drop": max_drop,
                                                "builds": [b["precision"] for b in results]})
    for build in results:
        if not build["passed"]:
            c = build["check"]
            raise DataError(f"{build['artifact']}: {target} {build['precision']} failed the parity gate (max abs "
                            f"diff {c['max_abs_diff']:.3g}, allowed {c['allowed'] if c['allowed'] is not None else 'any'}; top-1 agreement "
                            f"{c['top1_agreement']:.4f}); see {out_dir / COMPILE_JSON}")
    return info


def _cuda_ort_builds(model, out_dir: Path) -> list[tuple]:
    """cuda-ort: the FP16 model on onnxruntime's CUDA provider: [(name, artifact, seconds, run)]."""
    artifact = out_dir / "model.fp16.onnx"
    start = time.perf_counter()
    quantize_fp16(model, out_dir / ".model.fp16.onnx.tmp")
    (out_dir / ".model.fp16.onnx.tmp").replace(artifact)
    session = cuda_ort_session(artifact)
    seconds = time.perf_counter() - start
    return [("fp16", artifact, seconds, lambda t: run_ort(session, t, batch=OPT_BATCH))]


def _tensorrt_builds(model, model_path: Path, out_dir: Path, input_name: str, chw: list, preprocessing: dict,
                     calib_files) -> tuple[list[tuple], list[Path]]:
    """tensorrt: the FP16 engine, and the INT8 one when calib_files are given: ([(name, artifact, seconds,
    engine)], the calibration files read)."""
    fp16_source, inputs = model_path, []
    if not weakly_typed():  # strongly typed: the FP16 engine is built from an FP16 model
        fp16_source = out_dir / "model.fp16.onnx"
        quantize_fp16(model, fp16_source)
    plans = [("fp16", fp16_source, False)]
    if calib_files:
        calib = load_samples(calib_files, preprocessing, limit=256)
        check_input_shape(calib, [1, *chw], input_name, model_path)
        qdq = out_dir / "model.int8-qdq.onnx"
        symmetric_qdq(model_path, qdq, calib.x, input_name)
        plans.append(("int8", qdq, True))
        inputs += calib.files
    builds = []
    for name, source, int8 in plans:
        artifact = out_dir / f"model.{name}.engine"
        start = time.perf_counter()
        engine_bytes = build_trt_engine(source, input_name, chw, int8)
        atomic_write_bytes(artifact, engine_bytes)
        engine = TensorRTEngine(engine_bytes, artifact)
        builds.append((name, artifact, time.perf_counter() - start, engine))
    return builds, inputs


def _measured(build: tuple, x, y, expected, cpu_ms: dict, model_path: Path, out_dir: Path, target: str, tolerance,
              max_drop: float, several: bool) -> dict:
    """One build checked against onnxruntime FP32 (parity, latency; accuracy and its reports when labelled)."""
    name, artifact, seconds, fn = build
    default_tol = {"fp16": 1e-2, "int8": None}
    got = fn(x)
    tol = tolerance if tolerance is not None else default_tol[name]
    # INT8 logits differ from FP32 by far more than rounding: its gate is the top-1 drop (or agreement).
    check = _parity(got, expected, tol)
    latency = _latency_ms(fn, x)
    result = {"precision": name, "artifact": str(artifact), "bytes": artifact.stat().st_size,
              "build_seconds": round(seconds, 2), "check": check, "latency_ms": latency,
              "speedup_vs_cpu_batch1": cpu_ms["batch1_median"] / latency["batch1_median"]}
    if y is not None:
        acc = _accuracy(model_path, artifact, expected, got, y, cpu_ms["batch1_median"],
                        latency["batch1_median"], f"{target} {name}", max_drop)
        report_dir = out_dir / name if several else out_dir
        report_dir.mkdir(exist_ok=True)
        write_reports(report_dir, acc)
        result["accuracy"] = acc
        result["passed"] = check["passed"] and acc["gate_passed"]
    else:
        result["passed"] = check["passed"] and (tol is not None or check["top1_agreement"] >= 1 - max_drop / 100)
    return result


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def _runtime_versions(target: str) -> dict:
    if target == "cuda-ort":
        import onnxruntime as ort

        return {"onnxruntime": ort.__version__}
    import tensorrt as trt

    return {"tensorrt": trt.__version__}


def _dim(d, preprocessing: dict, path, name: str) -> int:
    if isinstance(d, int) and d > 0:
        return d
    if "image_size" not in preprocessing:
        raise DataError(f"{path}: input {name!r} has a symbolic image axis and no appliance preprocessing "
                        "metadata to fix it")
    return int(preprocessing["image_size"])
