"""float32 convolutions on any CPU vector unit (AVX-512, AVX2, NEON): register-tiled TIR kernels, no search needed.

TVM's default CPU lowering of conv2d is the naive loop nest (ResNet-18 ran 60x slower than
onnxruntime untuned, 10x after 8 tuning trials per task). Each float32 conv2d of groups 1 gets a
kernel of its own here, the classic direct-convolution scheme:

    data    float32 [N, C, H, W]            padded beforehand; one scalar broadcast per product
    weights float32 [O/16, C, KH, KW, 16]   packed once at compile time (a constant)
    output  float32 [N, O, OH, OW]          NCHW, as the layers after it read it

with a register tile of ROWS output pixels x BLOCKS x 16 channels (the accumulators stay in
registers, 16 channels of one pixel per vector), the reduction over (C, KH, KW) outside it, and
the tiles parallel over the cores. The tile is written out channel by channel, a row of pixels
each: scalar stores, but a separate transpose pass from a blocked output back to NCHW cost more
(MobileNetV2's kernels and glue, timed one by one: 21.7 ms with the pass, 16.5 ms without). The
16-wide vector is one zmm on AVX-512, two ymm on AVX2, four q registers on NEON; the tile is sized
per CPU so the accumulators, the weights and a broadcast fit its vector registers. The
elementwise ops after a kernel (bias, activation, requantize) join it and run in its write-back
(passes/epilogue_fusion.py). The tile comes from the CPU description (targets.py: `CPU.tile`).

Two TVM 0.27 details decide the speed (measured, 64x56x56 3x3, 2 cores): the accumulator tile is
allocated in "global" scope, because LowerTVMBuiltin puts only global allocations under 1 KiB on the
stack and sends "local" ones to TVMBackendAllocWorkspace, where LLVM cannot keep them in registers
(48 vs 163 GFLOPS); and it must stay under that 1 KiB (rows x blocks x 16 x 4 bytes).
"""

from __future__ import annotations

import numpy as np

from appliance.deploy.compiler.kernels.common import CONV, LANES, GEOMETRY, fusable, shape64, static_shape

STACK_BYTES = 1024  # tvm::runtime::kMaxStackAlloca: larger tiles leave the stack, and the registers
FLOAT_OUT = ("None", "", "void", "float32")  # conv2d's out_dtype of a float32 layer


def rows_for(ow: int, most: int) -> int:
    """The most output pixels per tile (at most `most`) that divide the output row evenly."""
    return next(r for r in range(most, 0, -1) if ow % r == 0)


def pack_weights(w: np.ndarray) -> np.ndarray:
    """OIHW float32 -> [O/16, C, KH, KW, 16], output channels padded with zeros to whole vectors."""
    o, c, kh, kw = w.shape
    op = -(-o // LANES) * LANES
    padded = np.zeros((op, c, kh, kw), np.float32)
    padded[:o] = w
    return np.ascontiguousarray(padded.reshape(op // LANES, LANES, c, kh, kw).transpose(0, 2, 3, 4, 1))


def conv2d_kernel(n: int, c: int, h: int, w: int, o16: int, kh: int, kw: int, stride: tuple, dilation: tuple,
                  tile: tuple[str, int, int], blocked_out: bool = False):
    """The scheduled PrimFunc conv(data [n, c, h, w], weights [o16, c, kh, kw, 16]) ->
    [n, o16 * 16, oh, ow], all float32, for data already padded; returns (func, (oh, ow)).
    blocked_out: -> [n, o16, oh, ow, 16], a pixel's 16 channels one vector store (for a depthwise
    kernel after it, passes/layout_handover.py)."""
    from tvm import s_tir
    from tvm.script import tirx as T

    sh, sw = stride
    dh, dw = dilation
    oh, ow = (h - dh * (kh - 1) - 1) // sh + 1, (w - dw * (kw - 1) - 1) // sw + 1
    _, most_blocks, most_rows = tile
    blocks = most_blocks if o16 % most_blocks == 0 else 1  # fewer blocks: as many more rows
    rows = rows_for(ow, min(most_rows * most_blocks // blocks, (STACK_BYTES - 1) // (4 * LANES * blocks)))

    @T.prim_func(s_tir=True)
    def conv(X: T.Buffer((n, c, h, w), "float32"), Wp: T.Buffer((o16, c, kh, kw, 16), "float32"),
             Y: T.Buffer(shape64(n, o16 * 16, oh, ow), "float32")):
        T.func_attr({"tir.noalias": True})
        for b, ob, y, x, oi, cc, r, s in T.grid(n, o16, oh, ow, 16, c, kh, kw):
            with T.sblock("conv"):
                vb, vob, vy, vx, voi, vc, vr, vs = T.axis.remap("SSSSSRRR", [b, ob, y, x, oi, cc, r, s])
                with T.init():
                    Y[vb, vob * 16 + voi, vy, vx] = T.float32(0)
                Y[vb, vob * 16 + voi, vy, vx] = Y[vb, vob * 16 + voi, vy, vx] + (
                    X[vb, vc, vy * sh + vr * dh, vx * sw + vs * dw] * Wp[vob, vc, vr, vs, voi])

    @T.prim_func(s_tir=True)
    def conv_blocked(X: T.Buffer((n, c, h, w), "float32"), Wp: T.Buffer((o16, c, kh, kw, 16), "float32"),
                     Y: T.Buffer(shape64(n, o16, oh, ow, 16), "float32")):
        T.func_attr({"tir.noalias": True})
        for b, ob, y, x, oi, cc, r, s in T.grid(n, o16, oh, ow, 16, c, kh, kw):
            with T.sblock("conv_blocked"):  # common.BLOCKED_BLOCKS: its write-back is vectorised already
                vb, vob, vy, vx, voi, vc, vr, vs = T.axis.remap("SSSSSRRR", [b, ob, y, x, oi, cc, r, s])
                with T.init():
                    Y[vb, vob, vy, vx, voi] = T.float32(0)
                Y[vb, vob, vy, vx, voi] = Y[vb, vob, vy, vx, voi] + (
                    X[vb, vc, vy * sh + vr * dh, vx * sw + vs * dw] * Wp[vob, vc, vr, vs, voi])

    sch = s_tir.Schedule(conv_blocked if blocked_out else conv)
    block = sch.get_sblock("conv_blocked" if blocked_out else "conv")
    b, ob, y, x, oi, cc, r, s = sch.get_loops(block)
    xo, xi = sch.split(x, [None, rows])
    obo, obi = sch.split(ob, [None, blocks])
    if blocked_out:
        sch.reorder(b, obo, y, xo, cc, r, s, xi, obi, oi)
        acc = sch.cache_write(block, 0, "global")  # see register_tile: the tile on the stack, in registers
        sch.reverse_compute_at(acc, xo)
        sch.parallel(sch.fuse(b, obo, y))
        sch.vectorize(oi)
        sch.unroll(xi)
        sch.unroll(obi)
        sch.decompose_reduction(block, cc)
        *_, w_blocks, w_rows, w_channels = sch.get_loops(acc)
        sch.unroll(w_blocks)
        sch.unroll(w_rows)
        sch.vectorize(w_channels)
        return fusable(sch.mod["main"]), (oh, ow)
    sch.reorder(b, obo, y, xo, cc, r, s, xi, obi, oi)
    return register_tile(sch, block, xo, (b, obo, y), oi, (xi, obi), cc), (oh, ow)


def register_tile(sch, block, xo, parallel: tuple, vector, unrolled: tuple, reduction):
    """Both kernels' register tile: the accumulators of each xo step in a stack buffer LLVM keeps in
    registers, channels-last (a pixel's 16 channels one vector), written out NCHW a row of pixels
    per channel; `parallel` loops over the cores. Returns the scheduled PrimFunc."""
    # "global": LowerTVMBuiltin keeps only global-scope allocations under 1 KiB on the stack, where
    # LLVM promotes the tile to registers ("local" ones go to TVMBackendAllocWorkspace).
    acc = sch.cache_write(block, 0, "global")
    sch.transform_layout(block, ("write", 0), lambda b, c, y, x: (b, y, x, c))
    sch.reverse_compute_at(acc, xo)
    sch.parallel(sch.fuse(*parallel))
    sch.vectorize(vector)
    for loop in unrolled:
        sch.unroll(loop)
    sch.decompose_reduction(block, reduction)
    # the write-back unrolled too: a loop over the tile would keep it in memory
    *_, w_channels, w_rows = sch.get_loops(acc)
    sch.unroll(w_rows)
    sch.unroll(w_channels)
    return fusable(sch.mod["main"])


def plain_conv(call, dtype: str, out_dtypes: tuple) -> list[int] | None:
    """The data shape of a conv2d call of static NCHW/OIHW shapes with `dtype` data and constant
    weights; None for any other call."""
    import tvm

    if not isinstance(call.op, tvm.ir.Op) or call.op.name != CONV:
        return None
    data, weight = call.args
    attrs = call.attrs
    shape = static_shape(data)
    if (isinstance(weight, tvm.ir.GenericConst) and shape is not None and len(shape) == 4
            and getattr(data.ty, "dtype", None) == dtype and getattr(weight.ty, "dtype", None) == dtype
            and str(attrs.out_dtype) in out_dtypes and attrs.data_layout == "NCHW"
            and attrs.kernel_layout == "OIHW" and attrs.out_layout == "NCHW"):
        return shape
    return None


def padded(builder, data, attrs):
    """data zero-padded as the conv's attrs say, and the rows and columns added."""
    from tvm import relax

    top, left, bottom, right = (int(p) for p in attrs.padding)
    if top or left or bottom or right:
        data = builder.emit(relax.op.nn.pad(data, [0, 0, 0, 0, top, bottom, left, right], pad_value=0.0))
    return data, (top + bottom, left + right)


def lower_fp32(builder, call, index, cpu, name):
    """A float32 conv2d of groups 1 with constant weights on the register-tiled kernel of `cpu.tile`."""
    from tvm import relax

    shape = plain_conv(call, "float32", FLOAT_OUT)
    if shape is None or int(call.attrs.groups) != 1:
        return None
    tile = cpu.tile
    data, weight = call.args
    attrs = call.attrs
    w = weight.value.numpy()
    n, c, h, wd = shape
    o, _, kh, kw = w.shape
    packed = pack_weights(w)
    o16 = packed.shape[0]
    data, (ph, pw) = padded(builder, data, attrs)
    stride, dilation = tuple(int(v) for v in attrs.strides), tuple(int(v) for v in attrs.dilation)
    func, (oh, ow) = conv2d_kernel(n, c, h + ph, wd + pw, o16, kh, kw, stride, dilation, tile)
    func = func.with_attr(GEOMETRY, [*stride, *dilation])  # for the layout handover, where a depthwise kernel follows
    kernel = builder.add_func(func.without_attr("global_symbol"), f"{name}{index}")
    out = relax.call_tir(kernel, [data, relax.const(packed)], relax.TensorType((n, o16 * LANES, oh, ow), "float32"))
    if o16 * LANES != o:
        return relax.op.strided_slice(builder.emit(out), axes=[1], begin=[0], end=[o])
    return out
