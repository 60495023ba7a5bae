"""int8 convolutions on plain NEON (ARMv8.0: Cortex-A53/A72, Raspberry Pi 3 and 4) with `smull`/`smlal` + `sadalp`.

Cores before ARMv8.2 have no dot product: LLVM alone turns TVM's generic int8 convolution into
scalar `madd`s and a few widening multiplies. The `aarch64` build gives each int8 conv2d (groups
1, and the int8 matmuls as 1x1 convolutions) the channel-vector kernel of kernels/arm_dotprod.py,
the same data layout and tile, with the 16x4 product made of widening NEON multiplies instead:

    data    int8   [N, C/4, H, W, 4]                 4 input channels of one pixel (sdot's layout)
    weights int8   [O/16, C/4, KH, KW, 4, 2, 4, 2]   per q register of 4 output channels: the
                                                       first 2 input channels of each, then the last 2
    output  int32  [N, O, OH, OW]                    NCHW (or blocked [N, O/16, OH, OW, 16])

Per q register of 4 output channels, with the data word x0 x1 x2 x3 of a pixel as two 16-bit
broadcasts (x0 x1 four times, x2 x3 four times):

    smull  t.8h, (x0 x1)x4, w[c0k0 c0k1 c1k0 c1k1 .. c3k1]    8 int8 x int8 products in int16
    smlal  t.8h, (x2 x3)x4, w[c0k2 c0k3 c1k2 c1k3 .. c3k3]    each lane + the product 2 channels on
    sadalp acc.4s, t.8h                                        lanes 2i, 2i+1 (channel i) into int32 lane i

3 instructions for 16 multiply-adds where `sdot` takes 1, and no horizontal reduction: each int32
lane is one output channel, as in the sdot and VNNI tiles, so the write-back and its epilogues are
theirs. An int16 lane holds a0*w0 + a2*w2, which overflows only where both products are
(-128)*(-128): never when the weights are in [-127, 127] (onnxruntime's symmetric int8 weights).
A layer with a -128 weight gets the unpaired product instead (`smull`, `smull`, `saddlp`,
`sadalp`: each product widened alone), exact for any int8, one instruction more.
"""

from __future__ import annotations

import functools

import numpy as np

from appliance.deploy.compiler.kernels import dot16x4
from appliance.deploy.compiler.kernels.common import GEOMETRY, LANES, fusable, plain_int8_conv, shape64
from appliance.deploy.compiler.runtime import cpu_tensor_intrinsics

INTRINS = {True: "appliance_dot_16x4_smlal", False: "appliance_dot_16x4_smull"}  # paired: weights in [-127, 127]
SMULL = "llvm.aarch64.neon.smull.v8i16"
SADDLP = "llvm.aarch64.neon.saddlp.v4i32.v8i16"
GROUP = dot16x4.GROUP  # input channels per product group
ROWS = (4, 5, 6, 7, 3, 2, 1)  # pixels a tile by preference: 4 accumulators each, 4 weights, 2 data, temporaries


@functools.cache  # once per process and kind: every layer's kernel uses it
def register_intrinsic(paired: bool = True) -> str:
    """The 16x4 s8 x s8 -> s32 product on one pixel's 4 bytes of data, 4 output channels a q
    register; `paired`: two products summed in int16 before `sadalp` (weights without -128)."""
    cpu_tensor_intrinsics()
    from tvm.s_tir import TensorIntrin
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def desc(A: T.Buffer((4,), "int8", offset_factor=1), B: T.Buffer((4, 2, 4, 2), "int8", offset_factor=1),
             C: T.Buffer((16,), "int32", offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(C[0:16], A[0:4], B[0:4, 0:2, 0:4, 0:2])
            T.writes(C[0:16])
            for q, c, h, k in T.grid(4, 4, 2, 2):
                with T.sblock("update"):
                    vq, vc, vh, vk = T.axis.remap("SSRR", [q, c, h, k])
                    C[vq * 4 + vc] = C[vq * 4 + vc] + T.cast(A[vh * 2 + vk], "int32") * T.cast(B[vq, vh, vc, vk], "int32")

    def half(A, h):  # the data's 2 bytes of half h, broadcast to 8 bytes
        return T.reinterpret("int8x8", T.broadcast(T.reinterpret("int16", A.vload([h * 2], "int8x2")), 4))

    def product(A, B, q, h):
        return T.call_llvm_pure_intrin(T.llvm_lookup_intrinsic_id(SMULL), half(A, h),
                                       B.vload([q, h, 0, 0], dtype="int8x8"), dtype="int16x8")

    def widened(x):
        return T.call_llvm_pure_intrin(T.llvm_lookup_intrinsic_id(SADDLP), x, dtype="int32x4")

    @T.prim_func(s_tir=True)
    def impl_paired(A: T.Buffer((4,), "int8", offset_factor=1), B: T.Buffer((4, 2, 4, 2), "int8", offset_factor=1),
                    C: T.Buffer((16,), "int32", offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(C[0:16], A[0:4], B[0:4, 0:2, 0:4, 0:2])
            T.writes(C[0:16])
            for q in T.unroll(4):  # smull + smlal (the add of two smulls), sadalp (saddlp + add)
                C[T.ramp(q * 4, 1, 4)] = C.vload([q * 4], dtype="int32x4") + widened(
                    product(A, B, q, 0) + product(A, B, q, 1))

    @T.prim_func(s_tir=True)
    def impl_unpaired(A: T.Buffer((4,), "int8", offset_factor=1), B: T.Buffer((4, 2, 4, 2), "int8", offset_factor=1),
                      C: T.Buffer((16,), "int32", offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(C[0:16], A[0:4], B[0:4, 0:2, 0:4, 0:2])
            T.writes(C[0:16])
            for q in T.unroll(4):  # each product widened alone: exact for any int8
                C[T.ramp(q * 4, 1, 4)] = C.vload([q * 4], dtype="int32x4") + widened(product(A, B, q, 0)) + widened(
                    product(A, B, q, 1))

    TensorIntrin.register(INTRINS[paired], desc, impl_paired if paired else impl_unpaired, override=True)
    return INTRINS[paired]


def pack_weights(wq: np.ndarray) -> np.ndarray:
    """OIHW int8 -> [O/16, C/4, KH, KW, 4, 2, 4, 2]: output channel 16 ob + 4 q + c, input channel
    4 cb + 2 h + k at [ob, cb, kh, kw, q, h, c, k]; channels padded with zeros to whole groups."""
    blocked = dot16x4.pack_weights(wq)  # [O/16, C/4, KH, KW, 16, 4]
    o16, c4, kh, kw = blocked.shape[:4]
    return np.ascontiguousarray(blocked.reshape(o16, c4, kh, kw, 4, 4, 2, 2).transpose(0, 1, 2, 3, 4, 6, 5, 7))


def conv2d_kernel(n: int, c4: int, h: int, w: int, o16: int, kh: int, kw: int, stride: tuple, dilation: tuple,
                  blocked_out: bool = False, paired: bool = True):
    """The scheduled PrimFunc conv(data [n, c4, h, w, 4] s8, weights [o16, c4, kh, kw, 4, 2, 4, 2] s8)
    -> [n, o16 * 16, oh, ow] s32 (blocked_out: [n, o16, oh, ow, 16]), for data already padded;
    returns (func, (oh, ow))."""
    from tvm import s_tir
    from tvm.script import tirx as T

    sh, sw = stride
    dh, dw = dilation
    oh, ow = (h - dh * (kh - 1) - 1) // sh + 1, (w - dw * (kw - 1) - 1) // sw + 1
    out = (n, o16, oh, ow, 16) if blocked_out else (n, o16 * 16, oh, ow)
    name = "conv_blocked" if blocked_out else "conv"  # common.BLOCKED_BLOCKS: its write-back is vectorised already

    def at(vb, vob, vq, vc, vy, vx):
        return (vb, vob, vy, vx, vq * 4 + vc) if blocked_out else (vb, vob * 16 + vq * 4 + vc, vy, vx)

    @T.prim_func(s_tir=True)
    def conv(X: T.Buffer((n, c4, h, w, 4), "int8"), Wp: T.Buffer((o16, c4, kh, kw, 4, 2, 4, 2), "int8"),
             Y: T.Buffer(shape64(*out), "int32")):
        T.func_attr({"tir.noalias": True})
        for b, ob, y, x, oq, oc, cb, r, s, ch, ck in T.grid(n, o16, oh, ow, 4, 4, c4, kh, kw, 2, 2):
            with T.sblock(name):
                vb, vob, vy, vx, vq, vc, vcb, vr, vs, vh, vk = T.axis.remap(
                    "SSSSSSRRRRR", [b, ob, y, x, oq, oc, cb, r, s, ch, ck])
                with T.init():
                    Y[at(vb, vob, vq, vc, vy, vx)] = 0
                Y[at(vb, vob, vq, vc, vy, vx)] = Y[at(vb, vob, vq, vc, vy, vx)] + T.cast(
                    X[vb, vcb, vy * sh + vr * dh, vx * sw + vs * dw, vh * 2 + vk], "int32") * T.cast(
                    Wp[vob, vcb, vr, vs, vq, vh, vc, vk], "int32")

    sch = s_tir.Schedule(conv)
    block = sch.get_sblock(name)
    b, ob, y, x, oq, oc, cb, r, s, ch, ck = sch.get_loops(block)
    xo, xi = sch.split(x, [None, dot16x4.tile_rows(ow, ROWS)])
    sch.reorder(b, ob, y, xo, cb, r, s, xi, oq, oc, ch, ck)
    tile = sch.cache_write(block, 0, "global")  # the intrinsic's accumulator is a global-scope buffer
    if not blocked_out:  # the tile channels-last (a pixel's 16 sums: the intrinsic's vector), written out NCHW
        sch.transform_layout(block, ("write", 0), lambda b, c, y, x: (b, y, x, c))
    sch.reverse_compute_at(tile, xo)
    sch.parallel(sch.fuse(b, ob, y))
    init = sch.decompose_reduction(block, cb)
    sch.tensorize(oq, register_intrinsic(paired))
    sch.unroll(xi)
    *_, w_outer, w_inner = sch.get_loops(tile)
    sch.unroll(w_outer)
    if blocked_out:
        sch.vectorize(w_inner)
    else:
        sch.unroll(w_inner)
    sch.vectorize(sch.fuse(*sch.get_loops(init)[-2:]))  # a pixel's 16 zeros: 4 q registers
    return fusable(sch.mod["main"]), (oh, ow)


def blocked_kernel(n, c4, h, w, o16, kh, kw, stride, dilation, blocked_out=True):
    """The registry's `make` for the layout handover: the paired kernel with a blocked output (the
    handover's weights come from a layer this module lowered, so they are in [-127, 127] when it
    chose the paired product; a layer with -128 is never handed over, see lower_conv2d)."""
    return conv2d_kernel(n, c4, h, w, o16, kh, kw, stride, dilation, blocked_out=blocked_out, paired=True)


def lower_conv2d(builder, call, index, cpu, name):
    """An int8 x int8 -> int32 conv2d of groups 1 (what passes/int8_arith.py makes; padding
    explicit) on the NEON kernel; None for anything else. Exact: no shift, no compensation."""
    from tvm import relax

    operands = plain_int8_conv(call)
    if operands is None:
        return None
    data, attrs, shape, wq = operands
    n, c, h, w = shape
    o, _, kh, kw = wq.shape
    paired = bool(wq.min() > -128)
    packed = pack_weights(wq)
    o16, c4 = packed.shape[0], packed.shape[1]
    stride, dilation = tuple(int(v) for v in attrs.strides), tuple(int(v) for v in attrs.dilation)
    func, (oh, ow) = conv2d_kernel(n, c4, h, w, o16, kh, kw, stride, dilation, paired=paired)
    if paired:  # where it feeds a depthwise kernel, the layout handover remakes it with a blocked output
        func = func.with_attr(GEOMETRY, [*stride, *dilation])
    kernel = builder.add_func(func.without_attr("global_symbol"), f"{name}{index}")
    emit = builder.emit  # bound, so each step has its type for the next
    if c4 * GROUP != c:  # whole groups of 4 channels: zeros meet the zero weights packed there
        data = emit(relax.op.nn.pad(data, [0, 0, 0, c4 * GROUP - c, 0, 0, 0, 0], pad_value=0.0))
    blocked = emit(relax.op.permute_dims(relax.op.reshape(data, (n, c4, GROUP, h, w)), [0, 1, 3, 4, 2]))
    acc = relax.call_tir(kernel, [blocked, relax.const(packed)], relax.TensorType((n, o16 * LANES, oh, ow), "int32"))
    if o16 * LANES != o:  # whole vectors of 16 output channels: the padding channels sliced off
        return relax.op.strided_slice(emit(acc), axes=[1], begin=[0], end=[o])
    return acc  # the call itself: the layout handover looks for it under the requantize
