"""The handlers of the deploy verbs (argument parsing: appliance/deploy/cli.py): each calls the stage
function the pipeline calls and prints its figures; a failed gate raises GateFailed (exit status 3)
after its report is written. Imported only when one of these verbs runs (the CLI names the handlers
by string), so this module imports what it uses at its top, numpy and onnx included.
"""

from __future__ import annotations

import json

from appliance.deploy import export, options
from appliance.deploy.compile import compile_stage
from appliance.deploy.edge.anchor import build_anchor
from appliance.deploy.edge.cycles import describe as describe_estimate
from appliance.deploy.estimate import estimate_architectures, format_table
from appliance.deploy.gpu import routes as gpu_routes
from appliance.deploy import openvino_route
from appliance.deploy.openvino_route.build import summary_line as openvino_summary
from appliance.deploy.package import package_stage
from appliance.deploy.quantize import quantize_stage
from appliance.deploy.verify import selftest_line, verify_stage


def export_command(args) -> int:
    result = export.export_stage(args.model, args.out, opset=args.opset, batch=export.parse_batch(args.batch),
                                 sample_files=args.samples, num_samples=args.num_samples,
                                 max_rel_error=args.max_rel_error)
    parity = result.parity["parity"]
    print(f"wrote {result.model}: parity on {parity['samples']} {parity['source']} samples: "
          f"max abs {parity['max_abs_error']:.3g}, max rel {parity['max_rel_error']:.3g} "
          f"(limit {args.max_rel_error:g}), top-1 agreement {parity['top1_agreement']:.4f}")
    return 0


def quantize_command(args) -> int:
    def show(result) -> None:  # before the gate: a failed model's figures are printed too
        report = result.report
        q, f = report["quantized"], report["fp32"]
        m, label = report.get("metric", "top1"), report.get("metric_label", "top-1")
        line = (f"wrote {q['model']}: {label} {f[m] * 100:.2f}% -> {q[m] * 100:.2f}% "
                f"(drop {report[f'{m}_drop_points']:.2f} points, allowed {args.max_drop:g}), agreement "
                f"{report['prediction_agreement'] * 100:.2f}%, size x{report['size_ratio']:.2f}, latency "
                f"x{report['latency_ratio']:.2f}; report {result.html}")
        if args.mode == "int8" and "produced_by" in report:
            line += (f"\nINT8 made by: {report['produced_by']} "
                     f"({report['method']}{', per-channel' * bool(report['per_channel'])})")
            if report.get("float_layers"):
                line += f"; kept in float: {', '.join(report['float_layers'])}"
            for row in report.get("schemes", []):  # segmentation: FP32 / INT8 symmetric / asymmetric
                line += (f"\n{row['scheme']}: {label} {row[m] * 100:.2f}%, {row['bytes']:,} B, "
                         f"host latency {row['latency_ms_median']:.3f} ms")
            for row in report.get("engines", []):  # --engine nncf: both engines side by side
                line += (f"\nengine {row['engine']} ({row['step']}): {label} {row[m] * 100:.2f}%, drop "
                         f"{row[f'{m}_drop_points']:.2f} points, {len(row['float_layers'])} layer(s) in float, "
                         f"{row['seconds']:.1f} s: {'PASS' if row['passed'] else 'FAIL: ' + row.get('why', '')}")
            if "activation_scheme" in report:
                line += f"\nkept: INT8 {report['activation_scheme']} activations"
        print(json.dumps(report) if args.json else line)

    quantize_stage(args.model, args.calib, args.val, args.out, mode=args.mode, method=args.method,
                          per_channel=args.per_channel, scheme=args.scheme, calib_samples=args.calib_samples,
                          val_samples=args.val_samples, max_drop=args.max_drop, on_result=show,
                          fallback=args.fallback, max_float_layers=args.max_float_layers,
                          sensitivity=not args.no_sensitivity, sensitivity_samples=args.sensitivity_samples,
                          engine=args.engine)
    return 0


def compile_command(args) -> int:
    if args.target in options.GPU_TARGETS:
        info = compile_stage(args.model, args.target, args.out, sample_files=args.samples,
                             allow_failed_gate=args.allow_failed_gate, tolerance=args.tolerance,
                             calib_files=args.int8_calib, max_drop=args.max_drop).info
        print("\n".join(gpu_routes.build_lines(info)))
        return 0
    if args.target == openvino_route.COMPILE_TARGET:  # no TVM options: the IR is OpenVINO's to schedule
        print(openvino_summary(compile_stage(args.model, args.target, args.out, sample_files=args.samples,
                                             allow_failed_gate=args.allow_failed_gate, tolerance=args.tolerance).info))
        return 0
    info = compile_stage(
        args.model, args.target, args.out, sample_files=args.samples, allow_failed_gate=args.allow_failed_gate,
        tolerance=args.tolerance, tune_trials=args.tune, tuning_db=args.tuning_db, int8_compute=args.int8_compute,
        int8_kernels=args.int8_kernels, fp32_kernels=args.fp32_kernels, installed_tuning=not args.no_installed_tuning,
        rpc=args.rpc, rpc_key=args.rpc_key, dump_ir=args.dump_ir, runtime=args.runtime,
        device_estimate=args.target.startswith("aarch64") and not args.no_device_estimate).info
    if "tuning" in info:
        t = info["tuning"]
        if t["reused"]:
            print(f"reused tuning database {t['database']} ({t['records']} records, {t['trials_per_task']} trials x "
                  f"{t['tasks']} tasks, tuned in {t['tuned_in_seconds']:.0f} s); no new measurements")
        else:
            print(f"tuned {t['tasks']} tasks x {t['trials_per_task']} trials in {t['tuned_in_seconds']:.0f} s; "
                  f"{t['records']} records in {t['database']}")
    line = f"wrote {info['library']} for {args.target} ({info['library_bytes'] / 1e6:.2f} MB) in {info['compile_seconds']:.1f} s"
    layers = info["layers"]
    line += f"; layers: {layers['int8']} int8, {layers['simulated']} simulated, {layers['fp32']} fp32"
    if "check" in info:
        c = info["check"]
        line += f"; vs onnxruntime on {c['samples']} samples: max abs diff {c['max_abs_diff']:.3g}"
        if c.get("max_quantized_units") is not None:
            line += f" ({c['max_quantized_units']:.2f} output steps)"
        line += (f", pixel agreement {c['pixel_agreement']:.4f}" if "pixel_agreement" in c
                 else f", top-1 agreement {c['top1_agreement']:.4f}")
    if info["tuned_tasks"]:
        line += f"; {info['tuned_tasks']} tasks tuned"
    if info.get("host_latency_ms") is not None:
        line += f"; host latency {info['host_latency_ms']:.2f} ms"
    if "device_estimate" in info:
        line += f"; device estimate: {describe_estimate(info['device_estimate'])}"
    print(line)
    print(f"runtime of the edge package: {info['runtime']} ({info['runtime_reason']})")
    if layers["simulated_layers"]:
        print(f"simulated (float32 between dequantize/quantize): {', '.join(layers['simulated_layers'])}")
    return 0


def package_command(args) -> int:
    info = package_stage(args.compiled, tar=args.out, wheelhouse=args.wheelhouse, with_python=args.with_python,
                         glibc_floor=args.glibc_floor, sample_files=args.samples, key=args.key, target=args.target).info
    if info.get("runtime") == "openvino":
        print(f"wrote {args.out} ({info['bytes'] / 1e6:.1f} MB, {info['files']} files, signed by key {info['key_id']}, "
              f"{info['selftest_samples']} golden samples ({info['selftest_source']})); the server runs it with the "
              f"`openvino` bundle profile; check it with `appliance edge verify {args.out}`")
        return 0
    print(f"wrote {args.out} ({info['bytes'] / 1e6:.1f} MB, {info['files']} files, signed by key {info['key_id']}, "
          f"glibc >= {info['glibc_floor']}, "
          f"{info['selftest_samples']} golden samples ({info['selftest_source']})"
          f"{', ' + str(len(info['wheels'])) + ' wheels' if info['wheels'] else ''}); "
          f"check it with `appliance edge verify {args.out}`")
    return 0


def verify_command(args) -> int:
    def show(result) -> None:  # before the gate: a failed package's figures are printed too
        report = result.report
        if args.json:
            print(json.dumps(report))
            return
        for route in report["routes"]:
            what = "pixel agreement" if "pixel_agreement" in route else "top-1 agreement"
            miou = (f", mIoU device {route['miou'] * 100:.2f}% / host {route['host_miou'] * 100:.2f}%"
                    if "miou" in route else "")
            print(f"{args.package}: {route['runner']}: {report['samples']} samples: {what} "
                  f"{route['top1_agreement']:.4f} (need {report['min_agreement']:g}){miou}, max logit diff "
                  f"{route['max_logit_diff']:.3g} (allowed {route['allowed_logit_diff']:.3g}), "
                  f"{route['seconds']:.1f} s: {'PASS' if route['passed'] else 'FAIL'}")
        print(f"{args.package}: {selftest_line(report['selftest'])}")
        if report.get("python_selftest"):  # a package that runs onnxruntime: its own runtime's proof
            t = report["python_selftest"]
            print(f"{args.package}: python/run.py --selftest ({t['runtime']}, qemu-aarch64): {t['samples']} golden "
                  f"samples: agreement {t['agreement']:.4f}, max logit diff {t['max_abs_diff']:.3g} (allowed "
                  f"{t['allowed_abs_diff']:.3g}): {'PASS' if t['passed'] else 'FAIL'}")
        if report.get("runtime") == "openvino":  # a server package: measured on this host, no device estimate
            for hint, b in ((report.get("bench") or {}).get("hints") or {}).items():
                tp = f", {b['throughput']['inferences_per_s']:.1f} inferences/s" if "throughput" in b else ""
                print(f"{args.package}: python/run.py --bench --hint {hint} (this host, not gated): {b['runs']} runs: "
                      f"median {b['median_ms']:.3f} ms, p90 {b['p90_ms']:.3f} ms{tp}")
            return
        print(f"{args.package}: estimated on the device (qemu block counts x llvm-mca, not a timing): "
              f"{describe_estimate(report.get('device_estimate'))}")
        if report.get("bench"):
            b = report["bench"]
            print(f"{args.package}: bin/run --bench (emulated, not gated): {b['runs']} runs: median "
                  f"{b['median_ms']:.2f} ms, p90 {b['p90_ms']:.2f} ms, p99 {b['p99_ms']:.2f} ms, "
                  f"fluctuation {b['fluctuation']:.3f}")

    verify_stage(args.package, args.out, sample_files=args.samples, num_samples=args.num_samples,
                 min_agreement=args.min_agreement, on_result=show, max_logit_diff=args.max_logit_diff,
                 sysroot=args.sysroot, python=args.python, sysroot_debs=args.sysroot_debs,
                 bench_runs=args.bench_runs, pubkey=args.pubkey)
    return 0


def estimate_command(args) -> int:
    table = estimate_architectures(args.architectures, args.target, args.size, args.out, classes=args.classes)
    print(format_table(table))
    print(f"{len(table['rows'])} architectures in {table['seconds']:.0f} s" +
          (f"; wrote {args.out}/estimate.json and estimate.html" if args.out else ""))
    return 0


def anchor_command(args) -> int:
    info = build_anchor(args.out, key=args.key, glibc_floor=args.glibc_floor)
    print(f"wrote {args.out}: the device's trust anchor, trusting key {info['key_id']} ({info['public_key']}); "
          "check it on the device with stock minisign, copy edge-anchor/ there once, then install every package "
          "with edge-anchor/install-package --package DIR (docs/edge.md)")
    return 0
