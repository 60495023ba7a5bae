"""int8 convolutions with AVX-512 VNNI on x86_64: hand-scheduled TIR kernels, no search needed.

Two kernels: the channel-vector one (below) and, for 1x1 layers of short reductions, one with 16
pixels a vector (`pixels_kernel`, the int8 twin of x86_avx512.py's float32 one: its docstring says
why).

`vpdpbusd` adds, into 16 int32 lanes, 4 products of uint8 x int8 each: one instruction does 64
multiply-adds. MetaSchedule's generic CPU rules never use it (LLVM alone leaves int8 convolutions
mostly scalar: about 26 GOPS tuned, where onnxruntime reaches 600), and TVM 0.27's own VNNI
intrinsic does not build (its LLVM declares the instruction with <64 x i8> operands; the
intrinsic passes <16 x i32>). So the x86_64 build of a host with VNNI gives each int8 conv2d
(groups 1) a kernel of its own, scheduled here:

    data    uint8  [N, C/4, H, W, 4]         4 input channels of one pixel: one 32-bit broadcast
    weights int8   [O/16, C/4, KH, KW, 16, 4]  packed once at compile time (a constant)
    output  int32  [N, O, OH, OW]            NCHW, as the layers after it read it

with a register tile of ROWS output pixels x 16 channels (accumulators stay in registers, 16
channels of one pixel per zmm), the reduction over (C/4, KH, KW) outside it and 4 channels per
instruction inside, and the tiles parallel over the cores. The tile is written out channel by
channel: a separate transpose pass back to NCHW cost more than the scalar stores (simd_conv.py,
measured). The elementwise ops after the kernel (zero-point correction, requantize, a residual
add, the next layer's uint8 shift) run in its write-back (passes/epilogue_fusion.py); the padding,
reshape and transpose into the blocked data layout are a function of their own.

uint8 data: the int8 activations of passes/int8_arith.py shifted by +128 (their zero point too), so
every product is exact and the zero-point correction stays the constant it was.
"""

from __future__ import annotations

import functools

import numpy as np

from appliance.deploy.compiler.kernels import dot16x4, x86_avx512
from appliance.deploy.compiler.kernels.dot16x4 import GROUP, pack_weights
from appliance.deploy.compiler.kernels.common import GEOMETRY, LANES, fusable, plain_int8_conv, shape64
from appliance.deploy.compiler.kernels.x86_avx512 import pixel_tile
from appliance.deploy.compiler.runtime import cpu_tensor_intrinsics

INTRIN = "appliance_dot_16x4_vnni"


@functools.cache  # once per process: every layer's kernel uses it
def register_intrinsic() -> str:
    """The 16x4 u8 x s8 -> s32 dot product for TVM 0.27's LLVM, written as one expression: in
    TVMScript an assignment becomes a local buffer, and temporaries sent every operand through the
    stack (5x slower, measured)."""
    cpu_tensor_intrinsics()
    from tvm.s_tir import TensorIntrin
    from tvm.s_tir.tensor_intrin.x86 import dot_product_16x4_u8i8i32_desc
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def vnni(A: T.Buffer((4,), "uint8", offset_factor=1), B: T.Buffer((16, 4), "int8", offset_factor=1),
             C: T.Buffer((16,), "int32", offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(C[0:16], A[0:4], B[0:16, 0:4])
            T.writes(C[0:16])
            C[T.ramp(T.int32(0), 1, 16)] = T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id("llvm.x86.avx512.vpdpbusd.512"), C.vload([0], dtype="int32x16"),
                T.reinterpret("int8x64", T.broadcast(T.reinterpret("int32", A.vload([0], "uint8x4")), 16)),
                B.vload([0, 0], dtype="int8x64"), dtype="int32x16")

    TensorIntrin.register(INTRIN, dot_product_16x4_u8i8i32_desc, vnni, override=True)
    return INTRIN


ROWS = (7, 4, 8, 6, 5, 3, 2, 1)  # pixels a register tile, by preference: 16 channels of a pixel are one zmm


def conv2d_kernel(n: int, c4: int, h: int, w: int, o16: int, kh: int, kw: int, stride: tuple, dilation: tuple,
                  blocked_out: bool = False):
    """dot16x4.conv2d_kernel on uint8 data with vpdpbusd."""
    return dot16x4.conv2d_kernel(n, c4, h, w, o16, kh, kw, stride, dilation, blocked_out, "uint8",
                                 register_intrinsic(), ROWS)


def pack_int8(wq: np.ndarray, ot: int) -> np.ndarray:
    """OIHW int8 (1x1) -> [O/OT, C/4, OT, 4], input channels padded with zeros to whole groups of 4."""
    o, c = wq.shape[:2]
    c4 = -(-c // 4)
    padded = np.zeros((o, c4 * 4), np.int8)
    padded[:, :c] = wq.reshape(o, c)
    return np.ascontiguousarray(padded.reshape(o // ot, ot, c4, 4).transpose(0, 2, 1, 3))


def pixels_kernel(n: int, c4: int, h: int, w: int, o: int, ot: int, pt: int):
    """The scheduled PrimFunc conv(data [n, c4, h, w, 4] u8, weights [o/ot, c4, ot, 4] s8) ->
    [n, o, h, w] s32, with AVX-512 VNNI: each `vpdpbusd` adds 16 pixels x 4 channels of products."""
    from tvm.script import tirx as T

    p, v = h * w, pt * LANES
    tasks, inner = x86_avx512._steps(n, o, p, ot, pt)
    groups, chunks = o // ot, p // (v * inner)
    dot = T.llvm_lookup_intrinsic_id("llvm.x86.avx512.vpdpbusd.512")

    @T.prim_func(s_tir=True)
    def conv(X: T.Buffer((n, c4, h, w, 4), "uint8"), Wp: T.Buffer((groups, c4, ot, 4), "int8"),
             Y: T.Buffer(shape64(n, o, h, w), "int32")):
        T.func_attr({"tir.noalias": True})
        acc = T.sblock_alloc_buffer((n, o, p), "int32")
        for f0 in T.parallel(tasks):
            for f1 in range(inner):
                for oi, pv, lane in T.grid(ot, pt, LANES):
                    with T.sblock("conv_pixels_init"):
                        vb = T.axis.spatial(n, f0 // (groups * chunks))
                        vo = T.axis.spatial(o, f0 // chunks % groups * ot + oi)
                        vp = T.axis.spatial(p, (f0 % chunks * inner + f1) * v + pv * LANES + lane)
                        acc[vb, vo, vp] = 0
                for cc in range(c4):
                    for oi in T.unroll(ot):
                        for pv in T.unroll(pt):
                            with T.sblock("conv_pixels_update"):
                                vb = T.axis.spatial(n, f0 // (groups * chunks))
                                vo = T.axis.spatial(o, f0 // chunks % groups * ot + oi)
                                vq = T.axis.spatial(p // LANES, (f0 % chunks * inner + f1) * pt + pv)
                                vc = T.axis.reduce(c4, cc)
                                T.reads(acc[vb, vo, vq * LANES:vq * LANES + LANES], X[vb, vc, 0:h, 0:w, 0:4],
                                        Wp[vo // ot, vc, vo % ot, 0:4])
                                T.writes(acc[vb, vo, vq * LANES:vq * LANES + LANES])
                                # 16 pixels x 4 channels of data (64 contiguous bytes), 4 weights broadcast
                                acc[vb, vo, T.ramp(vq * LANES, 1, LANES)] = T.call_llvm_pure_intrin(
                                    dot, acc.vload([vb, vo, vq * LANES], dtype="int32x16"),
                                    T.reinterpret("int8x64", X.vload([vb, vc, vq * LANES // w, vq * LANES % w, 0],
                                                                     dtype="uint8x64")),
                                    T.reinterpret("int8x64", T.broadcast(
                                        T.reinterpret("int32", Wp.vload([vo // ot, vc, vo % ot, 0], "int8x4")), LANES)),
                                    dtype="int32x16")
                for oi in T.unroll(ot):
                    for pv in T.unroll(pt):
                        for lane in T.vectorized(LANES):
                            with T.sblock("Y_global"):  # common.WRITE_BACK: the epilogue goes here
                                vb = T.axis.spatial(n, f0 // (groups * chunks))
                                vo = T.axis.spatial(o, f0 // chunks % groups * ot + oi)
                                vp = T.axis.spatial(p, (f0 % chunks * inner + f1) * v + pv * LANES + lane)
                                Y[vb, vo, vp // w, vp % w] = acc[vb, vo, vp]
    return fusable(conv)


def lower_pixels(builder, call, index, cpu, name):
    """An int8 1x1 conv2d (stride 1, groups 1) on `pixels_kernel` where its tile fits; else None."""
    return _vnni_conv(builder, call, index, name, pixels=True)


def lower_conv2d(builder, call, index, cpu, name):
    """An int8 x int8 -> int32 conv2d of groups 1 (what passes/int8_arith.py makes) on the
    channel-vector kernel. The int8 data are shifted to uint8 (+128) for the instruction, and 128 x
    the weights' sum per output channel taken off again: exact."""
    return _vnni_conv(builder, call, index, name, pixels=False)


def _vnni_conv(builder, call, index, name, pixels: bool):
    from tvm import relax

    operands = plain_int8_conv(call)
    if operands is None:
        return None
    data, attrs, shape, wq = operands
    n, c, h, w = shape
    o, _, kh, kw = wq.shape
    tile = pixel_tile(attrs, wq.shape, h * w, "avx512")  # VNNI CPUs have AVX-512
    if pixels and tile is None:
        return None
    if pixels:  # 16 pixels a vector: for the 1x1 layers of short reductions
        c4, channels = -(-c // GROUP), o
        func, (oh, ow) = pixels_kernel(n, c4, h, w, o, *tile), (h, w)
        packed = pack_int8(wq, tile[0])
        kernel = builder.add_func(func.without_attr("global_symbol"), f"{name}{index}")
    else:
        packed = pack_weights(wq)
        o16, c4 = packed.shape[0], packed.shape[1]
        channels = o16 * LANES  # whole vectors of 16: the padding channels are sliced off below
        stride, dilation = tuple(int(v) for v in attrs.strides), tuple(int(v) for v in attrs.dilation)
        func, (oh, ow) = conv2d_kernel(n, c4, h, w, o16, kh, kw, stride, dilation)
        # where it feeds a depthwise kernel, the layout handover remakes it with a blocked output from these
        func = func.with_attr(GEOMETRY, [*stride, *dilation])
        kernel = builder.add_func(func.without_attr("global_symbol"), f"{name}{index}")
    emit = builder.emit  # bound, so each step has its type for the next
    shifted = emit(relax.op.astype(relax.op.add(relax.op.astype(data, "int16"), relax.const(128, "int16")), "uint8"))
    if c4 * GROUP != c:  # whole groups of 4 channels: zeros meet the zero weights packed there
        shifted = emit(relax.op.nn.pad(shifted, [0, 0, 0, c4 * GROUP - c, 0, 0, 0, 0], pad_value=0.0))
    # reshape + permute_dims rather than layout_transform: injective, so TVM fuses them with the
    # elementwise work before and after (a layout_transform stayed a kernel and a pass of its own).
    blocked = emit(relax.op.permute_dims(relax.op.reshape(shifted, (n, c4, GROUP, h, w)), [0, 1, 3, 4, 2]))
    acc = emit(relax.call_tir(kernel, [blocked, relax.const(packed)], relax.TensorType((n, channels, oh, ow), "int32")))
    if channels != o:
        acc = emit(relax.op.strided_slice(acc, axes=[1], begin=[0], end=[o]))
    shift = (128 * wq.astype(np.int64).reshape(o, -1).sum(1)).astype(np.int32).reshape(1, o, 1, 1)
    return relax.op.subtract(acc, relax.const(shift))
