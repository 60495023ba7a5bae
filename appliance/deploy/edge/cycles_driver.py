"""Guest side of benchmarks/arm_cycles.py: run one model under qemu-aarch64 between two markers.

    python3.11 driver.py {tvm,ort} MODEL --shape 1,3,224,224 [--warmup 1] [--runs 1] [--maps OUT]

Loads MODEL (a TVM model.so with the runtime-only TVM, or an ONNX file with onnxruntime on one
thread), makes `warmup` calls, then the marker system call lseek(-1, 0x5eed0a11, 0) that the
tbcount plugin snapshots its counters on, `runs` calls, and the marker again: the difference of
the two snapshots is what `runs` inferences executed, with loading and first-call work left out.
Runs on the edge sysroot's arm64 Python (numpy, tvm, onnxruntime from the edge wheels).
"""

import argparse
import os
import sys

MARK = 0x5EED0A11


def mark() -> None:
    try:
        os.lseek(-1, MARK, 0)
    except OSError:
        pass  # EBADF: the call is only a signal to the plugin


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("runtime", choices=("tvm", "ort"))
    parser.add_argument("model")
    parser.add_argument("--shape", required=True)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--maps", help="write the guest's /proc/self/maps here (block addresses to functions)")
    args = parser.parse_args()
    import numpy as np

    x = np.random.default_rng(0).standard_normal([int(d) for d in args.shape.split(",")]).astype(np.float32)
    if args.runtime == "tvm":
        os.environ["TVM_NUM_THREADS"] = "1"
        import tvm
        from tvm.runtime.vm import VirtualMachine

        vm = VirtualMachine(tvm.runtime.load_module(args.model), tvm.cpu())
        xt = tvm.runtime.tensor(x)

        def call():
            return vm["main"](xt).numpy()
    else:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = ort.InferenceSession(args.model, options, providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name

        def call():
            return session.run(None, {name: x})[0]

    for _ in range(args.warmup):
        out = call()
    mark()
    for _ in range(args.runs):
        out = call()
    mark()
    if args.maps:
        with open("/proc/self/maps") as f, open(args.maps, "w") as maps:
            maps.write(f.read())
    print(f"{args.runtime} {os.path.basename(args.model)}: output {tuple(out.shape)}, sum {float(out.sum()):.6g}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
