"""The compiler's passes, one a file, each `run(mod, build) -> (mod, counts)`.

`build` (a `Build`) says what is being built: the target, the CPU description, the user's
choices, the layers found, and the counts of the passes run before (`results`, by pass name);
counts is a small dict of what the pass did, which compile.json records. compiler/pipeline.py
lists the passes in the order they run; a pass never imports the pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from appliance.deploy.compiler.targets import CPU


@dataclass
class Build:
    """What one `appliance compile` builds, as the passes read it. options: int8_compute,
    int8_kernels, fp32_kernels ("auto"/"generic"), tune_trials, tuning_db, installed_tuning, rpc,
    rpc_key, as compile_model was given them. tvm_target: the TVM target dict (the tuning pass may
    add the core count); layers: {"int8", "simulated", "fp32", "simulated_layers"}."""

    model_path: Path
    target_name: str
    tvm_target: dict
    cpu: CPU
    out_dir: Path
    options: dict
    log: Callable = print
    onnx_model: object = None
    layers: dict = field(default_factory=dict)
    results: dict = field(default_factory=dict)
