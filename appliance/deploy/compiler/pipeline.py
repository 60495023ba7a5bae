"""The compile pipeline: the passes from the imported Relax module to the one `tvm.compile` builds, in order.

    int8_arithmetic    quantized layers on int8 x int8 -> int32 arithmetic   passes/int8_arith.py
    kernel_dispatch    conv2d/matmul layers onto our kernels for this CPU   passes/kernel_dispatch.py
    layout_handover    a conv feeding a depthwise kernel writes its layout    passes/layout_handover.py
    legalize_and_fuse  TVM's LegalizeOps and FuseOps ("zero" pipeline)       passes/legalize_fuse.py
    epilogue_fusion    elementwise ops after a kernel in its write-back      passes/epilogue_fusion.py
    glue_scheduling    padding/layout glue inlined and run on all cores      passes/glue_schedule.py
    tuning             tuning database schedules for TVM's generic kernels   passes/tune.py

Each pass is `run(mod, build) -> (mod, counts)` (compiler/passes/__init__.py); `run_pipeline`
records every pass's counts and seconds for compile.json and, given a folder, writes the module
after each pass there as TVMScript (`appliance compile --dump-ir DIR`).
"""

from __future__ import annotations

import time
from pathlib import Path

from appliance.core.manifest import atomic_write_text
from appliance.deploy.compiler.passes import (Build, epilogue_fusion, glue_schedule, int8_arith, kernel_dispatch,
                                              layout_handover, legalize_fuse, tune)

PASSES = (
    ("int8_arithmetic", int8_arith.run),
    ("kernel_dispatch", kernel_dispatch.run),
    ("layout_handover", layout_handover.run),
    ("legalize_and_fuse", legalize_fuse.run),
    ("epilogue_fusion", epilogue_fusion.run),
    ("glue_scheduling", glue_schedule.run),
    ("tuning", tune.run),
)


def run_pipeline(mod, build: Build, dump_ir=None):
    """mod after every pass of PASSES; build.results holds each pass's counts, by name. Returns
    (mod, [{"pass", "seconds", "counts"}] in order) for compile.json."""
    record = []
    if dump_ir is not None:
        dump_ir = Path(dump_ir)
        dump_ir.mkdir(parents=True, exist_ok=True)
        _dump(dump_ir / "00-imported.py", mod)
    for number, (name, run) in enumerate(PASSES, 1):
        start = time.perf_counter()
        mod, counts = run(mod, build)
        build.results[name] = counts
        record.append({"pass": name, "seconds": round(time.perf_counter() - start, 3), "counts": counts})
        if dump_ir is not None:
            _dump(dump_ir / f"{number:02d}-{name}.py", mod)
    return mod, record


def _dump(path: Path, mod) -> None:
    atomic_write_text(path, mod.script(show_meta=False) + "\n")
