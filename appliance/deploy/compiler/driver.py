"""`compile_model`: ONNX -> a TVM 0.27 Relax library for the edge CPU (or the host, checked).

frontend (ONNX -> Relax at a fixed shape) -> pipeline (the passes, pipeline.py) -> build
(`tvm.compile`, exported with aarch64-linux-gnu-g++ for ARM) -> check (the x86_64 host build
against onnxruntime, check.py) -> compile.json and the manifest. A numerical problem in TVM shows
up here, not on a device.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from appliance.assets.tuning_db import FILES
from appliance.core.errors import DataError, EnvironmentProblem
from appliance.core.manifest import atomic_write_text, write_manifest
from appliance.deploy.compiled import COMPILE_JSON, COMPILED_LIBRARY, REFERENCE_MODEL
from appliance.deploy.compiler.check import check_against_ort, host_latency_ms
from appliance.deploy.compiler.frontend import import_relax
from appliance.deploy.compiler.passes import Build
from appliance.deploy.compiler.options import FP32_KERNELS, INT8_COMPUTE, INT8_KERNELS, RUNTIMES
from appliance.deploy.compiler.passes.int8_arith import output_scale
from appliance.deploy.compiler.pipeline import run_pipeline
from appliance.deploy.compiler.runtime import use_physical_cores
from appliance.deploy.compiler.runtime_choice import (choose_runtime, device_comparison, host_comparison,
                                                      onnxruntime_device_estimate)
from appliance.deploy.edge.cycles import estimate_build, not_estimated
from appliance.deploy.compiler.targets import (CROSS_COMPILER, ELF_MACHINE, check_cross_compiler, describe_cpu,
                                               target_for)
from appliance.deploy.onnx_model import default_tolerance, image_input, load_onnx, metadata, precision


def compile_model(model_path, target_name: str, out_dir, *, sample_files=None, tolerance=None,
                  batch: int = 1, tune_trials: int | None = None, tuning_db=None, int8_compute: str = "int8",
                  installed_tuning: bool = True, rpc: str | None = None, rpc_key: str = "", int8_kernels: str = "auto",
                  fp32_kernels: str = "auto", device_estimate: bool = False, runtime: str = "auto", log=print,
                  dump_ir=None) -> dict:
    """installed_tuning: apply the installed tuning databases made for this target and CPU
    (appliance.assets.tuning_db) when neither tune_trials nor tuning_db is given. rpc: HOST:PORT of a TVM
    RPC server on the target device that times the tuning candidates (tuning/rpc.py). dump_ir: a
    folder to write the module into after each pass. device_estimate: for an aarch64 target, estimate the
    device's cycles per inference (edge/cycles.py: a minute or more under qemu for a 224 px ResNet), and
    onnxruntime's on the same model (cached per model). runtime: what the edge package runs, "tvm",
    "onnxruntime" or "auto" (the faster of the two as compared here: runtime_choice.py).
    Returns compile.json's content."""
    import tvm

    use_physical_cores()  # before tuning, the check and the latency run TVM here: all the cores, not half

    cross = target_name.startswith("aarch64")
    if cross:
        check_cross_compiler()
    model_path = Path(model_path)
    model = load_onnx(model_path)
    inp = image_input(model, model_path)
    meta = metadata(model)
    options = {"int8_compute": int8_compute, "int8_kernels": int8_kernels, "fp32_kernels": fp32_kernels,
               "tune_trials": tune_trials, "tuning_db": tuning_db, "installed_tuning": installed_tuning, "rpc": rpc,
               "rpc_key": rpc_key, "runtime": runtime}
    _check_options(model_path, options)
    tolerance = default_tolerance(precision(model)) if tolerance is None else tolerance
    shape = [batch, *[fixed_dim(d, meta, model_path, inp) for d in inp.shape[1:]]]

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    mod = import_relax(model, model_path, shape)
    target = target_for(target_name)
    build = Build(model_path, target_name, target, describe_cpu(target), out_dir, options, log, model)
    mod, passes = run_pipeline(mod, build, dump_ir)
    library = _build(tvm.compile(mod, target=tvm.target.Target(build.tvm_target)), out_dir, cross)
    seconds = time.perf_counter() - start
    shutil.copyfile(model_path, out_dir / ".model.onnx.tmp")
    (out_dir / ".model.onnx.tmp").replace(out_dir / REFERENCE_MODEL)  # the reference edge verify compares with

    info = _info(build, inp, shape, library, seconds, meta, passes)
    if not cross:
        info["check"] = check_against_ort(library, model_path, shape, sample_files, meta, tolerance, inp.name,
                                          output_step=output_scale(model))
        info["host_latency_ms"] = host_latency_ms(library, shape)
        comparison = host_comparison(library, model_path, shape)
    elif device_estimate:
        log(f"estimating {target_name} device cycles under qemu (edge/cycles.py), ours and onnxruntime's")
        info["device_estimate"] = estimate_build(library, shape)
        comparison = device_comparison(info["device_estimate"], onnxruntime_device_estimate(model_path, shape))
    else:
        info["device_estimate"] = not_estimated("not requested (appliance compile without --no-device-estimate "
                                                "estimates it)")
        comparison = {"compared": False, "reason": "no device estimate (--no-device-estimate)"}
    chosen, why = choose_runtime(runtime, comparison)
    info.update({"runtime": chosen, "runtime_requested": runtime, "runtime_reason": why,
                 "onnxruntime_comparison": comparison})
    log(f"runtime: {chosen} ({why})")
    atomic_write_text(out_dir / COMPILE_JSON, json.dumps(info, indent=2) + "\n")
    _write_manifest(build, sample_files, shape, tolerance)
    if not cross and not info["check"]["passed"]:
        c = info["check"]
        pixels = (f", class maps agree on {c['pixel_agreement'] * 100:.2f}% of the pixels (need "
                  f"{c['min_pixel_agreement'] * 100:.1f}%)" if "pixel_agreement" in c else "")
        raise DataError(f"{library}: TVM output differs from onnxruntime by {c['max_abs_diff']:.3g} "
                        f"(allowed {c['allowed']:.3g}){pixels}; see {out_dir / COMPILE_JSON}")
    return info


def _check_options(model_path: Path, options: dict) -> None:
    for flag, key, choices in (("--int8-compute", "int8_compute", INT8_COMPUTE),
                               ("--int8-kernels", "int8_kernels", INT8_KERNELS),
                               ("--fp32-kernels", "fp32_kernels", FP32_KERNELS), ("--runtime", "runtime", RUNTIMES)):
        if options[key] not in choices:
            raise DataError(f"{model_path}: {flag} must be one of {', '.join(choices)}, not {options[key]!r}")
    if options["rpc"] and not options["tune_trials"]:
        raise DataError(f"--rpc {options['rpc']}: the RPC server times tuning candidates; add --tune N")


def _build(executable, out_dir: Path, cross: bool) -> Path:
    """model.so in out_dir: the executable exported (cross-compiled for aarch64), checked to be an ELF for it."""
    import tvm.support.cc

    library, tmp = out_dir / COMPILED_LIBRARY, out_dir / ".model.so.tmp.so"
    if cross:
        executable.export_library(str(tmp), fcompile=tvm.support.cc.cross_compiler(CROSS_COMPILER))
    else:
        executable.export_library(str(tmp))
    _check_elf(tmp, ELF_MACHINE["aarch64" if cross else "x86_64"])
    tmp.replace(library)
    return library


def _info(build: Build, inp, shape, library: Path, seconds: float, meta: dict, passes: list) -> dict:
    """compile.json's content, the check's figures not yet in."""
    results = build.results
    dispatch, tuning = results["kernel_dispatch"], results["tuning"]
    epilogues = {"kernels": results["epilogue_fusion"]["kernels"], "fused": results["epilogue_fusion"]["fused"],
                 "glue_scheduled": results["glue_scheduling"]["scheduled"]}
    info = {"made_by": "appliance compile", "source_model": str(build.model_path.resolve()), "target": build.target_name,
            "tvm_target": build.tvm_target, "input": {"name": inp.name, "shape": shape, "dtype": "float32"},
            "precision": precision(build.onnx_model), "int8_compute": build.options["int8_compute"],
            "layers": build.layers, "int8_kernels": dispatch["int8"], "fp32_kernels": dispatch["float32"],
            "kernel_epilogues": epilogues, "tuned_tasks": tuning["tuned_tasks"], "installed_tuning": tuning["installed"],
            "library": str(library), "library_bytes": library.stat().st_size,
            "compile_seconds": round(seconds, 2), "host_latency_ms": None, **meta}
    if tuning["tuning"]:
        info["tuning"] = tuning["tuning"]
    info["passes"] = passes
    return info


def _write_manifest(build: Build, sample_files, shape, tolerance) -> None:
    options, tuning = build.options, build.results["tuning"]
    installed = tuning["installed"]
    inputs = [build.model_path, *(Path(f) for f in sample_files or [])]
    applied = [tuning["tuning"]["database"]] if tuning["tuning"] else [e["database"] for e in installed if e["applied"]]
    inputs += [Path(db) / name for db in applied for name in FILES]  # the schedules in model.so came from these
    write_manifest(build.out_dir, "compile", inputs, {
        "target": build.target_name, "tvm_target": build.tvm_target, "int8_compute": options["int8_compute"],
        "int8_kernels": options["int8_kernels"], "runtime": options["runtime"],
        **({"fp32_kernels": options["fp32_kernels"]} if options["fp32_kernels"] != "auto" else {}),
        "input_shape": shape, "tolerance": tolerance,
        **({"tuning": tuning["tuning"]} if tuning["tuning"] else {}),
        **({"installed_tuning": installed} if installed else {})})


def fixed_dim(d, meta, path, inp) -> int:
    """An input dimension of the ONNX model, its symbolic sizes fixed by the card's image_size (one line where none)."""
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
