"""Depthwise convolutions, float32 and int8, on any CPU vector unit (AVX-512, AVX2, NEON).

One filter per channel: the data are blocked 16 channels a pixel, [N, C/16, H, W, 16], so each
product is one vector multiply-add over 16 channels, and the register tile is ROWS pixels of 16
channels (sized by the CPU description's tile, targets.py), written out NCHW as the channel-vector
kernels of simd_conv.py are. int8 data sum in int32; on AVX-512 in float32 instead (exact below
2^24: int8 x int8 products of up to EXACT_FLOAT_TAPS taps), one FMA per tap where int32 takes a
multiply of two uops and an add (the kernel alone: 0.18 against 0.26 ns per output).
"""

from __future__ import annotations

import numpy as np

from appliance.deploy.compiler.kernels.common import GEOMETRY, LANES, fusable, shape64
from appliance.deploy.compiler.kernels.simd_conv import FLOAT_OUT, STACK_BYTES, register_tile, padded, plain_conv, rows_for

EXACT_FLOAT_TAPS = 1024  # int8 x int8 sums of up to this many taps are integers below 2^24: exact in float32


def depthwise_kernel(n: int, c16: int, h: int, w: int, kh: int, kw: int, stride: tuple, dilation: tuple,
                     tile: tuple[str, int, int], dtype: str = "float32", acc_dtype: str | None = None,
                     group: int | None = None):
    """The scheduled PrimFunc of a depthwise conv(data [n, c16, h, w, 16], weights [c16, kh, kw, 16])
    -> [n, c16 * 16, oh, ow], for data already padded: float32, or int8 with int32 sums. 16 channels
    per vector: each product is one vector multiply-add, the tile ROWS pixels of 16 channels.
    acc_dtype "float32" for int8 data: float32 weights and sums (exact, see _depthwise)."""
    from tvm import s_tir
    from tvm.script import tirx as T

    sh, sw = stride
    dh, dw = dilation
    oh, ow = (h - dh * (kh - 1) - 1) // sh + 1, (w - dw * (kw - 1) - 1) // sw + 1
    acc_dtype = acc_dtype or ("int32" if dtype == "int8" else dtype)
    w_dtype = acc_dtype if acc_dtype == "float32" else dtype
    _, most_blocks, most_rows = tile
    rows = rows_for(ow, min(most_rows * most_blocks, (STACK_BYTES - 1) // (4 * LANES)))
    if group:
        return _grouped_kernel(n, c16, h, w, kh, kw, stride, dilation, (oh, ow), rows, dtype, w_dtype, acc_dtype,
                               group), (oh, ow)

    @T.prim_func(s_tir=True)
    def conv(X: T.Buffer((n, c16, h, w, 16), dtype), Wp: T.Buffer((c16, kh, kw, 16), w_dtype),
             Y: T.Buffer(shape64(n, c16 * 16, oh, ow), acc_dtype)):
        T.func_attr({"tir.noalias": True})
        for b, cb, y, x, ci, r, s in T.grid(n, c16, oh, ow, 16, kh, kw):
            with T.sblock("conv"):
                vb, vcb, vy, vx, vci, vr, vs = T.axis.remap("SSSSSRR", [b, cb, y, x, ci, r, s])
                with T.init():
                    Y[vb, vcb * 16 + vci, vy, vx] = T.cast(0, acc_dtype)
                Y[vb, vcb * 16 + vci, vy, vx] = Y[vb, vcb * 16 + vci, vy, vx] + (
                    T.cast(X[vb, vcb, vy * sh + vr * dh, vx * sw + vs * dw, vci], acc_dtype)
                    * T.cast(Wp[vcb, vr, vs, vci], acc_dtype))

    sch = s_tir.Schedule(conv)
    block = sch.get_sblock("conv")
    b, cb, y, x, ci, r, s = sch.get_loops(block)
    xo, xi = sch.split(x, [None, rows])
    sch.reorder(b, cb, y, xo, r, s, xi, ci)
    # the kernel row's taps unrolled too: each input pixel of the row is loaded (and converted) once
    # for all the taps that use it (measured: int8 0.26 -> 0.25, with float32 sums 0.21 -> 0.18 ns per output)
    return register_tile(sch, block, xo, (b, cb, y), ci, (s, xi) if kw <= 7 else (xi,), r), (oh, ow)


def _grouped_kernel(n, c16, h, w, kh, kw, stride, dilation, out, rows, dtype, w_dtype, acc_dtype, g):
    """depthwise_kernel with its output in groups of g channels, [n, c16 * 16 / g, oh, ow, g]: the
    layout the int8 dot-product kernels read ([N, C/4, H, W, 4] for sdot and VNNI), so that a
    depthwise layer hands its output to the 1x1 convolution after it with no layout pass between
    (passes/layout_handover.py). The tile keeps a pixel's 16 channels in one vector; the write-back
    stores each pixel's g-channel groups whole (g values one store)."""
    from tvm import s_tir
    from tvm.script import tirx as T

    (sh, sw), (dh, dw), (oh, ow) = stride, dilation, out
    per = LANES // g

    @T.prim_func(s_tir=True)
    def conv(X: T.Buffer((n, c16, h, w, 16), dtype), Wp: T.Buffer((c16, kh, kw, 16), w_dtype),
             Y: T.Buffer(shape64(n, c16 * per, oh, ow, g), acc_dtype)):
        T.func_attr({"tir.noalias": True})
        for b, cb, y, x, ci, r, s in T.grid(n, c16, oh, ow, 16, kh, kw):
            with T.sblock("conv_blocked_groups"):  # common.BLOCKED_BLOCKS: its write-back is vectorised already
                vb, vcb, vy, vx, vci, vr, vs = T.axis.remap("SSSSSRR", [b, cb, y, x, ci, r, s])
                with T.init():
                    Y[vb, vcb * per + vci // g, vy, vx, vci % g] = T.cast(0, acc_dtype)
                Y[vb, vcb * per + vci // g, vy, vx, vci % g] = Y[vb, vcb * per + vci // g, vy, vx, vci % g] + (
                    T.cast(X[vb, vcb, vy * sh + vr * dh, vx * sw + vs * dw, vci], acc_dtype)
                    * T.cast(Wp[vcb, vr, vs, vci], acc_dtype))

    sch = s_tir.Schedule(conv)
    block = sch.get_sblock("conv_blocked_groups")
    b, cb, y, x, ci, r, s = sch.get_loops(block)
    xo, xi = sch.split(x, [None, rows])
    sch.reorder(b, cb, y, xo, r, s, xi, ci)
    acc = sch.cache_write(block, 0, "global")  # see simd_conv.register_tile: the tile stays in registers
    # the tile a pixel's 16 channels together (one vector), as the other kernels keep it
    sch.transform_layout(block, ("write", 0), lambda b, c, y, x, k: (b, y, x, c, k))
    sch.reverse_compute_at(acc, xo)
    sch.parallel(sch.fuse(b, cb, y))
    sch.vectorize(ci)
    if kw <= 7:
        sch.unroll(s)
    sch.unroll(xi)
    sch.decompose_reduction(block, r)
    *_, w_groups, w_rows, w_lanes = sch.get_loops(acc)
    sch.unroll(w_rows)
    sch.unroll(w_groups)
    sch.vectorize(w_lanes)
    return fusable(sch.mod["main"])


def lower_int8(builder, call, index, cpu, name):
    """A depthwise int8 x int8 -> int32 conv2d (what passes/int8_arith.py makes) on the kernel here."""
    return _depthwise(builder, call, index, cpu.tile, "int8", name)


def lower_fp32(builder, call, index, cpu, name):
    """A depthwise float32 conv2d with constant weights on the kernel here."""
    return _depthwise(builder, call, index, cpu.tile, "float32", name)


def _depthwise(builder, call, index, tile, dtype, name):
    """conv2d with groups == channels, one filter per channel: blocked 16 channels per pixel."""
    from tvm import relax

    shape = plain_conv(call, dtype, ("int32",) if dtype == "int8" else FLOAT_OUT)
    if shape is None:
        return None
    data, weight = call.args
    attrs = call.attrs
    n, c, h, wd = shape
    w = weight.value.numpy()
    if int(attrs.groups) != c or w.shape[0] != c or w.shape[1] != 1:
        return None
    kh, kw = w.shape[2:]
    # int8 on AVX-512: float32 weights and sums, exact below 2^24, one FMA per tap where int32 takes
    # a multiply of two uops and an add (the kernel alone: 0.18 against 0.26 ns per output)
    acc_dtype = "float32" if dtype == "int8" and tile[0] == "avx512" and kh * kw <= EXACT_FLOAT_TAPS else None
    if acc_dtype:
        w = w.astype(np.float32)
    c16 = -(-c // LANES)
    packed = np.zeros((c16 * LANES, kh, kw), w.dtype)
    packed[:c] = w[:, 0]
    packed = np.ascontiguousarray(packed.reshape(c16, LANES, kh, kw).transpose(0, 2, 3, 1))
    data, (ph, pw) = padded(builder, data, attrs)
    if c16 * LANES != c:  # zero channels meet zero filters
        data = builder.emit(relax.op.nn.pad(data, [0, 0, 0, c16 * LANES - c, 0, 0, 0, 0], pad_value=0.0))
    func, (oh, ow) = depthwise_kernel(n, c16, h + ph, wd + pw, kh, kw, tuple(int(v) for v in attrs.strides),
                                      tuple(int(v) for v in attrs.dilation), tile, dtype, acc_dtype)
    func = func.with_attr(GEOMETRY, [*(int(v) for v in attrs.strides), *(int(v) for v in attrs.dilation)])
    kernel = builder.add_func(func.without_attr("global_symbol"), f"{name}{index}")
    emit = builder.emit
    blocked = emit(relax.op.permute_dims(relax.op.reshape(data, (n, c16, LANES, h + ph, wd + pw)), [0, 1, 3, 4, 2]))
    sums = acc_dtype or ("int32" if dtype == "int8" else dtype)
    out = relax.call_tir(kernel, [blocked, relax.const(packed)], relax.TensorType((n, c16 * LANES, oh, ow), sums))
    if c16 * LANES != c:
        out = relax.op.strided_slice(emit(out), axes=[1], begin=[0], end=[c])
    if acc_dtype:  # whole numbers: back to the int32 sums the epilogue expects, in the write-back
        out = relax.op.astype(emit(out), "int32")
    return out  # not bound here: a binding of its own (a var alias) would keep FuseOps from the ops after it
