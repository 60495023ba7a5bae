"""float32 1x1 convolutions with 16 pixels per vector on AVX-512: a write-back of whole vectors into NCHW.

The channel-vector kernels (simd_conv.py, x86_vnni.py) put 16 output channels in a vector, so their tile is
written out to NCHW channel by channel, one scalar store per output. Where the reduction is short,
those stores cost more than the products: MobileNetV2's 1x1 convolutions have 16-32 input channels
in front of 96-192 outputs (its largest int8 kernel, 16 -> 96 at 112x112, ran at 25 G multiply-adds
per second). A 1x1 convolution of stride 1 is a matrix product over the pixels, so these kernels
put 16 neighbouring pixels in a vector instead:

    data    float32 [N, C, H, W]  (NCHW as it is)
    weights float32 [O/OT, C, OT] packed once (a constant)
    output  float32 [N, O, H, W]  NCHW, a vector of 16 pixels per store

(x86_vnni.py has the int8 twin, with 4 channels a pixel for `vpdpbusd`, and uses `tile` here)
with a register tile of OT output channels x PT vectors of 16 pixels: per input channel (float32:
one FMA with the weight broadcast from memory) or group of 4 (AVX-512 VNNI: one `vpdpbusd` of 16
pixels x 4 channels of data with 4 broadcast weights), OT x PT accumulators. The elementwise ops
after the kernel join its write-back as for the other kernels (passes/epilogue_fusion.py), here
vectorised over the pixels, a per-channel constant broadcast. Measured one by one on MobileNetV2's
shapes at 28x28-112x112 (2-core Xeon, AVX-512 VNNI, no epilogue): float32 0.59-0.75x the time of
the channel-vector kernel, int8 0.42-0.64x; the whole int8 model x0.83, float32 x0.985 (alternated
A/B, same session).

Only where the pixels make whole vectors of the tile (H x W a multiple of 16 x PT); 14x14 and 7x7
layers keep the channel-vector kernels, whose long reductions hide the scalar stores. Built for
AVX-512 CPUs (sized for its 32 zmm registers, measured there); AVX2 and NEON builds keep the
channel-vector kernels.
"""

from __future__ import annotations

import numpy as np

from appliance.deploy.compiler.kernels.common import LANES, fusable, shape64
from appliance.deploy.compiler.kernels.simd_conv import FLOAT_OUT, plain_conv

MOST = 14  # accumulators (zmm) per tile: 14 x 64 B stays under the 1 KiB stack buffer LLVM keeps in registers
PT_ORDER = (2, 1, 4, 3, 7)  # vectors of pixels per tile, best first (measured on MobileNetV2's shapes: 6x2 > 12x1 > 3x4 > 2x7)


def tile(o: int, pixels: int, most: int = MOST) -> tuple[int, int] | None:
    """(OT output channels, PT vectors of 16 pixels) of a register tile of at most `most`
    accumulators that divides o and the pixels evenly: the first of PT_ORDER with 8 or more
    accumulators, else the largest; None where the pixels are not whole vectors or no tile of 6
    accumulators fits (the channel-vector kernels do better there)."""
    if pixels % LANES:
        return None
    vectors, best = pixels // LANES, None
    for pt in PT_ORDER:
        if vectors % pt or pt > most:
            continue
        ot = next(k for k in range(most // pt, 0, -1) if o % k == 0)
        if ot * pt >= 8:
            return ot, pt
        if best is None or ot * pt > best[0] * best[1]:
            best = (ot, pt)
    return best if best and best[0] * best[1] >= 6 else None


def _steps(n: int, o: int, pixels: int, ot: int, pt: int) -> tuple[int, int]:
    """(parallel tasks, tiles per task): a task runs up to 8 tiles of the same output channels."""
    tiles = pixels // (LANES * pt)
    inner = next(k for k in (8, 7, 6, 5, 4, 3, 2, 1) if tiles % k == 0)
    return n * (o // ot) * (tiles // inner), inner


def pack_fp32(w: np.ndarray, ot: int) -> np.ndarray:
    """OIHW float32 (1x1) -> [O/OT, C, OT]: a tile's OT weights of one input channel side by side."""
    o, c = w.shape[:2]
    return np.ascontiguousarray(w.reshape(o // ot, ot, c).transpose(0, 2, 1))


def fp32_kernel(n: int, c: int, h: int, w: int, o: int, ot: int, pt: int):
    """The scheduled PrimFunc conv(data [n, c, h, w], weights [o/ot, c, ot]) -> [n, o, h, w], float32."""
    from tvm.script import tirx as T

    p, v = h * w, pt * LANES
    tasks, inner = _steps(n, o, p, ot, pt)
    groups, chunks = o // ot, p // (v * inner)

    @T.prim_func(s_tir=True)
    def conv(X: T.Buffer((n, c, h, w), "float32"), Wp: T.Buffer((groups, c, ot), "float32"),
             Y: T.Buffer(shape64(n, o, h, w), "float32")):
        T.func_attr({"tir.noalias": True})
        acc = T.sblock_alloc_buffer((n, o, p), "float32")  # compacted to the tile: OT x PT vectors
        for f0 in T.parallel(tasks):
            for f1 in range(inner):
                for oi, pv, lane in T.grid(ot, pt, LANES):
                    with T.sblock("conv_pixels_init"):
                        vb = T.axis.spatial(n, f0 // (groups * chunks))
                        vo = T.axis.spatial(o, f0 // chunks % groups * ot + oi)
                        vp = T.axis.spatial(p, (f0 % chunks * inner + f1) * v + pv * LANES + lane)
                        acc[vb, vo, vp] = T.float32(0)
                for cc in range(c):
                    for oi in T.unroll(ot):
                        for pv in T.unroll(pt):
                            for lane in T.vectorized(LANES):
                                with T.sblock("conv_pixels_update"):
                                    vb = T.axis.spatial(n, f0 // (groups * chunks))
                                    vo = T.axis.spatial(o, f0 // chunks % groups * ot + oi)
                                    vp = T.axis.spatial(p, (f0 % chunks * inner + f1) * v + pv * LANES + lane)
                                    vc = T.axis.reduce(c, cc)
                                    acc[vb, vo, vp] = acc[vb, vo, vp] + X[vb, vc, vp // w, vp % w] * Wp[vo // ot, vc, vo % ot]
                for oi in T.unroll(ot):
                    for pv in T.unroll(pt):
                        for lane in T.vectorized(LANES):
                            with T.sblock("Y_global"):  # common.WRITE_BACK: the epilogue goes here
                                vb = T.axis.spatial(n, f0 // (groups * chunks))
                                vo = T.axis.spatial(o, f0 // chunks % groups * ot + oi)
                                vp = T.axis.spatial(p, (f0 % chunks * inner + f1) * v + pv * LANES + lane)
                                Y[vb, vo, vp // w, vp % w] = acc[vb, vo, vp]
    return fusable(conv)


def pixel_tile(attrs, weight_shape, pixels: int, unit: str) -> tuple[int, int] | None:
    """The register tile (`tile`) for a conv2d of these attrs and OIHW weights where it has one: a
    1x1 convolution of stride 1, no padding, groups 1, on an AVX-512 CPU (`unit`, the CPU
    description's vector unit); else None."""
    o, _, kh, kw = weight_shape
    if (unit != "avx512" or (kh, kw) != (1, 1) or any(int(v) != 1 for v in attrs.strides)
            or any(int(v) for v in attrs.padding) or int(attrs.groups) != 1):
        return None
    return tile(o, pixels)


def lower_fp32(builder, call, index, cpu, name):
    """A float32 1x1 conv2d (stride 1, no padding, groups 1) with constant weights on the kernel here."""
    from tvm import relax

    shape = plain_conv(call, "float32", FLOAT_OUT)
    if shape is None:
        return None
    data, weight = call.args
    w = weight.value.numpy()
    n, c, h, wd = shape
    o = w.shape[0]
    pixels = pixel_tile(call.attrs, w.shape, h * wd, cpu.vector)
    if pixels is None:
        return None
    func = fp32_kernel(n, c, h, wd, o, *pixels)
    kernel = builder.add_func(func.without_attr("global_symbol"), f"{name}{index}")
    return relax.call_tir(kernel, [data, relax.const(pack_fp32(w, pixels[0]))], relax.TensorType((n, o, h, wd), "float32"))
