"""int8 convolutions with the ARMv8.6 matrix multiply-accumulate (`smmla`, i8mm) on aarch64.

`smmla v.4s, a.16b, b.16b` treats a and b as two 2x8 int8 matrices and adds a x b^T, a 2x2 int32
matrix, into v: 32 multiply-adds per instruction, twice `sdot`'s 16 (Cortex-A510/A710/X2,
Neoverse N2, Apple M2+). Rows of a are 2 neighbouring output pixels, rows of b 2 output channels,
k 8 input channels:

    data    int8   [N, C/8, H, W, 8]               8 input channels of a pixel: 2 pixels are 16 bytes
    weights int8   [O/16, C/8, KH, KW, 8, 2, 8]    per pair of output channels 2 rows of 8 (a constant)
    output  int32  [N, O, OH, OW]                  NCHW (or blocked [N, O/16, OH, OW, 16])

A tile of 2 pixel pairs x 16 channels is 16 q registers of sums (8 `smmla` a pair, each [p0c0
p0c1 p1c0 p1c1]) and 8 of weights; the tile's layout is the instruction's, so the write-back reads
a pixel's 16 channels from every other lane (LLVM's shuffles; the epilogue runs there as for the
other kernels). 2 neighbouring output pixels of one tap are neighbouring input pixels only where the
horizontal stride is 1 and the output width is even: other layers (stride-2 downsampling, the 7x7
stem, odd widths) stay on the `sdot` kernel, which every i8mm CPU has, and compile.json's
`int8_kernels.by_kind` says how many went where. Signed x signed, exact: no shift, no compensation.
"""

from __future__ import annotations

import functools

import numpy as np

from appliance.deploy.compiler.kernels.common import GEOMETRY, LANES, fusable, plain_int8_conv, shape64
from appliance.deploy.compiler.runtime import cpu_tensor_intrinsics

INTRIN = "appliance_mm_2x16x8_smmla"
SMMLA = "llvm.aarch64.neon.smmla.v4i32.v16i8"
GROUP = 8  # input channels a product: one row of smmla's 2x8 operands
PAIRS = (2, 1)  # pixel pairs a tile by preference: 8 q registers of sums each, 8 of weights, 1 of data


@functools.cache  # once per process: every layer's kernel uses it
def register_intrinsic() -> str:
    """2 pixels x 16 output channels x 8 input channels as 8 `smmla` on one 16-byte load of data."""
    cpu_tensor_intrinsics()
    from tvm.s_tir import TensorIntrin
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def desc(A: T.Buffer((2, 8), "int8", offset_factor=1), B: T.Buffer((8, 2, 8), "int8", offset_factor=1),
             C: T.Buffer((8, 2, 2), "int32", offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(C[0:8, 0:2, 0:2], A[0:2, 0:8], B[0:8, 0:2, 0:8])
            T.writes(C[0:8, 0:2, 0:2])
            for cp, p, c, k in T.grid(8, 2, 2, 8):
                with T.sblock("update"):
                    vcp, vp, vc, vk = T.axis.remap("SSSR", [cp, p, c, k])
                    C[vcp, vp, vc] = C[vcp, vp, vc] + T.cast(A[vp, vk], "int32") * T.cast(B[vcp, vc, vk], "int32")

    @T.prim_func(s_tir=True)
    def impl(A: T.Buffer((2, 8), "int8", offset_factor=1), B: T.Buffer((8, 2, 8), "int8", offset_factor=1),
             C: T.Buffer((8, 2, 2), "int32", offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(C[0:8, 0:2, 0:2], A[0:2, 0:8], B[0:8, 0:2, 0:8])
            T.writes(C[0:8, 0:2, 0:2])
            for cp in T.unroll(8):  # one q register of sums per pair of output channels
                C[cp, 0, T.ramp(0, 1, 4)] = T.call_llvm_pure_intrin(
                    T.llvm_lookup_intrinsic_id(SMMLA), C.vload([cp, 0, 0], dtype="int32x4"),
                    A.vload([0, 0], dtype="int8x16"), B.vload([cp, 0, 0], dtype="int8x16"), dtype="int32x4")

    TensorIntrin.register(INTRIN, desc, impl, override=True)
    return INTRIN


def pack_weights(wq: np.ndarray) -> np.ndarray:
    """OIHW int8 -> [O/16, C/8, KH, KW, 8, 2, 8]: output channel 16 ob + 2 cp + c, input channel
    8 cb + k at [ob, cb, kh, kw, cp, c, k]; channels padded with zeros to whole groups."""
    o, c, kh, kw = wq.shape
    op, cpad = -(-o // LANES) * LANES, -(-c // GROUP) * GROUP
    padded = np.zeros((op, cpad, kh, kw), np.int8)
    padded[:o, :c] = wq
    return np.ascontiguousarray(
        padded.reshape(op // LANES, 8, 2, cpad // GROUP, GROUP, kh, kw).transpose(0, 3, 5, 6, 1, 2, 4))


def conv2d_kernel(n: int, c8: int, h: int, w: int, o16: int, kh: int, kw: int, stride: tuple, dilation: tuple,
                  blocked_out: bool = False):
    """The scheduled PrimFunc conv(data [n, c8, h, w, 8] s8, weights [o16, c8, kh, kw, 8, 2, 8] s8)
    -> [n, o16 * 16, oh, ow] s32 (blocked_out: [n, o16, oh, ow, 16]), for data already padded, a
    horizontal stride of 1 and an even output width; returns (func, (oh, ow))."""
    from tvm import s_tir
    from tvm.script import tirx as T

    sh, _ = stride
    dh, dw = dilation
    oh, ow = (h - dh * (kh - 1) - 1) // sh + 1, w - dw * (kw - 1)
    out = (n, o16, oh, ow, 16) if blocked_out else (n, o16 * 16, oh, ow)
    name = "conv_blocked" if blocked_out else "conv"  # common.BLOCKED_BLOCKS: its write-back is vectorised already

    def at(vb, vob, vcp, vc, vy, vx):
        return (vb, vob, vy, vx, vcp * 2 + vc) if blocked_out else (vb, vob * 16 + vcp * 2 + vc, vy, vx)

    @T.prim_func(s_tir=True)
    def conv(X: T.Buffer((n, c8, h, w, 8), "int8"), Wp: T.Buffer((o16, c8, kh, kw, 8, 2, 8), "int8"),
             Y: T.Buffer(shape64(*out), "int32")):
        T.func_attr({"tir.noalias": True})
        for b, ob, y, xp, cp, p, c, cb, r, s, k in T.grid(n, o16, oh, ow // 2, 8, 2, 2, c8, kh, kw, 8):
            with T.sblock(name):
                vb, vob, vy, vxp, vcp, vp, vc, vcb, vr, vs, vk = T.axis.remap(
                    "SSSSSSSRRRR", [b, ob, y, xp, cp, p, c, cb, r, s, k])
                with T.init():
                    Y[at(vb, vob, vcp, vc, vy, vxp * 2 + vp)] = 0
                Y[at(vb, vob, vcp, vc, vy, vxp * 2 + vp)] = Y[at(vb, vob, vcp, vc, vy, vxp * 2 + vp)] + T.cast(
                    X[vb, vcb, vy * sh + vr * dh, vxp * 2 + vp + vs * dw, vk], "int32") * T.cast(
                    Wp[vob, vcb, vr, vs, vcp, vc, vk], "int32")

    sch = s_tir.Schedule(conv)
    block = sch.get_sblock(name)
    b, ob, y, xp, cp, p, c, cb, r, s, k = sch.get_loops(block)
    xo, xi = sch.split(xp, [None, next(q for q in PAIRS if (ow // 2) % q == 0)])
    sch.reorder(b, ob, y, xo, cb, r, s, xi, cp, p, c, k)
    tile = sch.cache_write(block, 0, "global")  # the intrinsic's accumulator is a global-scope buffer
    # the tile in smmla's layout: [pixel pair, channel pair, pixel, channel] for each 16 channels
    if blocked_out:
        sch.transform_layout(block, ("write", 0), lambda b, o, y, x, i: (b, o, y, x // 2, i // 2, x % 2, i % 2))
    else:
        sch.transform_layout(block, ("write", 0),
                             lambda b, o, y, x: (b, y, x // 2, o // 16, o % 16 // 2, x % 2, o % 2))
    sch.reverse_compute_at(tile, xo)
    sch.parallel(sch.fuse(b, ob, y))
    init = sch.decompose_reduction(block, cb)
    sch.tensorize(cp, register_intrinsic())
    sch.unroll(xi)
    *_, w_outer, w_inner = sch.get_loops(tile)
    sch.unroll(w_outer)
    sch.unroll(w_inner)  # a pixel's channels are every other lane: LLVM's shuffles, not a vector load
    sch.vectorize(sch.fuse(*sch.get_loops(init)[-3:]))  # a pair's 32 zeros
    return fusable(sch.mod["main"]), (oh, ow)


def lower_conv2d(builder, call, index, cpu, name):
    """An int8 x int8 -> int32 conv2d of groups 1, horizontal stride 1 and an even output width on
    the smmla kernel; None for anything else (the sdot kernel takes it)."""
    from tvm import relax

    operands = plain_int8_conv(call)
    if operands is None:
        return None
    data, attrs, shape, wq = operands
    n, c, h, w = shape
    o, _, kh, kw = wq.shape
    stride, dilation = tuple(int(v) for v in attrs.strides), tuple(int(v) for v in attrs.dilation)
    if stride[1] != 1 or (w - dilation[1] * (kw - 1)) % 2:
        return None
    packed = pack_weights(wq)
    o16, c8 = packed.shape[0], packed.shape[1]
    func, (oh, ow) = conv2d_kernel(n, c8, h, w, o16, kh, kw, stride, dilation)
    # where it feeds a depthwise kernel, the layout handover remakes it with a blocked output
    kernel = builder.add_func(func.with_attr(GEOMETRY, [*stride, *dilation]).without_attr("global_symbol"),
                              f"{name}{index}")
    emit = builder.emit  # bound, so each step has its type for the next
    if c8 * GROUP != c:  # whole groups of 8 channels: zeros meet the zero weights packed there
        data = emit(relax.op.nn.pad(data, [0, 0, 0, c8 * GROUP - c, 0, 0, 0, 0], pad_value=0.0))
    blocked = emit(relax.op.permute_dims(relax.op.reshape(data, (n, c8, GROUP, h, w)), [0, 1, 3, 4, 2]))
    acc = relax.call_tir(kernel, [blocked, relax.const(packed)], relax.TensorType((n, o16 * LANES, oh, ow), "int32"))
    if o16 * LANES != o:  # whole vectors of 16 output channels: the padding channels sliced off
        return relax.op.strided_slice(emit(acc), axes=[1], begin=[0], end=[o])
    return acc  # the call itself: the layout handover looks for it under the requantize
