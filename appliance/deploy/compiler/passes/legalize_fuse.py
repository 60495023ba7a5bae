"""Legalize and fuse: TVM's own lowering of the Relax ops to TIR and its operator fusion.

Relax's "zero" pipeline (LegalizeOps, AnnotateTIROpPattern, FoldConstant, FuseOps, FuseTIR): the
ops our kernels do not compute become TVM's generic PrimFuncs, and the elementwise ops after a
kernel of ours join its function (kernels/common.py: `fusable`), where epilogue fusion then
computes them in its write-back.

It runs on every build, with our kernels or without (before the re-lay it ran only where a layer
got one of our kernels, and `tvm.compile` legalized the others later): a build on TVM's generic
kernels then gets its glue scheduled too. Its outputs stayed bit-identical (measured on the
re-lay: ResNet-18 S8S8 with --int8-kernels generic, MobileNetV2 FP32 with --fp32-kernels generic
and S8S8 with --int8-compute simulated, x86_64, 4 inputs each), as they must: legalizing earlier
and inlining injective loops change no arithmetic.

One legalization is ours: a `quantize` by a constant float32 scalar scale (every activation
requantize of a QDQ model) multiplies by the scale's reciprocal instead of dividing by it. The
division was the dearest instruction of the int8 builds' write-backs: one `fdiv` per 4 outputs
on NEON, one `vdivps` per 16 on x86, and LLVM may not turn it into a multiply by itself. MobileNetV2
S8S8 at 224 px, `aarch64-dotprod`: 91.6 -> 48.2 M estimated Cortex-A76 cycles (benchmarks/arm_cycles.py);
x86_64 host latency 9.0 -> 5.7 ms (median of 30, loaded 2-core box). `x * (1/s)` differs
from `x / s` by at most an ulp or so before rounding, so an int8 output moves by one step only where
`x / s` lies within that of a half (onnxruntime's QLinearConv requantizes with one float multiplier
too; measured: MobileNetV2's x86 build against onnxruntime, top-1 agreement and the largest error in
quantization steps unchanged). Both the x86 and the aarch64 builds use it, so they stay
bit-identical to each other. The rest is the "zero" pipeline as TVM 0.27 has it, less its
MetaSchedule database step: no database is open here (tuning applies its own, passes/tune.py).
"""

from __future__ import annotations


def run(mod, build):
    """The pass: (mod, {"prim_funcs": how many TIR functions the module has after it})."""
    from tvm import tirx

    mod = legalize_and_fuse(mod, saturating=build.cpu.triple.startswith("aarch64"))
    return mod, {"prim_funcs": sum(isinstance(func, tirx.PrimFunc) for func in mod.functions.values())}


def legalize_and_fuse(mod, saturating: bool = False):
    """mod through relax's "zero" pipeline, with quantize by a constant scale legalized as a multiply
    (saturating: its rounding and clipping as saturating conversions, for aarch64)."""
    import functools

    import tvm
    from tvm import relax

    seq = tvm.transform.Sequential([
        relax.transform.LegalizeOps({"relax.quantize": functools.partial(quantize_by_reciprocal,
                                                                         saturating=saturating)}),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
    ])
    return seq(mod)


def quantize_by_reciprocal(bb, call, saturating: bool = False):
    """relax.quantize as clip(round(x * (1/scale)) + zp) where scale is a float32 scalar constant
    (TVM's own legalization, a division, for any other scale). saturating (aarch64): the same
    values by saturating conversions, see `saturating_quantize`."""
    import numpy as np
    from tvm import te, tirx
    from tvm.relax.transform.legalize_ops import qdq
    from tvm.relax.transform.legalize_ops.common import _try_convert_to_scalar_const

    scale = _try_convert_to_scalar_const(call.args[1])
    data_dtype = getattr(call.args[0].ty, "dtype", None)
    if not isinstance(scale, tirx.FloatImm) or str(scale.ty) != "float32" or data_dtype != "float32":
        return qdq._quantize(bb, call)
    with np.errstate(divide="ignore", over="ignore"):
        reciprocal = np.float32(1) / np.float32(scale.value)
    if not np.isfinite(reciprocal) or reciprocal == 0:
        return qdq._quantize(bb, call)
    out_dtype = str(call.attrs.out_dtype)
    zp = _try_convert_to_scalar_const(call.args[2])
    # the model input's quantize runs in a glue function of its own (into the first kernel's layout),
    # scalar: there the float form is fewer instructions (saturating to 16 bits scalar is compare-and-select)
    saturating = saturating and bb.lookup_binding(call.args[0]) is not None
    axis = int(call.attrs.axis)

    def compute(data, zp):
        def element(*indices):
            if isinstance(zp, te.Tensor):
                zp_value = zp[(0,) * len(zp.shape)] if qdq._is_singleton_qparam(zp) else zp[indices[axis]]
            else:
                zp_value = zp
            scaled = data[indices] if reciprocal == 1 else data[indices] * tirx.const(float(reciprocal), "float32")
            if saturating and out_dtype in SATURATING:
                return saturating_quantize(scaled, zp_value, out_dtype)
            return qdq.clip_cast((te.round(scaled) if "int" in out_dtype else scaled) + zp_value, out_dtype)

        return te.compute(data.shape, element, name="quantized")

    return bb.call_te(compute, call.args[0], zp, primfunc_name_hint="quantize")


SATURATING = {"int8": (-128, 127), "uint8": (0, 255)}


def saturating_quantize(scaled, zp, out_dtype: str):
    """clip(round(scaled) + zp, lo, hi) of int8/uint8 as conversions that saturate: round to
    nearest even and convert to int32 in one step (`llvm.fptosi.sat` of `llvm.roundeven`: frintn
    and fcvtzs), saturate to int16 (sqxtn), add the zero point saturating (sqadd) and saturate to
    8 bits (sqxtn/sqxtun). The float form's clip (fmaxnm, fminnm), its float zero-point add and the
    narrowing (uzp1) cost more: per 4 outputs about 4 NEON instructions instead of 6.75 (LLVM 22,
    measured on the generated code). The values are the same for every finite input: roundeven is
    the float form's round (nearbyint in the default rounding mode), and every saturation bound lies
    outside [lo, hi], so a value saturated early is clipped to the same bound; a NaN input gives the
    zero point here (the float form: a bound). x86 keeps the float form: LLVM scalarises
    `fptosi.sat` there."""
    from tvm import tirx

    rounded = tirx.call_llvm_pure_intrin("float32", "llvm.roundeven", scaled)
    whole = tirx.call_llvm_pure_intrin("int32", "llvm.fptosi.sat", rounded)
    short = tirx.Cast("int16", tirx.max(tirx.min(whole, tirx.const(32767, "int32")), tirx.const(-32768, "int32")))
    if not (isinstance(zp, tirx.IntImm) and int(zp) == 0):
        zp16 = tirx.Cast("int16", zp)
        short = tirx.call_llvm_pure_intrin("int16", "llvm.sadd.sat", short, zp16)
    lo, hi = SATURATING[out_dtype]
    return tirx.Cast(out_dtype, tirx.max(tirx.min(short, tirx.const(hi, "int16")), tirx.const(lo, "int16")))
