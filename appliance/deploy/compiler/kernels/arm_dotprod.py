"""int8 convolutions with the ARMv8.2 dot product (`sdot`) on aarch64: the x86 VNNI kernel's design.

`sdot v.4s, a.16b, b.16b` adds, into each of 4 int32 lanes, the 4 products of int8 x int8 in the
same lane's 4 bytes: one instruction does 16 multiply-adds. LLVM alone turns only a few reductions
of TVM's generic int8 convolution into it (ResNet-18: about a hundred `sdot`, the bulk scalar
`madd`), so the `aarch64-dotprod` build gives each int8 conv2d (groups 1, and the int8 matmuls as
1x1 convolutions, passes/dense_as_conv.py) the channel-vector kernel of kernels/dot16x4.py (shared with x86_vnni.py) with
`sdot` in place of `vpdpbusd`:

    data    int8   [N, C/4, H, W, 4]         4 input channels of one pixel: one 32-bit broadcast
    weights int8   [O/16, C/4, KH, KW, 16, 4]  packed once at compile time (a constant)
    output  int32  [N, O, OH, OW]            NCHW (or blocked [N, O/16, OH, OW, 16] for a handover)

16 output channels of a pixel are 4 q registers, so one 16x4 product is 4 `sdot` on the same
broadcast data word; the register tile is ROWS pixels x 16 channels (6 x 4 = 24 of the 32 q
registers accumulate, 4 hold weights, 1 the broadcast). The reduction over (C/4, KH, KW) runs
outside the tile, the tiles in parallel over the cores, the requantize and the other elementwise
ops after the kernel in its write-back (passes/epilogue_fusion.py), as on x86.

`sdot` is signed x signed: the int8 activations of passes/int8_arith.py go in as they are, no +128
shift and no compensation; the sums are exact, the int32 results those of the x86 build.
"""

from __future__ import annotations

import functools

from appliance.deploy.compiler.kernels import dot16x4
from appliance.deploy.compiler.kernels.common import GEOMETRY, LANES, plain_int8_conv
from appliance.deploy.compiler.runtime import cpu_tensor_intrinsics

INTRIN = "appliance_dot_16x4_sdot"
SDOT = "llvm.aarch64.neon.sdot.v4i32.v16i8"
GROUP = dot16x4.GROUP  # input channels per product group: 4 bytes of a lane
ROWS = (6, 4, 7, 5, 3, 2, 1)  # pixels a tile by preference: 4 q registers each, 24 (28) of 32 accumulate
# A 7-pixel tile (28 accumulators, 4 weights, a broadcast: 33 q registers) spills accumulators in
# its reduction loop; where that loop is long, fewer pixels cost less than the spills (estimated
# Cortex-A76 cycles, ResNet-18 at 224 px: the 14 px 3x3 layers 9.3 -> 6.4 M with 2 pixels, the 7 px
# ones 12.4 -> 9.7 M with 1), where it is short (MobileNetV2's 1x1 layers at 7 and 14 px, 16-80
# steps) 7 pixels stay cheaper (1.3 -> 3.1 M with 1 pixel). The bound between: LONG_REDUCTION steps.
ROWS_LONG = (6, 4, 5, 3, 2, 1)
LONG_REDUCTION = 256  # reduction steps (C/4 x KH x KW)


@functools.cache  # once per process: every layer's kernel uses it
def register_intrinsic() -> str:
    """The 16x4 s8 x s8 -> s32 dot product as 4 `sdot` (4 output channels each) on one broadcast
    word of data. TVM 0.27's own `dot_4x4_i8i8s32_sdot` does not build (its reinterpret arguments
    are in the old order); each store is one expression (see x86_vnni.register_intrinsic)."""
    cpu_tensor_intrinsics()
    from tvm.s_tir import TensorIntrin
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def desc(A: T.Buffer((4,), "int8", offset_factor=1), B: T.Buffer((16, 4), "int8", offset_factor=1),
             C: T.Buffer((16,), "int32", offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(C[0:16], A[0:4], B[0:16, 0:4])
            T.writes(C[0:16])
            for i in T.serial(0, 16):
                for k in T.serial(0, 4):
                    with T.sblock("update"):
                        vi, vk = T.axis.remap("SR", [i, k])
                        C[vi] = C[vi] + T.cast(A[vk], "int32") * T.cast(B[vi, vk], "int32")

    @T.prim_func(s_tir=True)
    def impl(A: T.Buffer((4,), "int8", offset_factor=1), B: T.Buffer((16, 4), "int8", offset_factor=1),
             C: T.Buffer((16,), "int32", offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(C[0:16], A[0:4], B[0:16, 0:4])
            T.writes(C[0:16])
            for q in T.unroll(4):  # 4 output channels a q register
                C[T.ramp(q * 4, 1, 4)] = T.call_llvm_pure_intrin(
                    T.llvm_lookup_intrinsic_id(SDOT), C.vload([q * 4], dtype="int32x4"),
                    T.reinterpret("int8x16", T.broadcast(T.reinterpret("int32", A.vload([0], "int8x4")), 4)),
                    B.vload([q * 4, 0], dtype="int8x16"), dtype="int32x4")

    TensorIntrin.register(INTRIN, desc, impl, override=True)
    return INTRIN


def conv2d_kernel(n: int, c4: int, h: int, w: int, o16: int, kh: int, kw: int, stride: tuple, dilation: tuple,
                  blocked_out: bool = False):
    """The scheduled PrimFunc conv(data [n, c4, h, w, 4] s8, weights [o16, c4, kh, kw, 16, 4] s8) ->
    [n, o16 * 16, oh, ow] s32 (blocked_out: [n, o16, oh, ow, 16]), for data already padded."""
    rows = ROWS_LONG if c4 * kh * kw >= LONG_REDUCTION else ROWS
    return dot16x4.conv2d_kernel(n, c4, h, w, o16, kh, kw, stride, dilation, blocked_out, dtype="int8",
                                 intrin=register_intrinsic(), rows=rows)


def lower_conv2d(builder, call, index, cpu, name):
    """An int8 x int8 -> int32 conv2d of groups 1 (what passes/int8_arith.py makes; padding
    explicit) on the sdot kernel; None for anything else. Exact: no shift, no compensation."""
    from tvm import relax

    operands = plain_int8_conv(call)
    if operands is None:
        return None
    data, attrs, shape, wq = operands
    n, c, h, w = shape
    o, _, kh, kw = wq.shape
    packed = dot16x4.pack_weights(wq)
    o16, c4 = packed.shape[0], packed.shape[1]
    stride, dilation = tuple(int(v) for v in attrs.strides), tuple(int(v) for v in attrs.dilation)
    func, (oh, ow) = conv2d_kernel(n, c4, h, w, o16, kh, kw, stride, dilation)
    # where it feeds a depthwise kernel, the layout handover remakes it with a blocked output from these
    kernel = builder.add_func(func.with_attr(GEOMETRY, [*stride, *dilation]).without_attr("global_symbol"),
                              f"{name}{index}")
    emit = builder.emit  # bound, so each step has its type for the next
    if c4 * GROUP != c:  # whole groups of 4 channels: zeros meet the zero weights packed there
        data = emit(relax.op.nn.pad(data, [0, 0, 0, c4 * GROUP - c, 0, 0, 0, 0], pad_value=0.0))
    # reshape + permute_dims: injective, fused with the requantize or padding before it (x86_vnni)
    blocked = emit(relax.op.permute_dims(relax.op.reshape(data, (n, c4, GROUP, h, w)), [0, 1, 3, 4, 2]))
    acc = relax.call_tir(kernel, [blocked, relax.const(packed)], relax.TensorType((n, o16 * LANES, oh, ow), "int32"))
    if o16 * LANES != o:  # whole vectors of 16 output channels: the padding channels sliced off
        return relax.op.strided_slice(emit(acc), axes=[1], begin=[0], end=[o])
    return acc  # the call itself: the layout handover looks for it under the requantize
