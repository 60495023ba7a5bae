"""`appliance compile`: ONNX -> a TVM 0.27 Relax library for the edge CPU (or the host, checked).

ARM targets are cross-compiled with aarch64-linux-gnu-g++; the x86_64 host build is loaded back
and compared with onnxruntime, so a numerical problem in TVM shows up here, not on a device.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from appliance.core.errors import DataError, EnvironmentProblem

CROSS_COMPILER = "aarch64-linux-gnu-g++"
TARGETS = {
    "aarch64": {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]},
    "aarch64-dotprod": {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon", "+dotprod"]},
    "x86_64": {"kind": "llvm", "mtriple": "x86_64-linux-gnu"},  # mcpu: the host's, added at compile time
}
ELF_MACHINE = {"aarch64": 183, "x86_64": 62}
INT8_COMPUTE = ("int8", "simulated")
INT8_KERNELS = ("auto", "generic")  # auto: the CPU's dot-product kernels where this build has them (x86_int8.py)
FP32_KERNELS = ("auto", "generic")  # auto: register-tiled float32 convolutions where the CPU has a vector unit (cpu_conv.py)
# Default check of a QDQ model: output quantization steps allowed. The float32 reference's rounding
# moves values across quantization boundaries and deep nets carry that on (measured up to 7 steps on
# an untrained MobileNetV2, 98 % of logits within 2); real errors (a wrong scale) are tens of steps.
QDQ_UNITS = 8


def target_for(name: str) -> dict:
    from tvm.target import codegen

    target = dict(TARGETS[name])
    if name == "x86_64":
        target["mcpu"] = codegen.llvm_get_system_cpu()
    return target


def refuse_failed_gate(model_path) -> None:
    """A model from a quantize run whose top-1 drop exceeded --max-drop does not go to devices by accident."""
    import json

    manifest = Path(model_path).parent / "manifest.json"
    try:
        params = json.loads(manifest.read_text()).get("params", {})
        stage = json.loads(manifest.read_text()).get("stage")
    except (OSError, json.JSONDecodeError):
        return
    if stage == "quantize" and params.get("gate_passed") is False:
        raise DataError(f"{model_path}: failed the accuracy gate of `appliance quantize` (see "
                        f"{manifest.parent / 'accuracy.html'}); re-quantize, or pass --allow-failed-gate")


def check_cross_compiler() -> str:
    path = shutil.which(CROSS_COMPILER)
    if path is None:
        raise EnvironmentProblem(f"{CROSS_COMPILER}: cross compiler not found on PATH (install Debian's "
                                 "g++-aarch64-linux-gnu, e.g. `installer/bootstrap.sh --system`)")
    return path


def find_unsupported(model) -> list[str]:
    """'OpType (node NAME)' for each node TVM's ONNX importer has no converter for."""
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

    known = _get_convert_map()
    standard = ("", "ai.onnx")
    return [f"{n.op_type} (node {n.name or '?'})" for n in model.graph.node
            if n.domain not in standard or n.op_type not in known]


def import_relax(model, path, shape: list):
    """The Relax IRModule for the ONNX model at a fixed input shape; one line when TVM cannot."""
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    unsupported = find_unsupported(model)
    if unsupported:
        raise DataError(f"{path}: TVM cannot import operator {', '.join(unsupported[:3])}"
                        f"{' and more' if len(unsupported) > 3 else ''}; compile the FP32 model or the "
                        "FP16/QDQ one from `appliance quantize` instead")
    from appliance.deploy.compiler.frontend import fold_shapes

    name = next(i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer})
    model = fold_shapes(model, name, shape)
    try:
        mod = from_onnx(model, shape_dict={name: shape}, keep_params_in_input=False)
    except Exception as err:
        raise DataError(f"{path}: TVM could not import the model ({type(err).__name__}: "
                        f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}); "
                        "try the FP32 or FP16 model") from None
    return relax.transform.DecomposeOpsForInference()(mod)


def compile_model(model_path, target_name: str, out_dir, *, sample_files=None, tolerance=None,
                  batch: int = 1, tune_trials: int | None = None, tuning_db=None, int8_compute: str = "int8",
                  installed_tuning: bool = True, rpc: str | None = None, rpc_key: str = "", int8_kernels: str = "auto",
                  fp32_kernels: str = "auto", log=print) -> dict:
    """installed_tuning: apply the installed tuning databases made for this target and CPU
    (appliance.assets.tuning_db) when neither tune_trials nor tuning_db is given. rpc: HOST:PORT of a TVM
    RPC server on the target device that times the tuning candidates (tune_rpc.py)."""
    import time

    import tvm
    import tvm.support.cc

    from appliance.deploy.compiler.passes.int8_arith import classify_layers, output_scale, rewrite_int8
    from appliance.deploy.onnx_model import default_tolerance, image_input, load_onnx, metadata, precision
    from appliance.deploy.compiler.runtime import use_physical_cores
    from appliance.core.manifest import atomic_write_text, write_manifest

    use_physical_cores()  # before tuning, the check and the latency run TVM here: all the cores, not half

    cross = target_name.startswith("aarch64")
    if cross:
        check_cross_compiler()
    model_path = Path(model_path)
    model = load_onnx(model_path)
    inp = image_input(model, model_path)
    meta = metadata(model)
    model_precision = precision(model)
    if int8_compute not in INT8_COMPUTE:
        raise DataError(f"{model_path}: --int8-compute must be one of {', '.join(INT8_COMPUTE)}, not {int8_compute!r}")
    if int8_kernels not in INT8_KERNELS:
        raise DataError(f"{model_path}: --int8-kernels must be one of {', '.join(INT8_KERNELS)}, not {int8_kernels!r}")
    if fp32_kernels not in FP32_KERNELS:
        raise DataError(f"{model_path}: --fp32-kernels must be one of {', '.join(FP32_KERNELS)}, not {fp32_kernels!r}")
    if rpc and not tune_trials:
        raise DataError(f"--rpc {rpc}: the RPC server times tuning candidates; add --tune N")
    step = output_scale(model)  # a QDQ model's output quantization step, None for float outputs
    tolerance = default_tolerance(model_precision) if tolerance is None else tolerance
    shape = [batch, *[_dim(d, meta, model_path, inp) for d in inp.shape[1:]]]

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    mod = import_relax(model, model_path, shape)
    if int8_compute == "int8":
        mod = rewrite_int8(mod)
    layers = classify_layers(mod, model)
    target = target_for(target_name)
    mod, kernels = _int8_kernels(mod, target, layers, int8_kernels, log)
    mod, fp32 = _fp32_kernels(mod, target, layers, fp32_kernels, log)
    epilogues = {"kernels": 0, "fused": 0, "glue_scheduled": 0}
    if fp32["layers"] or kernels["layers"] or kernels["depthwise"]:
        from appliance.deploy.compiler.kernels.cpu_simd import fuse_epilogues
        from appliance.deploy.compiler.passes.glue_schedule import schedule_glue

        mod, epilogues["kernels"], epilogues["fused"] = fuse_epilogues(mod)
        mod, epilogues["glue_scheduled"] = schedule_glue(mod)
        log(f"compile: {epilogues['fused']} of {epilogues['kernels']} kernels compute the elementwise ops after "
            f"them in their write-back; {epilogues['glue_scheduled']} glue functions (padding, layout) run on all cores")
    tuning, installed, tuned_tasks = None, [], 0
    if tune_trials or tuning_db:
        mod, target, tuning = _tuned(mod, model_path, target_name, target, out_dir, tune_trials, tuning_db, log,
                                     rpc, rpc_key)
        tuned_tasks = tuning["tasks"]
    elif installed_tuning:
        from appliance.deploy.compiler.tuning.search import apply_installed

        mod, target, installed, tuned_tasks = apply_installed(mod, target_name, target, log)
    executable = tvm.compile(mod, target=tvm.target.Target(target))
    library, tmp = out_dir / "model.so", out_dir / ".model.so.tmp.so"
    if cross:
        executable.export_library(str(tmp), fcompile=tvm.support.cc.cross_compiler(CROSS_COMPILER))
    else:
        executable.export_library(str(tmp))
    _check_elf(tmp, ELF_MACHINE["aarch64" if cross else "x86_64"])
    tmp.replace(library)
    seconds = time.perf_counter() - start
    shutil.copyfile(model_path, out_dir / ".model.onnx.tmp")
    (out_dir / ".model.onnx.tmp").replace(out_dir / "model.onnx")  # the reference edge verify compares with

    info = {"made_by": "appliance compile", "source_model": str(model_path.resolve()), "target": target_name,
            "tvm_target": target, "input": {"name": inp.name, "shape": shape, "dtype": "float32"},
            "precision": model_precision, "int8_compute": int8_compute, "layers": layers, "int8_kernels": kernels,
            "fp32_kernels": fp32, "kernel_epilogues": epilogues,
            "tuned_tasks": tuned_tasks, "installed_tuning": installed,
            "library": str(library), "library_bytes": library.stat().st_size,
            "compile_seconds": round(seconds, 2), "host_latency_ms": None, **meta}
    if tuning:
        info["tuning"] = tuning
    if not cross:
        info["check"] = check_against_ort(library, model_path, shape, sample_files, meta, tolerance, inp.name,
                                          output_step=step)
        info["host_latency_ms"] = host_latency_ms(library, shape)
    atomic_write_text(out_dir / "compile.json", json.dumps(info, indent=2) + "\n")
    inputs = [model_path, *(Path(f) for f in sample_files or [])]
    from appliance.assets.tuning_db import FILES

    applied = [tuning["database"]] if tuning else [e["database"] for e in installed if e["applied"]]
    inputs += [Path(db) / name for db in applied for name in FILES]  # the schedules in model.so came from these
    write_manifest(out_dir, "compile", inputs, {"target": target_name, "tvm_target": target,
                                                 "int8_compute": int8_compute, "int8_kernels": int8_kernels,
                                                 **({"fp32_kernels": fp32_kernels} if fp32_kernels != "auto" else {}),
                                                 "input_shape": shape, "tolerance": tolerance,
                                                 **({"tuning": tuning} if tuning else {}),
                                                 **({"installed_tuning": installed} if installed else {})})
    if not cross and not info["check"]["passed"]:
        raise DataError(f"{library}: TVM output differs from onnxruntime by {info['check']['max_abs_diff']:.3g} "
                        f"(allowed {info['check']['allowed']:.3g}); see {out_dir / 'compile.json'}")
    return info


def _int8_kernels(mod, target: dict, layers: dict, choice: str, log) -> tuple:
    """The int8 conv2d layers on this build's CPU kernels: groups 1 on the dot-product ones (x86_64
    with AVX-512 VNNI: x86_int8.py), depthwise on the vector ones (cpu_conv.py), the rest on TVM's
    generic ones: (mod, {"kind", "layers", "depthwise", "matmuls", "reason"}) for compile.json. With
    VNNI the int8 matmuls run on its kernels too, as 1x1 convolutions (cpu_dense.py)."""
    if not layers.get("int8"):
        return mod, {"kind": "none", "layers": 0, "depthwise": 0, "matmuls": 0, "pixels": 0, "handoffs": 0, "reason": "no int8 layers"}
    if choice == "generic":
        return mod, {"kind": "generic", "layers": 0, "depthwise": 0, "matmuls": 0, "pixels": 0, "handoffs": 0, "reason": "--int8-kernels generic"}
    from appliance.deploy.compiler.kernels import cpu_simd as cpu_conv
    from appliance.deploy.compiler.kernels import x86_vnni as x86_int8
    from appliance.deploy.compiler.passes.dense_as_conv import matmuls_as_convs

    depthwise = 0
    tile = cpu_conv.tile_for(target)
    if tile is not None:
        mod, depthwise = cpu_conv.use_depthwise_int8_kernels(mod, tile)
    if not x86_int8.has_vnni(target):
        reason = f"no dot-product kernels here for {target.get('mtriple')} {target.get('mcpu', '')}".strip()
        log(f"compile: {depthwise} depthwise int8 layers on {tile[0]} vector kernels; {reason}" if tile else
            f"compile: int8 layers on generic kernels; {reason}")
        return mod, {"kind": "generic", "layers": 0, "depthwise": depthwise, "matmuls": 0, "pixels": 0, "handoffs": 0, "reason": reason}
    from appliance.deploy.compiler.passes.layout_handover import blocked_handoff

    mod, matmuls = matmuls_as_convs(mod, {"int8"})
    mod, count = x86_int8.use_vnni_kernels(mod)
    mod, handoffs = blocked_handoff(mod)
    pixels = _pixel_kernels(mod, "vnni_conv2d_pixels_")
    log(f"compile: {count} of {layers['int8']} int8 layers on AVX-512 VNNI kernels ({matmuls} of them matmuls, as "
        f"1x1 convolutions; {pixels} with 16 pixels a vector; {handoffs} writing the depthwise layout after "
        f"them), {depthwise} depthwise on vector kernels")
    return mod, {"kind": "x86-vnni", "layers": count, "depthwise": depthwise, "matmuls": matmuls, "pixels": pixels,
                 "handoffs": handoffs, "reason": None}


def _pixel_kernels(mod, prefix: str) -> int:
    """How many layers of mod run on a kernel with 16 pixels a vector (cpu_pixels.py): its calls of
    the functions added under that name (layers of the same shapes share one function)."""
    from tvm import relax

    calls = [0]

    def visit(expr):
        if (isinstance(expr, relax.Call) and getattr(expr.op, "name", None) == "relax.call_tir"
                and expr.args[0].name_hint.startswith(prefix)):
            calls[0] += 1

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return calls[0]


def _fp32_kernels(mod, target: dict, layers: dict, choice: str, log) -> tuple:
    """The float32 conv2d layers on register-tiled kernels (cpu_conv.py) where this build's CPU has a
    vector unit they are sized for, matmuls with constant weights as 1x1 convolutions (cpu_dense.py):
    (mod, {"kind", "layers", "matmuls", "reason"}) for compile.json."""
    from appliance.deploy.compiler.kernels import cpu_simd as cpu_conv
    from appliance.deploy.compiler.passes.dense_as_conv import matmuls_as_convs

    if not layers.get("fp32"):
        return mod, {"kind": "none", "layers": 0, "matmuls": 0, "pixels": 0, "handoffs": 0, "reason": "no float32 layers"}
    if choice == "generic":
        return mod, {"kind": "generic", "layers": 0, "matmuls": 0, "pixels": 0, "handoffs": 0, "reason": "--fp32-kernels generic"}
    tile = cpu_conv.tile_for(target)
    if tile is None:
        return mod, {"kind": "generic", "layers": 0, "matmuls": 0, "pixels": 0, "handoffs": 0,
                     "reason": f"no float32 kernels here for {target.get('mtriple')} {target.get('mcpu', '')}".strip()}
    from appliance.deploy.compiler.passes.layout_handover import blocked_handoff

    mod, matmuls = matmuls_as_convs(mod, {"float32"})
    mod, count = cpu_conv.use_fp32_kernels(mod, tile)
    mod, handoffs = blocked_handoff(mod, tile)
    pixels = _pixel_kernels(mod, "fp32_conv2d_pixels_")
    log(f"compile: {count} of {layers['fp32']} float32 layers on {tile[0]} register-tiled kernels ({matmuls} of "
        f"them matmuls, as 1x1 convolutions; {pixels} with 16 pixels a vector; {handoffs} writing the depthwise "
        "layout after them; the rest: grouped)")
    return mod, {"kind": tile[0], "layers": count, "matmuls": matmuls, "pixels": pixels, "handoffs": handoffs,
                 "reason": None}


def _tuned(mod, model_path, target_name, target, out_dir, trials, db_dir, log, rpc=None, rpc_key=""):
    """Apply the tuning database (made now by tuning, or reused as it is): (mod, target, summary)."""
    from appliance.deploy.compiler.tuning import search as tune
    from appliance.core.manifest import sha256_file

    db_dir = Path(db_dir) if db_dir else out_dir / "tuning"
    model_sha = sha256_file(model_path)
    reused = (db_dir / tune.HEADER).exists() or not trials
    if reused:
        target = tune.tuning_target(target)
        header = tune.check_database(db_dir, model_sha, target_name, target)
    elif rpc:
        from appliance.deploy.compiler.tuning.rpc import connect, remote_cores

        target = {**target, "num-cores": remote_cores(connect(rpc, rpc_key))}  # the device's, not this host's
        header = tune.tune(mod, target_name, target, db_dir, trials, model_sha, log=log, rpc=rpc, rpc_key=rpc_key,
                           cross_compiler=CROSS_COMPILER if target_name.startswith("aarch64") else None)
    elif target_name != "x86_64":
        raise DataError(f"{model_path}: --tune measures candidates on this CPU, so it tunes the x86_64 target only; "
                        f"tune {target_name} on the device with --rpc HOST:PORT, or pass its database with --tuning-db")
    else:
        target = tune.tuning_target(target)
        header = tune.tune(mod, target_name, target, db_dir, trials, model_sha, log=log)
    mod = tune.apply_database(mod, target, db_dir)
    return mod, target, {"database": str(db_dir), "reused": reused, "trials_per_task": header["trials_per_task"],
                         "tasks": header["tasks"], "records": header["records"],
                         "tuned_in_seconds": header["tuning_seconds"], "tvm_ffi": header["tvm_ffi"],
                         "measured_on": header.get("measured_on", "this host")}


def check_against_ort(library, model_path, shape, sample_files, meta, tolerance, input_name="input",
                      output_step=None) -> dict:
    """Run the host library through the Relax VM and onnxruntime on the same tensors.

    For a QDQ model (output_step: its output quantization step) QDQ_UNITS steps are allowed too:
    a float rounding difference in one layer moves a value by one step, and later layers carry it."""
    import numpy as np

    import tvm
    from tvm import relax

    from appliance.deploy.onnx_model import ort_session, run_ort
    from appliance.deploy.samples import check_input_shape, load_samples
    from appliance.deploy.compiler.runtime import use_physical_cores

    use_physical_cores()

    if sample_files:
        samples = load_samples(sample_files, meta.get("preprocessing", {}), limit=32)
        check_input_shape(samples, shape, input_name, model_path)
        x = samples.x
        if len(x) % shape[0]:  # a fixed batch: whole batches only, the samples repeated to fill the last
            x = np.resize(x, (-(-len(x) // shape[0]) * shape[0], *x.shape[1:]))
    else:
        x = np.random.default_rng(0).standard_normal((-(-8 // shape[0]) * shape[0], *shape[1:])).astype(np.float32)
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(library)), tvm.cpu())
    got = np.concatenate([vm["main"](tvm.runtime.tensor(x[i:i + shape[0]])).numpy() for i in range(0, len(x), shape[0])])
    expected = run_ort(ort_session(model_path, optimize=False), x)
    diff = float(np.abs(got.astype(np.float64) - expected).max())
    allowed = tolerance * max(1.0, float(np.abs(expected).max()))
    if output_step:
        allowed = max(allowed, QDQ_UNITS * output_step * (1 + 1e-5))
    return {"samples": int(len(x)), "max_abs_diff": diff, "allowed": allowed,
            "max_quantized_units": diff / output_step if output_step else None,
            "top1_agreement": float((got.argmax(1) == expected.argmax(1)).mean()), "passed": diff <= allowed}


def host_latency_ms(library, shape, budget_s: float = 3.0) -> float:
    """Median ms of one call of the host library on this CPU (1 warm-up call, at most 10 timed
    calls or budget_s), on its physical cores (tvm_threads.py); a figure for comparing builds on
    the same machine, not an edge latency."""
    import statistics
    import time

    import numpy as np

    import tvm
    from tvm import relax

    from appliance.deploy.compiler.runtime import use_physical_cores

    use_physical_cores()
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(library)), tvm.cpu())
    x = tvm.runtime.tensor(np.zeros(shape, np.float32))
    vm["main"](x)
    times, start = [], time.perf_counter()
    while len(times) < 10 and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t = time.perf_counter()
        vm["main"](x)
        times.append((time.perf_counter() - t) * 1000)
    return round(statistics.median(times), 3)


def _dim(d, meta, path, inp):
    if isinstance(d, int) and d > 0:
        return d
    size = meta.get("preprocessing", {}).get("image_size")
    if size is None:
        raise DataError(f"{path}: input {inp.name!r} has symbolic size {inp.shape} and no appliance "
                        "preprocessing metadata to fix it")
    return int(size)


def _check_elf(path: Path, machine: int) -> None:
    head = path.read_bytes()[:20]
    if head[:4] != b"\x7fELF" or int.from_bytes(head[18:20], "little") != machine:
        raise EnvironmentProblem(f"{path}: the compiler produced no ELF for machine {machine}")
