"""Thin handlers for the deploy verbs: `appliance export`, `quantize`, `package`, `edge verify`,
`edge sysroot`, `compile` (TVM, or the GPU routes of appliance.deploy.gpu.routes): argument parsing.
The handlers are in appliance/deploy/commands.py, named by string and imported when their verb runs
(numpy, onnx); each calls its stage function in appliance.deploy.<stage>, the one the pipeline calls."""

from __future__ import annotations

import argparse

from appliance.core import values
from appliance.deploy import options
from appliance.deploy import compiler as tvm_compile
from appliance.deploy import openvino_route
from appliance.deploy.edge import glibc_floor, qemu
from appliance.deploy.edge import sysroot as edge_sysroot


def register(subparsers) -> None:
    register_export(subparsers)
    register_quantize(subparsers)
    register_compile(subparsers)
    register_package(subparsers)
    register_edge(subparsers)


def register_export(subparsers) -> None:
    p = subparsers.add_parser(
        "export", help="export a trained model to ONNX with a PyTorch/onnxruntime parity check",
        description="Export RUN_DIR (holding model/) or a trained-model/checkpoint directory to "
        "DIR/model.onnx, with preprocessing and class names in its metadata, and check it "
        "against PyTorch on samples (parity.json).")
    p.add_argument("model", metavar="RUN_DIR|CHECKPOINT")
    p.add_argument("--out", required=True, metavar="DIR", type=values.output_dir)
    p.add_argument("--opset", type=values.int_in(options.OPSETS, "an ONNX opset"), default=17,
                   help=f"ONNX opset, {options.OPSETS.ge:.0f}..{options.OPSETS.le:.0f} (default 17)")
    p.add_argument("--batch", default="dynamic", metavar="dynamic|N",
                   help="batch axis: dynamic (default) or a fixed size")
    p.add_argument("--samples", nargs="+", metavar="FILE",
                   help="validation TFRecord files (or a .npz of tensors) for the parity check; "
                   "default: 16 seeded random images")
    p.add_argument("--num-samples", type=values.int_in(values.SAMPLES, "an integer"), default=64)
    p.add_argument("--max-rel-error", type=values.float_in(values.TOLERANCE), default=options.DEFAULT_MAX_REL_ERROR,
                   help="fail when max|torch-onnx| / max|torch| exceeds this (default 1e-5)")
    p.set_defaults(func="appliance.deploy.commands:export_command")


def register_quantize(subparsers) -> None:
    p = subparsers.add_parser(
        "quantize", help="INT8 (static QDQ) or FP16 quantization with an accuracy report and gate",
        description="Quantize MODEL.onnx with calibration data, evaluate FP32 vs quantized on the "
        "validation set (accuracy.json, accuracy.html) and exit 3 when top-1 (mIoU for a segmentation model) "
        "drops more than --max-drop points. A segmentation model is quantized with symmetric and asymmetric "
        "activations, both reported, the better kept.")
    p.add_argument("model", metavar="MODEL.onnx")
    p.add_argument("--calib", required=True, nargs="+", metavar="DATA",
                   help="calibration TFRecord files (image/encoded with image/class/label, or DeepLab's "
                   "image/segmentation/class/encoded masks) or a .npz of tensors")
    p.add_argument("--val", nargs="+", metavar="DATA", help="labelled validation data (default: --calib)")
    p.add_argument("--out", required=True, metavar="DIR", type=values.output_dir)
    p.add_argument("--mode", choices=["int8", "fp16"], default="int8")
    p.add_argument("--method", choices=options.METHODS, default="minmax", help="INT8 calibration method")
    p.add_argument("--per-channel", action="store_true", help="INT8: per-channel weight scales")
    p.add_argument("--scheme", choices=options.SCHEMES, default="s8s8",
                   help="INT8 types: s8s8 (default, accurate on any CPU) or u8s8 with 7-bit weights "
                   "(reduce_range: onnxruntime's faster x86 kernels without their AVX2 saturation)")
    p.add_argument("--calib-samples", type=values.int_in(values.SAMPLES, "an integer"), default=128)
    p.add_argument("--val-samples", type=values.int_in(values.SAMPLES, "an integer"), default=1000)
    p.add_argument("--max-drop", type=values.float_in(values.Range(ge=0, le=100)), default=1.0, help="allowed drop in points of top-1, or of mIoU for a segmentation model (default 1.0)")
    p.add_argument("--fallback", choices=options.FALLBACKS, default="auto",
                   help="INT8 over --max-drop: auto (default) tries per-channel weights and the other calibrations, "
                   "then keeps the most sensitive layers in float; none: exit 3 at once")
    p.add_argument("--engine", choices=options.ENGINES, default="ours",
                   help="INT8: ours (default: onnxruntime's quantizer, --fallback auto) or nncf (NNCF's PTQ, then its "
                   "accuracy control under --max-drop; ours is run beside it and the report shows both)")
    p.add_argument("--max-float-layers", type=values.int_in(values.SMALL_COUNT, "an integer"), default=options.MAX_FLOAT_LAYERS, metavar="N",
                   help=f"--fallback auto keeps at most N layers in float (default {options.MAX_FLOAT_LAYERS})")
    p.add_argument("--no-sensitivity", action="store_true",
                   help="INT8: skip the per-layer sensitivity of a model that passes (fallback still measures it)")
    p.add_argument("--sensitivity-samples", type=values.int_in(values.SAMPLES, "an integer"), default=options.ERROR_SAMPLES, metavar="N",
                   help=f"validation samples the per-layer output error is measured on (default {options.ERROR_SAMPLES})")
    p.add_argument("--qat", metavar="RUN_DIR", type=values.input_dir,
                   help="INT8 still over --max-drop after fallback: fine-tune this trained run with fake quantization "
                   "(same launcher and checkpoints), export it as QDQ and ship it if it passes")
    p.add_argument("--qat-epochs", type=values.int_in(values.EPOCHS_AT_LEAST_ONE, "an integer"), default=2, help="QAT epochs (default 2)")
    p.add_argument("--qat-lr-scale", type=values.float_in(values.QAT_LR_SCALE), default=0.1,
                   help="QAT learning rate = the run's times this (default 0.1)")
    p.add_argument("--json", action="store_true", help="print the accuracy report as one JSON object on stdout")
    # QAT composes train, export and quantize: its handler is the pipeline's (deploy may not import train).
    p.set_defaults(func="appliance.pipeline.qat:quantize_command")


def register_compile(subparsers) -> None:
    p = subparsers.add_parser(
        "compile", help="compile an ONNX model with TVM for aarch64 (or the x86_64 host, checked vs onnxruntime)",
        description="Compile MODEL.onnx with TVM Relax into DIR/model.so for the target. ARM targets "
        f"need {tvm_compile.CROSS_COMPILER}; the x86_64 build is compared with onnxruntime. --target "
        f"{openvino_route.COMPILE_TARGET}: OpenVINO IR (DIR/model.xml, model.bin) for x86 servers, compared with "
        "onnxruntime and timed under OpenVINO's LATENCY and THROUGHPUT hints (needs the openvino wheel).")
    p.add_argument("model", metavar="MODEL.onnx")
    p.add_argument("--target", required=True, choices=[*sorted(tvm_compile.TARGETS), openvino_route.COMPILE_TARGET,
                                                         *options.GPU_TARGETS])
    p.add_argument("--out", required=True, metavar="DIR", type=values.output_dir)
    p.add_argument("--samples", nargs="+", metavar="FILE",
                   help="TFRecord files or a .npz of tensors for the x86_64 check (default: 8 seeded random tensors)")
    p.add_argument("--tolerance", type=values.float_in(values.TOLERANCE),
                   help="x86_64 check: max |tvm - onnxruntime| allowed, times max(1, max |logit|) "
                   "(default 1e-4; 1e-2 for FP16 models)")
    p.add_argument("--allow-failed-gate", action="store_true",
                   help="compile a quantized model even though `appliance quantize` failed its accuracy gate")
    p.add_argument("--tune", type=values.int_in(values.SMALL_COUNT_AT_LEAST_ONE, "an integer"), metavar="N",
                   help="MetaSchedule-tune every kernel with N measured trials on this CPU (x86_64 target), "
                   "keeping the records as a reusable database (default DIR/tuning)")
    p.add_argument("--int8-compute", choices=tvm_compile.INT8_COMPUTE, default="int8",
                   help="QDQ models: int8 (default) runs each quantized conv/matmul on int8 with int32 sums; "
                   "simulated keeps TVM's float32 arithmetic between dequantize and quantize")
    p.add_argument("--int8-kernels", choices=tvm_compile.INT8_KERNELS, default="auto",
                   help="auto (default): int8 convolutions on the CPU's dot-product instructions where this build "
                   "has kernels for them (x86_64 with AVX-512 VNNI); generic: TVM's generic kernels")
    p.add_argument("--fp32-kernels", choices=tvm_compile.FP32_KERNELS, default="auto",
                   help="auto (default): float32 convolutions on register-tiled kernels sized for the CPU's vector "
                   "unit (AVX-512, AVX2, NEON); generic: TVM's generic kernels")
    p.add_argument("--tuning-db", metavar="DIR",
                   help="tuning database to apply; made by --tune (into DIR when it does not exist yet), "
                   "reused without tuning when it does")
    p.add_argument("--rpc", metavar="HOST:PORT",
                   help="with --tune: time the candidates on the device running a TVM RPC server there "
                   "(`python3 -m tvm.exec.rpc_server --host 0.0.0.0 --port 9090`), for any target")
    p.add_argument("--rpc-key", default="", metavar="KEY", help="the key the RPC server was started with (--key)")
    p.add_argument("--no-installed-tuning", action="store_true",
                   help="do not apply the installed tuning databases ($APPLIANCE_TUNING_DIR, then tuning/ next to "
                   "the venv) that match the target and CPU; they apply by default when neither --tune nor "
                   "--tuning-db is given")
    p.add_argument("--no-device-estimate", action="store_true",
                   help="aarch64 targets: skip the estimated Cortex-A76/A55 cycles per inference in compile.json "
                   "(one run under qemu-aarch64 with a block-counting plugin, costed by llvm-mca-16)")
    p.add_argument("--runtime", choices=tvm_compile.RUNTIMES, default="auto",
                   help="what the edge package runs: auto (default) the faster of this build and onnxruntime on the "
                   "same model (aarch64: the cycle model on Cortex-A76 and A55; x86_64: measured here), tvm, or "
                   "onnxruntime; compile.json says which and why")
    p.add_argument("--dump-ir", metavar="DIR", help="write the Relax module after each compiler pass into DIR (TVMScript)")
    p.add_argument("--int8-calib", nargs="+", metavar="DATA",
                   help="tensorrt: also build an INT8 engine, calibrated on these TFRecord files or .npz "
                   "(the calibration data of `appliance quantize`)")
    p.add_argument("--max-drop", type=values.float_in(values.Range(ge=0, le=100)), default=1.0,
                   help="cuda-ort/tensorrt: allowed top-1 drop in points against FP32 on labelled --samples "
                   "(default 1.0)")
    p.set_defaults(func="appliance.deploy.commands:compile_command")


def register_package(subparsers) -> None:
    p = subparsers.add_parser(
        "package", help="build an edge package tar (native runner, TVM runtime, golden samples, checksums)",
        description="Package COMPILE_DIR (from `appliance compile --target aarch64`) into one tar a device "
        "installs with no network. Refuses when any shipped ELF file needs a glibc above --glibc-floor. "
        f"--target {openvino_route.PACKAGE_TARGET} packs a `compile --target {openvino_route.COMPILE_TARGET}` build "
        "into a server package (IR, a Python runner on the openvino wheel, golden samples, checksums, signature).")
    p.add_argument("compiled", metavar="COMPILE_DIR")
    p.add_argument("--target", choices=["aarch64", openvino_route.PACKAGE_TARGET],
                   help="aarch64 (an edge package) or x86_64-openvino (a server package); default: what "
                   "COMPILE_DIR was compiled for")
    p.add_argument("--out", required=True, metavar="edge-package.tar", type=values.output_file)
    p.add_argument("--glibc-floor", default=glibc_floor.DEFAULT_GLIBC_FLOOR, metavar="2.X",
                   help=f"oldest glibc the device may have (default {glibc_floor.DEFAULT_GLIBC_FLOOR}: Debian 10+, "
                   "Ubuntu 18.10+, RHEL 8+, JetPack 5+)")
    p.add_argument("--with-python", action="store_true",
                   help="also ship python/run.py and the aarch64 wheels it needs (about 100 MB more)")
    p.add_argument("--samples", nargs="+", metavar="FILE",
                   help="validation TFRecord files or a .npz of tensors for the golden self-test samples "
                   "(default: the samples `appliance export` checked parity on, when still present)")
    p.add_argument("--wheelhouse", metavar="DIR",
                   help="aarch64 wheels (default: the project's or installed bundle's wheelhouse/edge-aarch64)")
    p.add_argument("--key", metavar="KEY",
                   help="minisign secret key that signs the package (default: $APPLIANCE_EDGE_KEY, else "
                   "~/.config/appliance/edge-signing.key, made on first use; see docs/edge.md)")
    p.set_defaults(func="appliance.deploy.commands:package_command")


def register_edge(subparsers) -> None:
    edge = subparsers.add_parser("edge", help="edge package checks (verify) and the arm64 sysroot for them")
    verbs = edge.add_subparsers(dest="edge_verb", metavar="VERB", required=True)
    p = verbs.add_parser(
        "verify", help="run the package under qemu-aarch64 and compare with host onnxruntime",
        description="Check the package's signature (the site key, or --pubkey) and SHA256SUMS, run its native runner under qemu-aarch64 on "
        "samples and compare with onnxruntime on the host: top-1 agreement (per pixel, with mIoU, for a segmentation "
        "model) and max logit difference, gated "
        "(exit status 3 when the gate or the on-device self-test fails). An x86_64-openvino server package runs "
        "its own python/run.py on this host (with this environment's openvino wheel) instead of qemu.")
    p.add_argument("package", metavar="edge-package.tar")
    p.add_argument("--samples", nargs="+", metavar="FILE",
                   help="validation TFRecord files or a .npz of tensors (default: 16 seeded random images)")
    p.add_argument("--num-samples", type=values.int_in(values.SAMPLES, "an integer"), default=32)
    p.add_argument("--min-agreement", type=values.fraction_float,
                   help="required top-1 agreement, or share of pixels whose class agrees for a segmentation model "
                   "(default: 1.0 for classification, 0.995 for segmentation)")
    p.add_argument("--max-logit-diff", type=values.float_in(values.TOLERANCE),
                   help="allowed max |edge - host| logit, times max(1, max |host logit|) "
                   "(default 1e-4; 1e-2 for FP16 models)")
    p.add_argument("--sysroot", default=qemu.DEFAULT_SYSROOT, help="aarch64 libc for qemu -L")
    p.add_argument("--python", action="store_true",
                   help="also run python/run.py inside an arm64 Python sysroot under qemu (about 15 s more)")
    p.add_argument("--sysroot-debs", metavar="DIR",
                   help="arm64 .debs from `appliance edge sysroot` (default: wheelhouse/edge-sysroot-arm64)")
    p.add_argument("--bench-runs", type=values.int_in(values.SMALL_COUNT, "an integer"), default=options.BENCH_RUNS, metavar="N",
                   help=f"timed runs of `bin/run --bench` under qemu (default {options.BENCH_RUNS}; 0 skips it); "
                   "emulated latency, reported and not gated")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object on stdout")
    p.add_argument("--out", metavar="DIR", type=values.output_dir, help="also write verify.json and manifest.json here")
    p.add_argument("--pubkey", metavar="KEY.pub",
                   help="the public key the package must be signed with (default: the site key's .pub)")
    p.set_defaults(func="appliance.deploy.commands:verify_command")
    register_sysroot(verbs)
    register_estimate(verbs)
    register_anchor(verbs)


def register_anchor(verbs) -> None:
    p = verbs.add_parser(
        "anchor", help="the device's trust anchor: a verifier/installer holding the site key, installed once",
        description="Write edge-anchor.tar: install-package (the edge installer), bin/verify (the aarch64 minisign "
        "check, no other library) and the site's public key, signed by the site key. Installed once on each device, "
        "it checks every later package's signature, sums and file list before any byte of the package runs "
        "(docs/edge.md, 'The device's trust anchor').")
    p.add_argument("--out", required=True, metavar="edge-anchor.tar", type=values.output_file)
    p.add_argument("--glibc-floor", default=glibc_floor.DEFAULT_GLIBC_FLOOR, metavar="2.X",
                   help=f"oldest glibc the device may have (default {glibc_floor.DEFAULT_GLIBC_FLOOR})")
    p.add_argument("--key", metavar="KEY",
                   help="the site's minisign secret key (default: $APPLIANCE_EDGE_KEY, else "
                   "~/.config/appliance/edge-signing.key, made on first use); its .pub is the key the anchor trusts")
    p.set_defaults(func="appliance.deploy.commands:anchor_command")


def register_estimate(verbs) -> None:
    p = verbs.add_parser(
        "estimate", help="estimated device ms of untrained architectures, FP32 and INT8, before training",
        description="Build each architecture untrained (FP32, and INT8 with random calibration), compile it for "
        "TARGET and estimate its cycles per inference on Cortex-A76 and Cortex-A55 (qemu block counts costed by "
        "llvm-mca-16, at stated clocks). Prints the table; --out also writes estimate.json and estimate.html.")
    sizes, classes = options.ESTIMATE_SIZES, options.ESTIMATE_CLASSES
    p.add_argument("--architectures", required=True, type=estimate_architectures, metavar="A,B,...",
                   help=f"some of {', '.join(options.ESTIMATE_ARCHITECTURES)} (e.g. resnet18,mobilenet_v2)")
    p.add_argument("--target", default="aarch64-dotprod", choices=("aarch64", "aarch64-dotprod"))
    p.add_argument("--size", type=values.int_in(sizes, "a size in pixels"), default=224,
                   help=f"input height and width, {sizes.ge:.0f}..{sizes.le:.0f} (default 224)")
    p.add_argument("--classes", type=values.int_in(classes, "a number of classes"), default=1000,
                   help=f"classes of the final layer, {classes.ge:.0f}..{classes.le:.0f} (default 1000)")
    p.add_argument("--out", metavar="DIR", type=values.output_dir, help="write estimate.json and estimate.html here")
    p.set_defaults(func="appliance.deploy.commands:estimate_command")


def estimate_architectures(text: str) -> list[str]:
    """--architectures A,B: names from the offered list only (checked before any path is built from them)."""
    archs = [a.strip() for a in text.split(",") if a.strip()]
    problem = options.estimate_problem(archs, options.ESTIMATE_SIZES.ge, options.ESTIMATE_CLASSES.ge, names=("", "", ""))
    if problem:
        raise argparse.ArgumentTypeError(problem.removeprefix(": "))
    return archs


def register_sysroot(verbs) -> None:
    p = verbs.add_parser(
        "sysroot", help="fetch Debian arm64 python3.11 .debs for `edge verify --python` (connected host)",
        description="Download the arm64 .debs of python3.11 and its dependencies into DIR with a private apt "
        "configuration (the host's packages are not touched). Needs a network; the result works offline.")
    p.add_argument("--out", default=str(edge_sysroot.default_debs_dir()), metavar="DIR")
    p.add_argument("--mirror", default=edge_sysroot.MIRROR)
    p.add_argument("--suite", default=edge_sysroot.SUITE)
    p.set_defaults(func=sysroot_command)


def sysroot_command(args) -> int:
    debs = edge_sysroot.fetch_sysroot_debs(args.out, mirror=args.mirror, suite=args.suite)
    print(f"wrote {len(debs)} arm64 .debs to {args.out}; `appliance edge verify --python` uses them offline")
    return 0
