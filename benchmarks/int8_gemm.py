"""The int8 GEMM core of a convolution: a hand-scheduled TVM kernel with AVX-512 VNNI next to
onnxruntime's MatMulInteger, side by side in one process run (issue 13; `appliance compile`
uses the same intrinsic and tiling for its convolutions, appliance/deploy/compiler/kernels/x86_vnni.py).

    PYTHONPATH=. .venv/bin/python benchmarks/int8_gemm.py [--rounds 15] [--json FILE]

Each shape is a convolution as a GEMM, C[M, N] (int32) = A[M, K] (uint8 activations, M = output
pixels, K = input channels x kernel taps) x B[K, N] (int8 weights, N = output channels): the 1x1
convolutions of mobilenet_v2 and the im2col GEMMs of resnet18's 3x3 convolutions at 224 px, batch 1.

TVM: one TIR function per shape, scheduled by hand (no search): R rows x 2 blocks of 16 output
channels per register tile, the reduction in steps of 4 tensorized with `vpdpbusd` (one
instruction: 16 int32 lanes += 4 u8 x s8 products each), weights packed once, as a compile would
pack a constant, to [N/16, K/4, 16, 4], the output tiles parallel over the cores. onnxruntime:
a one-node MatMulInteger graph with the weights as an initializer (it packs them at session
start), all graph optimisations, as many threads as TVM. Both results are checked equal (exact
integers) before timing. Rounds alternate TVM and onnxruntime; the ratio is the median over
rounds of TVM / onnxruntime in the same round.

Two things in TVM 0.27 that this works around (both found here; see benchmarks/README.md):
- its registered `dot_16x4_vnni` intrinsic fails LLVM verification: the LLVM it ships declares
  `llvm.x86.avx512.vpdpbusd.512` with <64 x i8> operands, the intrinsic passes <16 x i32>;
- in TVMScript an assignment inside a prim_func becomes a local buffer, not a value: written
  with temporaries, every vpdpbusd's operands and accumulator went through the stack (about
  5x slower); x86_int8.register_intrinsic writes it as one expression.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from deploy import interleaved_rounds, summarise  # noqa: E402

# (name, M, K, N): conv output pixels, input channels x taps, output channels
SHAPES = [
    ("mobilenet_v2 1x1 56px 24->144", 56 * 56, 24, 144),
    ("mobilenet_v2 1x1 28px 32->192", 28 * 28, 32, 192),
    ("mobilenet_v2 1x1 14px 384->64", 14 * 14, 384, 64),
    ("mobilenet_v2 1x1 7px 960->320", 7 * 7, 960, 320),
    ("resnet18 3x3 56px 64->64", 56 * 56, 64 * 9, 64),
    ("resnet18 3x3 28px 128->128", 28 * 28, 128 * 9, 128),
    ("resnet18 3x3 14px 256->256", 14 * 14, 256 * 9, 256),
    ("resnet18 3x3 7px 512->512", 7 * 7, 512 * 9, 512),
]


def vnni_gemm(M: int, K: int, N: int, target: dict, k_tile: int = 64):
    """The built TVM function gemm(A[M, K] u8, Bp[N/16, K/4, 16, 4] s8, C[M, N] s32)."""
    import tvm
    from tvm import s_tir
    from tvm.script import tirx as T

    from appliance.deploy.compiler.kernels.x86_vnni import register_intrinsic

    intrin = register_intrinsic()
    rows = next(r for r in (4, 7, 8, 2, 1) if M % r == 0)
    blocks = 2 if N % 32 == 0 else 1
    k_tile = next(t for t in (k_tile, 32, 16, 8, 4) if K % t == 0)

    @T.prim_func(s_tir=True)
    def gemm(A: T.Buffer((M, K), "uint8"), W: T.Buffer((N // 16, K // 4, 16, 4), "int8"),
             C: T.Buffer((M, N), "int32")):
        T.func_attr({"global_symbol": "gemm", "tir.noalias": True})
        for i, j, k in T.grid(M, N, K):
            with T.sblock("C"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    C[vi, vj] = 0
                C[vi, vj] = C[vi, vj] + T.cast(A[vi, vk], "int32") * T.cast(W[vj // 16, vk // 4, vj % 16, vk % 4], "int32")

    sch = s_tir.Schedule(gemm)
    block = sch.get_sblock("C")
    i, j, k = sch.get_loops(block)
    io, ii = sch.split(i, [None, rows])
    jo, jc, ji = sch.split(j, [None, blocks, 16])
    ko, kt, ki = sch.split(k, [None, k_tile // 4, 4])
    sch.reorder(io, jo, ko, kt, ii, jc, ji, ki)
    tile = sch.cache_write(block, 0, "global")  # the intrinsic's accumulator is a global-scope buffer
    sch.reverse_compute_at(tile, jo)
    sch.parallel(sch.fuse(io, jo))
    init = sch.decompose_reduction(block, ko)
    sch.tensorize(ji, intrin)
    sch.unroll(ii)
    sch.unroll(jc)
    _, lanes = sch.split(sch.get_loops(tile)[-1], [None, 16])
    sch.vectorize(lanes)
    _, lanes = sch.split(sch.get_loops(init)[-1], [None, 16])
    sch.vectorize(lanes)
    return tvm.tirx.build(sch.mod, target=tvm.target.Target(target))["gemm"], (rows, blocks, k_tile)


def ort_matmul_integer(b: np.ndarray, threads: int):
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    M_sym = "M"
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["A", "B"], ["C"])], "gemm",
        [helper.make_tensor_value_info("A", TensorProto.UINT8, [M_sym, b.shape[0]])],
        [helper.make_tensor_value_info("C", TensorProto.INT32, [M_sym, b.shape[1]])],
        initializer=[numpy_helper.from_array(b, "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Its threads would otherwise spin for a while after each run, on the cores TVM's next call needs.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20, help="calls per timing (each round times this many)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--mcpu", default="", help="LLVM CPU for TVM (default: this host's)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    import tvm

    host = tvm.target.Target.from_device("cpu") if hasattr(tvm.target.Target, "from_device") else None
    mcpu = args.mcpu or (str(host.attrs.get("mcpu", "")) if host is not None else "") or "native"
    target = {"kind": "llvm", "mcpu": mcpu, "num-cores": args.threads}
    if "avx512_vnni" not in Path("/proc/cpuinfo").read_text():
        print("int8_gemm: this CPU has no AVX-512 VNNI (vpdpbusd); nothing to measure")
        return 0
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))
    dev = tvm.cpu()
    rng = np.random.default_rng(0)
    rows_out, results = [], []
    print(f"int8_gemm: TVM {tvm.__version__} (llvm -mcpu={mcpu}) vs onnxruntime MatMulInteger, {args.threads} threads, "
          f"{args.rounds} rounds of {args.calls} calls", flush=True)
    for name, M, K, N in SHAPES:
        a = rng.integers(0, 256, (M, K), dtype=np.uint8)
        b = rng.integers(-128, 128, (K, N), dtype=np.int8)
        packed = b.T.reshape(N // 16, 16, K // 4, 4).transpose(0, 2, 1, 3).copy()
        t0 = time.perf_counter()
        fn, tiles = vnni_gemm(M, K, N, target)
        build_s = time.perf_counter() - t0
        ta, tb = tvm.runtime.tensor(a, dev), tvm.runtime.tensor(packed, dev)
        tc = tvm.runtime.tensor(np.zeros((M, N), np.int32), dev)
        session = ort_matmul_integer(b, args.threads)
        fn(ta, tb, tc)
        reference = session.run(None, {"A": a})[0]
        if not np.array_equal(tc.numpy(), reference):
            print(f"{name}: TVM and onnxruntime differ (max |diff| {np.abs(tc.numpy() - reference).max()})")
            return 1

        def tvm_calls():
            for _ in range(args.calls):
                fn(ta, tb, tc)

        def ort_calls():
            for _ in range(args.calls):
                session.run(None, {"A": a})

        times = interleaved_rounds({"ort": ort_calls, "tvm": tvm_calls}, args.rounds, budget_s=1e9, calls=1, warmup=1)
        summary = summarise(times, base="ort")
        ops = 2 * M * N * K
        tvm_ms, ort_ms = summary["tvm"]["ms"] / args.calls, summary["ort"]["ms"] / args.calls
        row = {"shape": name, "M": M, "K": K, "N": N, "tiles": {"rows": tiles[0], "blocks_of_16": tiles[1],
               "k_tile": tiles[2]}, "tvm_ms": tvm_ms, "ort_ms": ort_ms, "ratio": summary["tvm"]["ratio"],
               "tvm_gops": ops / tvm_ms / 1e6, "ort_gops": ops / ort_ms / 1e6, "build_s": build_s}
        results.append(row)
        rows_out.append(f"| {name} | {M}x{K}x{N} | {ort_ms:.4f} ms ({row['ort_gops']:.0f} GOPS) | "
                        f"{tvm_ms:.4f} ms ({row['tvm_gops']:.0f} GOPS) | x{row['ratio']:.2f} |")
        print(rows_out[-1], flush=True)
    ratios = [r["ratio"] for r in results]
    print(f"median over shapes of TVM / onnxruntime: x{statistics.median(ratios):.2f} "
          f"(min x{min(ratios):.2f}, max x{max(ratios):.2f}); load average at the end {os.getloadavg()[0]:.1f}")
    if args.json:
        args.json.write_text(json.dumps({"target": target, "tvm": tvm.__version__, "rounds": args.rounds,
                                         "calls": args.calls, "shapes": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
