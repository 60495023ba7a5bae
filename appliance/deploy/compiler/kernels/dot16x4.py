"""The 16 x 4 int8 dot-product convolution that VNNI (x86_vnni.py), sdot (arm_dotprod.py) and the
ARMv8.0 NEON kernel (arm_neon.py, its weights) share: one weight layout and one schedule, each
instruction set bringing its 16x4 TensorIntrin and its register tile's pixels by preference.

    data    [N, C/4, H, W, 4]          4 input channels of one pixel: one 32-bit broadcast
    weights int8 [O/16, C/4, KH, KW, 16, 4]  packed once at compile time (a constant)
    output  int32 [N, O, OH, OW] (NCHW) or [N, O/16, OH, OW, 16] (blocked_out)

The schedule's reasoning (register tile, the write-back channel by channel) is in x86_vnni.py's
docstring, where it was measured first.
"""

from __future__ import annotations

import numpy as np

from appliance.deploy.compiler.kernels.common import LANES, fusable, shape64

GROUP = 4  # input channels per product group: 4 bytes of a 32-bit lane


def pack_weights(wq: np.ndarray) -> np.ndarray:
    """OIHW int8 -> [O/16, C/4, KH, KW, 16, 4], channels padded with zeros to whole groups."""
    o, c, kh, kw = wq.shape
    op, cp = -(-o // LANES) * LANES, -(-c // GROUP) * GROUP
    padded = np.zeros((op, cp, kh, kw), np.int8)
    padded[:o, :c] = wq
    return np.ascontiguousarray(
        padded.reshape(op // LANES, LANES, cp // GROUP, GROUP, kh, kw).transpose(0, 2, 4, 5, 1, 3))


def tile_rows(ow: int, choices: tuple) -> int:
    """The first of choices (pixels a register tile, by preference) that divides the output width."""
    return next(r for r in choices if ow % r == 0)


def conv2d_kernel(n: int, c4: int, h: int, w: int, o16: int, kh: int, kw: int, stride: tuple, dilation: tuple,
                  blocked_out: bool, dtype: str, intrin: str, rows: tuple):
    """The scheduled PrimFunc conv(data [n, c4, h, w, 4] u8, weights [o16, c4, kh, kw, 16, 4] s8) ->
    [n, o16 * 16, oh, ow] s32, for data already padded; blocked_out: -> [n, o16, oh, ow, 16], a
    pixel's 16 sums one vector store (for a depthwise kernel after it, passes/layout_handover.py).
    `dtype` of the data (uint8 for VNNI, int8 for sdot), `intrin` the registered TensorIntrin of its
    16x4 product, `rows` the tile's pixels by preference (the first that divides the output width)."""
    from tvm import s_tir
    from tvm.script import tirx as T

    sh, sw = stride
    dh, dw = dilation
    oh, ow = (h - dh * (kh - 1) - 1) // sh + 1, (w - dw * (kw - 1) - 1) // sw + 1
    if blocked_out:
        return _blocked_kernel(n, c4, h, w, o16, kh, kw, stride, dilation, (oh, ow), dtype, intrin,
                               tile_rows(ow, rows)), (oh, ow)

    @T.prim_func(s_tir=True)
    def conv(X: T.Buffer((n, c4, h, w, 4), dtype), Wp: T.Buffer((o16, c4, kh, kw, 16, 4), "int8"),
             Y: T.Buffer(shape64(n, o16 * 16, oh, ow), "int32")):
        T.func_attr({"tir.noalias": True})
        for b, ob, y, x, oi, cb, r, s, ci in T.grid(n, o16, oh, ow, 16, c4, kh, kw, 4):
            with T.sblock("conv"):
                vb, vob, vy, vx, voi, vcb, vr, vs, vci = T.axis.remap("SSSSSRRRR", [b, ob, y, x, oi, cb, r, s, ci])
                with T.init():
                    Y[vb, vob * 16 + voi, vy, vx] = 0
                Y[vb, vob * 16 + voi, vy, vx] = Y[vb, vob * 16 + voi, vy, vx] + T.cast(
                    X[vb, vcb, vy * sh + vr * dh, vx * sw + vs * dw, vci], "int32") * T.cast(
                    Wp[vob, vcb, vr, vs, voi, vci], "int32")

    sch = s_tir.Schedule(conv)
    block = sch.get_sblock("conv")
    b, ob, y, x, oi, cb, r, s, ci = sch.get_loops(block)
    xo, xi = sch.split(x, [None, tile_rows(ow, rows)])
    sch.reorder(b, ob, y, xo, cb, r, s, xi, oi, ci)
    tile = sch.cache_write(block, 0, "global")  # the intrinsic's accumulator is a global-scope buffer
    # the tile channels-last (a pixel's 16 sums: the intrinsic's vector), written out NCHW
    sch.transform_layout(block, ("write", 0), lambda b, c, y, x: (b, y, x, c))
    sch.reverse_compute_at(tile, xo)
    sch.parallel(sch.fuse(b, ob, y))
    init = sch.decompose_reduction(block, cb)
    sch.tensorize(oi, intrin)
    sch.unroll(xi)
    *_, w_channels, w_rows = sch.get_loops(tile)
    sch.unroll(w_rows)
    sch.unroll(w_channels)
    sch.vectorize(sch.get_loops(init)[-1])
    return fusable(sch.mod["main"]), (oh, ow)


def _blocked_kernel(n, c4, h, w, o16, kh, kw, stride, dilation, out, dtype, intrin, rows):
    from tvm import s_tir
    from tvm.script import tirx as T

    (sh, sw), (dh, dw), (oh, ow) = stride, dilation, out

    @T.prim_func(s_tir=True)
    def conv(X: T.Buffer((n, c4, h, w, 4), dtype), Wp: T.Buffer((o16, c4, kh, kw, 16, 4), "int8"),
             Y: T.Buffer(shape64(n, o16, oh, ow, 16), "int32")):
        T.func_attr({"tir.noalias": True})
        for b, ob, y, x, oi, cb, r, s, ci in T.grid(n, o16, oh, ow, 16, c4, kh, kw, 4):
            with T.sblock("conv_blocked"):  # common.BLOCKED_BLOCKS: its write-back is vectorised already
                vb, vob, vy, vx, voi, vcb, vr, vs, vci = T.axis.remap("SSSSSRRRR", [b, ob, y, x, oi, cb, r, s, ci])
                with T.init():
                    Y[vb, vob, vy, vx, voi] = 0
                Y[vb, vob, vy, vx, voi] = Y[vb, vob, vy, vx, voi] + T.cast(
                    X[vb, vcb, vy * sh + vr * dh, vx * sw + vs * dw, vci], "int32") * T.cast(
                    Wp[vob, vcb, vr, vs, voi, vci], "int32")

    sch = s_tir.Schedule(conv)
    block = sch.get_sblock("conv_blocked")
    b, ob, y, x, oi, cb, r, s, ci = sch.get_loops(block)
    xo, xi = sch.split(x, [None, rows])
    sch.reorder(b, ob, y, xo, cb, r, s, xi, oi, ci)
    tile = sch.cache_write(block, 0, "global")
    sch.reverse_compute_at(tile, xo)
    sch.parallel(sch.fuse(b, ob, y))
    init = sch.decompose_reduction(block, cb)
    sch.tensorize(oi, intrin)
    sch.unroll(xi)
    *_, w_rows, w_channels = sch.get_loops(tile)
    sch.unroll(w_rows)
    sch.vectorize(w_channels)
    sch.vectorize(sch.get_loops(init)[-1])
    return fusable(sch.mod["main"])
