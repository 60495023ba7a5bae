"""Kernel dispatch: each conv2d (and constant-weight matmul) onto the kernel of ours this CPU has for it.

The kernels, their groups and what CPU each needs are in kernels/registry.py; this pass runs the
groups in order (int8 depthwise, int8, float32), trying the lowerings of a group's kernels in
registry order on each call, so a call gets the first kernel that takes it. Matmuls become 1x1
convolutions (dense_as_conv.py) only where this CPU has a kernel for them. Layers no kernel takes
stay TVM's generic ones. The counts are compile.json's "int8_kernels" and "fp32_kernels" (the layout
handover pass adds its handoffs and the pixel kernels left after it).
"""

from __future__ import annotations

from appliance.deploy.compiler.kernels.registry import kernel_named, kernels_for
from appliance.deploy.compiler.passes.dense_as_conv import matmuls_as_convs
from appliance.deploy.compiler.passes.rewrite import count_calls, rewrite_calls


def run(mod, build):
    """The pass: (mod, {"int8": {...}, "float32": {...}}) with compile.json's kernel counts."""
    mod, int8 = _int8(mod, build)
    mod, fp32 = _fp32(mod, build)
    return mod, {"int8": int8, "float32": fp32}


def lower_group(mod, cpu, group: str):
    """mod with the calls the kernels of `group` (kernels/registry.py) that `cpu` has take computed
    by them; returns (mod, how many)."""
    return lower_with(mod, kernels_for(cpu, group), cpu)


def lower_with(mod, kernels, cpu):
    """mod with each call the first of `kernels` takes computed by it; returns (mod, how many)."""
    def replace(builder, call, index):
        for kernel in kernels:
            out = kernel.lower(builder, call, index, cpu, kernel.name)
            if out is not None:
                return out
        return None

    return rewrite_calls(mod, replace)


def _int8(mod, build) -> tuple:
    """The int8 conv2d layers: depthwise on the vector kernels, groups 1 (and the int8 matmuls) on
    the dot-product ones where the CPU has them (plain NEON on ARMv8.0); (mod, {"kind", "layers",
    "depthwise", "matmuls", "pixels", "handoffs", "reason"}, and "by_kind": layers per kind of kernel
    where the CPU offers more than one, e.g. {"arm-i8mm": 14, "arm-dotprod": 6})."""
    counts = {"kind": "generic", "layers": 0, "depthwise": 0, "matmuls": 0, "pixels": 0, "handoffs": 0, "reason": None}
    if not build.layers.get("int8"):
        return mod, {**counts, "kind": "none", "reason": "no int8 layers"}
    if build.options["int8_kernels"] == "generic":
        return mod, {**counts, "reason": "--int8-kernels generic"}
    cpu = build.cpu
    depthwise_kernels = kernels_for(cpu, "int8-depthwise")
    if depthwise_kernels:
        mod, counts["depthwise"] = lower_with(mod, depthwise_kernels, cpu)
    kernels = kernels_for(cpu, "int8")
    if not kernels:
        reason = f"no dot-product kernels here for {cpu.name()}"
        build.log(f"compile: {counts['depthwise']} depthwise int8 layers on {cpu.vector} vector kernels; {reason}"
                  if cpu.vector else f"compile: int8 layers on generic kernels; {reason}")
        return mod, {**counts, "reason": reason}
    mod, counts["matmuls"] = matmuls_as_convs(mod, {"int8"})
    mod, counts["layers"] = lower_with(mod, kernels, cpu)
    kinds = list(dict.fromkeys(k.kind for k in kernels))
    if len(kinds) > 1:  # which layers each took: a kernel that applies to some layers only leaves the rest to the next
        counts["by_kind"] = {kind: count_calls(mod, lambda name, kind=kind: getattr(kernel_named(name), "kind", None) == kind)
                             for kind in kinds}
    return mod, {**counts, "kind": kernels[0].kind}


def _fp32(mod, build) -> tuple:
    """The float32 conv2d layers (and constant-weight matmuls) on the register-tiled kernels where
    the CPU has a vector unit they are sized for; (mod, {"kind", "layers", "matmuls", "pixels",
    "handoffs", "reason"})."""
    counts = {"kind": "generic", "layers": 0, "matmuls": 0, "pixels": 0, "handoffs": 0, "reason": None}
    if not build.layers.get("fp32"):
        return mod, {**counts, "kind": "none", "reason": "no float32 layers"}
    if build.options["fp32_kernels"] == "generic":
        return mod, {**counts, "reason": "--fp32-kernels generic"}
    kernels = kernels_for(build.cpu, "float32")
    if not kernels:
        return mod, {**counts, "reason": f"no float32 kernels here for {build.cpu.name()}"}
    mod, counts["matmuls"] = matmuls_as_convs(mod, {"float32"})
    mod, counts["layers"] = lower_with(mod, kernels, build.cpu)
    return mod, {**counts, "kind": build.cpu.vector}
