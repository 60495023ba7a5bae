"""What every hand-scheduled kernel of ours shares: how FuseOps sees it, and its int64 buffer shapes.

A module of its own so that the kernel modules (cpu_conv, cpu_pixels, x86_int8) can use it without
importing each other in a circle.
"""

from __future__ import annotations

OUT_EWISE_FUSABLE, OPAQUE = 4, 8  # TVM's OpPatternKind values kOutEWiseFusable, kOpaque


def fusable(func):
    """A kernel of ours as TVM's FuseOps should see it: scheduled (tuning and TVM's default schedules
    leave it alone), and out-elementwise fusable (the elementwise ops after it join its function,
    where `fuse_epilogues` computes them in the write-back)."""
    return func.with_attr("tirx.is_scheduled", True).with_attr("op_pattern", OUT_EWISE_FUSABLE)


def shape64(*dims):
    """A buffer shape in int64, as LegalizeOps writes the kernels around ours: FuseTIR maps one
    relax tensor to one buffer and refuses a int32 shape where the other side has int64."""
    from tvm import tirx

    return tuple(tirx.IntImm("int64", d) for d in dims)
