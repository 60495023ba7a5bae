"""`appliance compile` as a stage: every compile target (TVM in appliance.deploy.compiler, the GPU
routes in appliance.deploy.gpu, OpenVINO IR in appliance.deploy.openvino_route) builds a model that
passed its quantize gate into one directory with compile.json, and returns the same typed result,
CompileResult (appliance/deploy/compiled.py).

A new target is one entry in BUILDERS (target name -> builder; TVM's builder serves every other
name, compiler/targets.py lists them): a function (model, target, out_dir, sample_files=..., **options)
that writes the directory (COMPILE_JSON, the manifest) and raises DataError when its build fails its
check.
"""

from __future__ import annotations

from pathlib import Path

from appliance.deploy.compiled import COMPILE_JSON, COMPILED_LIBRARY, CompileResult  # noqa: F401 (the stage's names)
from appliance.deploy.compiler.driver import compile_model
from appliance.deploy.gpu.routes import compile_gpu
from appliance.deploy.openvino_route import COMPILE_TARGET as OPENVINO
from appliance.deploy.openvino_route.build import compile_openvino
from appliance.deploy.options import GPU_TARGETS
from appliance.deploy.tolerance import refuse_failed_gate


def build_openvino(model, target: str, out_dir, **options):
    """The OpenVINO IR route as a builder (it has one target, so it takes none)."""
    return compile_openvino(model, out_dir, **options)


BUILDERS = {**{target: compile_gpu for target in GPU_TARGETS}, OPENVINO: build_openvino}  # cuda-ort, tensorrt, openvino


def builder_for(target: str):
    """The function that builds for target: its BUILDERS entry, else TVM's compile_model."""
    return BUILDERS.get(target, compile_model)


def compile_stage(model: Path, target: str, out_dir: Path, *, sample_files, allow_failed_gate: bool = False,
                  **options) -> CompileResult:
    """Build model for target into out_dir (options: those of the target's builder, e.g.
    compiler.driver.compile_model); refuses a quantized model that failed its accuracy gate unless
    allow_failed_gate."""
    if not allow_failed_gate:
        refuse_failed_gate(model)
    builder_for(target)(model, target, out_dir, sample_files=list(sample_files) if sample_files else None, **options)
    return CompileResult.load(out_dir)
