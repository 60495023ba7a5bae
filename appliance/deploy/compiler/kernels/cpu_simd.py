"""float32 convolutions on hand-scheduled TIR kernels for CPUs: register tiles, no search needed.

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
(`fuse_epilogues`).

Two TVM 0.27 details decide the speed (measured, 64x56x56 3x3, 2 cores): the accumulator tile is
allocated in "global" scope, because LowerTVMBuiltin puts only global allocations under 1 KiB on the
stack and sends "local" ones to TVMBackendAllocWorkspace, where LLVM cannot keep them in registers
(48 vs 163 GFLOPS); and it must stay under that 1 KiB (rows x blocks x 16 x 4 bytes).
"""

from __future__ import annotations

import numpy as np

from appliance.deploy.compiler.kernels.common import OPAQUE, fusable, shape64

LANES = 16  # output channels per vector
EXACT_FLOAT_TAPS = 1024  # int8 x int8 sums of up to this many taps are integers below 2^24: exact in float32
STACK_BYTES = 1024  # tvm::runtime::kMaxStackAlloca: larger tiles leave the stack, and the registers
CONV = "relax.nn.conv2d"
FLOAT_OUT = ("None", "", "void", "float32")  # conv2d's out_dtype of a float32 layer
KERNEL_BLOCK = "conv"  # every kernel's compute block: conv, conv_init, conv_update_o
WRITE_BACK = "Y_global"  # the block that cache_write of the kernel's output Y makes: the tile written out
GEOMETRY = "appliance.stride_dilation"  # a channel-vector kernel's (sh, sw, dh, dw), for cpu_handoff


def tile_for(tvm_target: dict) -> tuple[str, int, int] | None:
    """(vector unit, blocks of 16 output channels, most output pixels) per register tile for this
    build's CPU, or None when it has no vector unit these kernels are sized for."""
    import tvm
    from tvm.target import codegen

    if tvm_target.get("kind") != "llvm":
        return None
    triple = str(tvm_target.get("mtriple", ""))
    if triple.startswith("aarch64"):
        return "neon", 1, 6  # 32 q registers: 24 accumulators, 4 for the weights, 1 broadcast
    if not triple.startswith("x86_64") or not tvm_target.get("mcpu"):
        return None
    target = tvm.target.Target(tvm_target)
    if codegen.target_has_features("avx512f", target):
        return "avx512", 2, 7  # 32 zmm: 14 accumulators, 2 weights; each broadcast feeds 2 FMAs
    if codegen.target_has_features("avx2", target) and codegen.target_has_features("fma", target):
        return "avx2", 1, 6  # 16 ymm: 12 accumulators, 2 for the weights, 1 broadcast
    return None


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
    kernel after it, cpu_handoff.py)."""
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
            with T.sblock("conv_blocked"):  # fuse_epilogues: its write-back is vectorised already
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
        acc = sch.cache_write(block, 0, "global")  # see _scheduled: the tile on the stack, in registers
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
    return _scheduled(sch, block, xo, (b, obo, y), oi, (xi, obi), cc), (oh, ow)


def _scheduled(sch, block, xo, parallel: tuple, vector, unrolled: tuple, reduction):
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


def fuse_epilogues(mod):
    """mod legalized and fused by TVM (relax's "zero" pipeline), with the elementwise ops that FuseOps
    put after a kernel of ours (bias, activation, requantize, a residual add, the next layer's
    uint8 shift) computed in the kernel's write-back, on the tile still in registers, a vector of
    16 channels at a time. Each of them was a pass of its own over the whole tensor, on one core
    (ResNet-18 int8: 9.6 of 20.3 ms). Returns (mod, kernels, how many got their epilogue)."""
    from tvm import relax, s_tir, tirx

    mod = relax.get_pipeline("zero")(mod)
    kernels = fused = 0
    for gvar, func in list(mod.functions_items()):
        if not isinstance(func, tirx.PrimFunc):
            continue
        sch = s_tir.Schedule(func)
        order = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
        if WRITE_BACK not in order:
            continue
        kernels += 1
        scheduled = func.attrs is not None and bool(func.attrs.get("tirx.is_scheduled", False))
        if not scheduled:  # a kernel with the functions FuseOps joined to it
            inlined = _inline_epilogue(func, order)
            if inlined is not None:
                func, fused = inlined[0], fused + inlined[1]
            func = func.with_attr("tirx.is_scheduled", True)  # else as FuseTIR made it: correct, slower
        # opaque from now on: a second FuseOps (the tuning pipeline's) joins nothing more to it
        mod[gvar] = func.with_attr("op_pattern", OPAQUE)
    return mod, kernels, fused


def depthwise_kernel(n: int, c16: int, h: int, w: int, kh: int, kw: int, stride: tuple, dilation: tuple,
                     tile: tuple[str, int, int], dtype: str = "float32", acc_dtype: str | None = None):
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
    return _scheduled(sch, block, xo, (b, cb, y), ci, (s, xi) if kw <= 7 else (xi,), r), (oh, ow)


def _inline_epilogue(func, order: list):
    """func (a kernel and the elementwise functions FuseOps joined to it) with them computed in the
    kernel's write-back, vectorised over the tile's 16 channels where the channels need no bounds
    check: (func, all of them inlined?). Where TVM refuses a block, the ones before it are inlined
    and it and the rest stay loops of their own (correct, slower); None where none could be, or
    TVM failed (the function then stays as FuseTIR made it)."""
    import tvm
    from tvm import s_tir

    from appliance.deploy.compiler.kernels.x86_avx512 import BLOCKS as PIXEL_BLOCKS

    k = order.index(WRITE_BACK)
    before = [name for name in order[:k] if not name.startswith(KERNEL_BLOCK)]
    after = order[k + 1:]
    # a kernel with pixels as its vector lanes (cpu_pixels.py), or with a blocked output
    # (x86_int8's conv_blocked), has its write-back vectorised already
    count, vectorised = _chain(func, order[k:]), not any(name.startswith((PIXEL_BLOCKS, "conv_blocked"))
                                                         for name in order[:k])
    while True:
        sch, done = s_tir.Schedule(func), 0
        try:
            for name in before:  # the other inputs' elementwise work (a residual's dequantize)
                sch.compute_inline(sch.get_sblock(name))
            for name in after[:count]:  # in order: each block into the write-back it now follows
                sch.reverse_compute_inline(sch.get_sblock(name))
                done += 1
            if vectorised:  # a pixel's 16 channels: one vector load of the tile, one vector epilogue
                *_, channels, rows = sch.get_loops(sch.get_sblock(WRITE_BACK))
                sch.reorder(rows, channels)
                sch.vectorize(channels)
                sch.unroll(rows)
            return (sch.mod["main"], count == len(after)) if count else None
        except tvm.error.InternalError:  # TVM 0.27's reverse_compute_inline fails inside on some
            return None  # MobileNetV3 and EfficientNet epilogues, and may leave the IR half-changed
        except s_tir.schedule.ScheduleError:  # refused, nothing changed: e.g. 24 channels of 32
            if done < count:
                count = done
            elif vectorised:
                vectorised = False
            else:
                return None


def _chain(func, blocks: list) -> int:
    """How many of blocks[1:] form a chain from the write-back blocks[0]: each the only reader of
    the one before's output. reverse_compute_inline of a block whose input has other readers
    (x * sigmoid(x), SiLU) drops that input's producer: TVM 0.27 does not refuse it."""
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    found = [sch.get(sch.get_sblock(name)) for name in blocks]
    reads = [{region.source.name for region in block.reads} for block in found]
    current = found[0].writes[0].source.name
    for j in range(1, len(found)):
        if [i for i in range(j, len(found)) if current in reads[i]] != [j]:
            return j - 1
        current = found[j].writes[0].source.name
    return len(found) - 1


def static_shape(expr) -> list[int] | None:
    shape = getattr(expr.ty, "shape", None)
    if shape is None:
        return None
    try:
        return [int(v) for v in shape]
    except (TypeError, ValueError):
        return None


def rewrite_calls(mod, replace):
    """mod with every call that `replace(builder, call, index)` returns an expression for replaced by
    it (None: kept); returns (mod, how many were replaced)."""
    from tvm import relax

    @relax.expr_functor.mutator
    class Rewriter(relax.PyExprMutator):
        def __init__(self, module):
            super().__init__(module)
            self.module, self.count = module, 0

        def run(self):
            for gvar, func in self.module.functions_items():
                if isinstance(func, relax.Function):
                    self.builder_.update_func(gvar, self.visit_expr(func))
            return self.builder_.get()

        def visit_call_(self, call):
            call = self.visit_expr_post_order(call)
            replaced = replace(self.builder_, call, self.count)
            if replaced is None:
                return call
            self.count += 1
            return replaced

    rewriter = Rewriter(mod)
    out = rewriter.run()
    return out, rewriter.count


def use_fp32_kernels(mod, tile: tuple[str, int, int]):
    """mod with every float32 conv2d of groups 1 or depthwise, with constant weights, computed by a
    kernel of this module tiled for `tile_for`'s CPU; returns (mod, how many)."""
    return rewrite_calls(mod, lambda builder, call, index: _fp32_conv(builder, call, index, tile))


def use_depthwise_int8_kernels(mod, tile: tuple[str, int, int]):
    """mod with every depthwise int8 x int8 -> int32 conv2d (what int8_rewrite makes) computed by a
    kernel of this module; returns (mod, how many)."""
    return rewrite_calls(mod, lambda builder, call, index: _depthwise(builder, call, index, tile, "int8"))


def _plain_conv(call, dtype: str, out_dtypes: tuple) -> list[int] | None:
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


def _padded(builder, data, attrs):
    """data zero-padded as the conv's attrs say, and the rows and columns added."""
    from tvm import relax

    top, left, bottom, right = (int(p) for p in attrs.padding)
    if top or left or bottom or right:
        data = builder.emit(relax.op.nn.pad(data, [0, 0, 0, 0, top, bottom, left, right], pad_value=0.0))
    return data, (top + bottom, left + right)


def _depthwise(builder, call, index, tile, dtype):
    """conv2d with groups == channels, one filter per channel: blocked 16 channels per pixel."""
    from tvm import relax

    shape = _plain_conv(call, dtype, ("int32",) if dtype == "int8" else FLOAT_OUT)
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
    data, (ph, pw) = _padded(builder, data, attrs)
    if c16 * LANES != c:  # zero channels meet zero filters
        data = builder.emit(relax.op.nn.pad(data, [0, 0, 0, c16 * LANES - c, 0, 0, 0, 0], pad_value=0.0))
    func, (oh, ow) = depthwise_kernel(n, c16, h + ph, wd + pw, kh, kw, tuple(int(v) for v in attrs.strides),
                                      tuple(int(v) for v in attrs.dilation), tile, dtype, acc_dtype)
    kernel = builder.add_func(func.without_attr("global_symbol"), f"depthwise_{dtype}_{index}")
    emit = builder.emit
    blocked = emit(relax.op.permute_dims(relax.op.reshape(data, (n, c16, LANES, h + ph, wd + pw)), [0, 1, 3, 4, 2]))
    sums = acc_dtype or ("int32" if dtype == "int8" else dtype)
    out = relax.call_tir(kernel, [blocked, relax.const(packed)], relax.TensorType((n, c16 * LANES, oh, ow), sums))
    if c16 * LANES != c:
        out = relax.op.strided_slice(emit(out), axes=[1], begin=[0], end=[c])
    if acc_dtype:  # whole numbers: back to the int32 sums the epilogue expects, in the write-back
        out = relax.op.astype(emit(out), "int32")
    return out  # not bound here: a binding of its own (a var alias) would keep FuseOps from the ops after it


def _fp32_conv(builder, call, index, tile):
    from tvm import relax

    shape = _plain_conv(call, "float32", FLOAT_OUT)
    if shape is None:
        return None
    if int(call.attrs.groups) != 1:
        return _depthwise(builder, call, index, tile, "float32")
    data, weight = call.args
    attrs = call.attrs
    w = weight.value.numpy()
    n, c, h, wd = shape
    o, _, kh, kw = w.shape
    pixels = pixel_tile(attrs, w.shape, h * wd, tile[0])
    if pixels is not None:
        from appliance.deploy.compiler.kernels import x86_avx512 as cpu_pixels

        func = cpu_pixels.fp32_kernel(n, c, h, wd, o, *pixels)
        kernel = builder.add_func(func.without_attr("global_symbol"), f"fp32_conv2d_pixels_{index}")
        return relax.call_tir(kernel, [data, relax.const(cpu_pixels.pack_fp32(w, pixels[0]))],
                              relax.TensorType((n, o, h, wd), "float32"))
    packed = pack_weights(w)
    o16 = packed.shape[0]
    data, (ph, pw) = _padded(builder, data, attrs)
    stride, dilation = tuple(int(v) for v in attrs.strides), tuple(int(v) for v in attrs.dilation)
    func, (oh, ow) = conv2d_kernel(n, c, h + ph, wd + pw, o16, kh, kw, stride, dilation, tile)
    func = func.with_attr(GEOMETRY, [*stride, *dilation])  # for cpu_handoff, where a depthwise kernel follows
    kernel = builder.add_func(func.without_attr("global_symbol"), f"fp32_conv2d_{index}")
    out = relax.call_tir(kernel, [data, relax.const(packed)], relax.TensorType((n, o16 * LANES, oh, ow), "float32"))
    if o16 * LANES != o:
        return relax.op.strided_slice(builder.emit(out), axes=[1], begin=[0], end=[o])
    return out


def pixel_tile(attrs, weight_shape, pixels: int, unit: str) -> tuple[int, int] | None:
    """cpu_pixels' register tile for a conv2d of these attrs and OIHW weights where it has one: a
    1x1 convolution of stride 1, no padding, groups 1, on an AVX-512 CPU (`unit`, as tile_for
    names it); else None."""
    from appliance.deploy.compiler.kernels import x86_avx512 as cpu_pixels

    o, _, kh, kw = weight_shape
    if (unit != "avx512" or (kh, kw) != (1, 1) or any(int(v) != 1 for v in attrs.strides)
            or any(int(v) for v in attrs.padding) or int(attrs.groups) != 1):
        return None
    return cpu_pixels.tile(o, pixels)
