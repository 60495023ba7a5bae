"""1x1 convolutions with 16 pixels per vector: a write-back of whole vectors into NCHW.

The kernels of cpu_conv.py and x86_int8.py put 16 output channels in a vector, so their tile is
written out to NCHW channel by channel, one scalar store per output. Where the reduction is short,
those stores cost more than the products: MobileNetV2's 1x1 convolutions have 16-32 input channels
in front of 96-192 outputs (its largest int8 kernel, 16 -> 96 at 112x112, ran at 25 G multiply-adds
per second). A 1x1 convolution of stride 1 is a matrix product over the pixels, so these kernels
put 16 neighbouring pixels in a vector instead:

    data    float32 [N, C, H, W]  (NCHW as it is)  or  uint8 [N, C/4, H, W, 4]  (VNNI: 4 channels a pixel)
    weights float32 [O/OT, C, OT]                  or  int8  [O/OT, C/4, OT, 4]  packed once (a constant)
    output  float32 / int32 [N, O, H, W]           NCHW, a vector of 16 pixels per store

with a register tile of OT output channels x PT vectors of 16 pixels: per input channel (float32:
one FMA with the weight broadcast from memory) or group of 4 (AVX-512 VNNI: one `vpdpbusd` of 16
pixels x 4 channels of data with 4 broadcast weights), OT x PT accumulators. The elementwise ops
after the kernel join its write-back as for the other kernels (cpu_conv.fuse_epilogues), here
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

from appliance.deploy.compiler.kernels.common import fusable, shape64

LANES = 16  # pixels per vector
BLOCKS = "conv_pixels"  # the init and update blocks' names: fuse_epilogues keeps their write-back vectorised
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


def pack_int8(wq: np.ndarray, ot: int) -> np.ndarray:
    """OIHW int8 (1x1) -> [O/OT, C/4, OT, 4], input channels padded with zeros to whole groups of 4."""
    o, c = wq.shape[:2]
    c4 = -(-c // 4)
    padded = np.zeros((o, c4 * 4), np.int8)
    padded[:, :c] = wq.reshape(o, c)
    return np.ascontiguousarray(padded.reshape(o // ot, ot, c4, 4).transpose(0, 2, 1, 3))


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
                            with T.sblock("Y_global"):  # cpu_conv.WRITE_BACK: the epilogue goes here
                                vb = T.axis.spatial(n, f0 // (groups * chunks))
                                vo = T.axis.spatial(o, f0 // chunks % groups * ot + oi)
                                vp = T.axis.spatial(p, (f0 % chunks * inner + f1) * v + pv * LANES + lane)
                                Y[vb, vo, vp // w, vp % w] = acc[vb, vo, vp]
    return fusable(conv)


def vnni_kernel(n: int, c4: int, h: int, w: int, o: int, ot: int, pt: int):
    """The scheduled PrimFunc conv(data [n, c4, h, w, 4] u8, weights [o/ot, c4, ot, 4] s8) ->
    [n, o, h, w] s32, with AVX-512 VNNI: each `vpdpbusd` adds 16 pixels x 4 channels of products."""
    from tvm.script import tirx as T

    p, v = h * w, pt * LANES
    tasks, inner = _steps(n, o, p, ot, pt)
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
                            with T.sblock("Y_global"):  # cpu_conv.WRITE_BACK: the epilogue goes here
                                vb = T.axis.spatial(n, f0 // (groups * chunks))
                                vo = T.axis.spatial(o, f0 // chunks % groups * ot + oi)
                                vp = T.axis.spatial(p, (f0 % chunks * inner + f1) * v + pv * LANES + lane)
                                Y[vb, vo, vp // w, vp % w] = acc[vb, vo, vp]
    return fusable(conv)
