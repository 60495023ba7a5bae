"""Legalize and fuse: TVM's own lowering of the Relax ops to TIR and its operator fusion.

Relax's "zero" pipeline (LegalizeOps, AnnotateTIROpPattern, FoldConstant, FuseOps, FuseTIR): the
ops our kernels do not compute become TVM's generic PrimFuncs, and the elementwise ops after a
kernel of ours join its function (kernels/common.py: `fusable`), where epilogue fusion then
computes them in its write-back.

It runs where kernel dispatch used a kernel of ours. A build without any would get the same
legalization from `tvm.compile`'s default pipeline; running it here too is not free of effects
there: glue scheduling would then schedule that build's glue functions, and those functions are
no longer the tasks its installed tuning databases recorded, so that build's output would no
longer be the one before (see docs/dev/compiler.md).
"""

from __future__ import annotations


def run(mod, build):
    """The pass: (mod, {"ran": whether it ran})."""
    if not build.kernels_used():
        return mod, {"ran": False}
    return legalize_and_fuse(mod), {"ran": True}


def legalize_and_fuse(mod):
    """mod through relax's "zero" pipeline."""
    from tvm import relax

    return relax.get_pipeline("zero")(mod)
