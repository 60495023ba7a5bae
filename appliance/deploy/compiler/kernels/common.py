"""The conventions every hand-scheduled kernel of ours keeps, so that the passes can work with any of them.

- A kernel is a scheduled TIR PrimFunc (`fusable`): tuning and TVM's default schedules leave it
  alone, and FuseOps joins the elementwise ops after it to its function, where the epilogue fusion
  pass computes them in its write-back.
- Its buffers have int64 shapes (`shape64`), as LegalizeOps writes the functions around it.
- Its tile is written out by a block named `WRITE_BACK`; its compute blocks' names start with
  `KERNEL_BLOCK`; a kernel whose write-back is vectorised already (pixels as the vector lanes, or a
  blocked output) names its compute blocks with one of `VECTORISED_BLOCKS`.
- A channel-vector kernel records its (stride_h, stride_w, dilation_h, dilation_w) under the
  function attribute `GEOMETRY`, so the layout handover can remake it with a blocked output.
- It is added to the module under its registry name (kernels/registry.py) followed by the layer's
  index; a lowering (`lower(builder, call, index, cpu, name)`) returns the Relax expression that
  calls it, or None where the call is not one it computes.
"""

from __future__ import annotations

OUT_EWISE_FUSABLE, OPAQUE = 4, 8  # TVM's OpPatternKind values kOutEWiseFusable, kOpaque
LANES = 16  # channels (or pixels) per vector in every kernel's layout: one zmm, two ymm, four q registers
CONV = "relax.nn.conv2d"
KERNEL_BLOCK = "conv"  # every kernel's compute blocks: conv, conv_init, conv_update_o, conv_pixels_...
WRITE_BACK = "Y_global"  # the block that cache_write of the kernel's output Y makes: the tile written out
PIXEL_BLOCKS = "conv_pixels"  # compute blocks of the kernels with 16 pixels a vector (x86_avx512, x86_vnni)
BLOCKED_BLOCKS = "conv_blocked"  # compute blocks of the kernels with a blocked [N, C/16, H, W, 16] output
VECTORISED_BLOCKS = (PIXEL_BLOCKS, BLOCKED_BLOCKS)
GEOMETRY = "appliance.stride_dilation"  # a channel-vector kernel's (sh, sw, dh, dw), for the layout handover


def fusable(func):
    """A kernel of ours as TVM's FuseOps should see it: scheduled (tuning and TVM's default schedules
    leave it alone), and out-elementwise fusable (the elementwise ops after it join its function,
    where the epilogue fusion pass computes them in the write-back)."""
    return func.with_attr("tirx.is_scheduled", True).with_attr("op_pattern", OUT_EWISE_FUSABLE)


def shape64(*dims):
    """A buffer shape in int64, as LegalizeOps writes the kernels around ours: FuseTIR maps one
    relax tensor to one buffer and refuses a int32 shape where the other side has int64."""
    from tvm import tirx

    return tuple(tirx.IntImm("int64", d) for d in dims)


def static_shape(expr) -> list[int] | None:
    """The static shape of a Relax expression's tensor type; None where it has none."""
    shape = getattr(expr.ty, "shape", None)
    if shape is None:
        return None
    try:
        return [int(v) for v in shape]
    except (TypeError, ValueError):
        return None


def plain_int8_conv(call):
    """(data, attrs, static NCHW shape, int8 OIHW weights as numpy) of an int8 x int8 -> int32 conv2d
    of groups 1 with constant weights, NCHW/OIHW layouts and explicit (zero) padding: what the
    int8 dot-product kernels compute; None for any other call."""
    import tvm  # late: kernels are imported where tvm is not loaded yet

    if not isinstance(call.op, tvm.ir.Op) or call.op.name != CONV:
        return None
    data, weight = call.args
    attrs = call.attrs
    shape = static_shape(data)
    if (not isinstance(weight, tvm.ir.GenericConst) or shape is None or len(shape) != 4 or int(attrs.groups) != 1
            or getattr(data.ty, "dtype", None) != "int8" or getattr(weight.ty, "dtype", None) != "int8"
            or str(attrs.out_dtype) != "int32" or attrs.data_layout != "NCHW" or attrs.kernel_layout != "OIHW"
            or attrs.out_layout != "NCHW" or any(int(p) for p in attrs.padding)):
        return None
    return data, attrs, shape, weight.value.numpy()
