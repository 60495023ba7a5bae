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
"""

from __future__ import annotations


def run(mod, build):
    """The pass: (mod, {"prim_funcs": how many TIR functions the module has after it})."""
    from tvm import tirx

    mod = legalize_and_fuse(mod)
    return mod, {"prim_funcs": sum(isinstance(func, tirx.PrimFunc) for func in mod.functions.values())}


def legalize_and_fuse(mod):
    """mod through relax's "zero" pipeline."""
    from tvm import relax

    return relax.get_pipeline("zero")(mod)
