"""`appliance edge verify`: run an edge package's native runner under qemu-aarch64 and compare
its logits with the host's onnxruntime on the same samples, before the package leaves the building."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.errors import DataError, EnvironmentProblem

if TYPE_CHECKING:
    import numpy as np

DEFAULT_SYSROOT = "/usr/aarch64-linux-gnu"


def register(subparsers) -> None:
    edge = subparsers.add_parser("edge", help="edge package checks (verify)")
    verbs = edge.add_subparsers(dest="edge_verb", metavar="VERB", required=True)
    p = verbs.add_parser(
        "verify", help="run the package under qemu-aarch64 and compare with host onnxruntime",
        description="Check the package's SHA256SUMS, run its native runner under qemu-aarch64 on "
        "samples and compare with onnxruntime on the host: top-1 agreement and max logit difference, gated.")
    p.add_argument("package", metavar="edge-package.tar")
    p.add_argument("--samples", nargs="+", metavar="FILE",
                   help="validation TFRecord files or a .npz of tensors (default: 16 seeded random images)")
    p.add_argument("--num-samples", type=int, default=32)
    p.add_argument("--min-agreement", type=float, default=1.0, help="required top-1 agreement (default 1.0)")
    p.add_argument("--max-logit-diff", type=float,
                   help="allowed max |edge - host| logit, times max(1, max |host logit|) "
                   "(default 1e-4; 1e-2 for FP16 models)")
    p.add_argument("--sysroot", default=DEFAULT_SYSROOT, help="aarch64 libc for qemu -L")
    p.add_argument("--python", action="store_true",
                   help="also run python/run.py inside an arm64 Python sysroot under qemu (about 15 s more)")
    p.add_argument("--sysroot-debs", metavar="DIR",
                   help="arm64 .debs from `appliance edge sysroot` (default: wheelhouse/edge-sysroot-arm64)")
    p.add_argument("--out", metavar="DIR", help="also write verify.json and manifest.json here")
    p.set_defaults(func=run)
    from appliance.deploy.edge_sysroot import register_sysroot

    register_sysroot(verbs)


def run(args) -> int:
    report = verify_package(args.package, sample_files=args.samples, num_samples=args.num_samples,
                            min_agreement=args.min_agreement, max_logit_diff=args.max_logit_diff,
                            sysroot=args.sysroot, out_dir=args.out, python=args.python,
                            sysroot_debs=args.sysroot_debs)
    for route in report["routes"]:
        print(f"{args.package}: {route['runner']}: {report['samples']} samples: top-1 agreement "
              f"{route['top1_agreement']:.4f} (need {args.min_agreement:g}), max logit diff "
              f"{route['max_logit_diff']:.3g} (allowed {route['allowed_logit_diff']:.3g}), "
              f"{route['seconds']:.1f} s: {'PASS' if route['passed'] else 'FAIL'}")
    return 0 if report["passed"] else 1


def unpack_checked(package: Path, into: Path) -> Path:
    """Extract the tar and check every file against SHA256SUMS; one line for the first problem."""
    if not package.is_file():
        raise DataError(f"{package}: no such file")
    try:
        with tarfile.open(package) as tar:
            tar.extractall(into, filter="data")
    except (tarfile.TarError, OSError) as err:
        raise DataError(f"{package}: not a readable edge package tar ({err})") from None
    root = into / "edge-package"
    sums = root / "SHA256SUMS"
    if not sums.is_file():
        raise DataError(f"{package}: not an edge package (no edge-package/SHA256SUMS)")
    listed = set()
    for line in sums.read_text().splitlines():
        digest, name = line.split("  ", 1)
        listed.add(name)
        path = root / name
        if not path.is_file():
            raise DataError(f"{package}: {name} is listed in SHA256SUMS but missing")
        if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            raise DataError(f"{package}: {name}: sha256 does not match SHA256SUMS (modified after packaging)")
    extra = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()
                   and str(p.relative_to(root)) not in listed | {"SHA256SUMS", "manifest.json"})
    if extra:
        raise DataError(f"{package}: {extra[0]} is not listed in SHA256SUMS (added after packaging)")
    return root


def run_native(root: Path, x: np.ndarray, sysroot: str) -> tuple[np.ndarray, float]:
    """Logits from bin/run under qemu-aarch64 for the whole batch in one process."""
    import numpy as np

    qemu = shutil.which("qemu-aarch64")
    if qemu is None:
        raise EnvironmentProblem("qemu-aarch64: not found on PATH (install Debian's qemu-user, "
                                 "e.g. `installer/bootstrap.sh --system`)")
    if not Path(sysroot, "lib", "ld-linux-aarch64.so.1").exists():
        raise EnvironmentProblem(f"{sysroot}: no aarch64 libc here (install libc6-arm64-cross or pass --sysroot)")
    np.save(root / "verify-input.npy", x)
    start = time.perf_counter()
    returncode, stderr = run_counting_samples(
        [qemu, "-L", sysroot, str(root / "bin" / "run"), "--input", str(root / "verify-input.npy"),
         "--output", str(root / "verify-output.npy"), "--top-k", "1"], len(x), "native runner")
    seconds = time.perf_counter() - start
    if returncode != 0:
        tail = (stderr.strip().splitlines() or ["no output"])[-1]
        raise DataError(f"{root / 'bin' / 'run'}: native runner failed under qemu (exit {returncode}): {tail}")
    return np.load(root / "verify-output.npy"), seconds


def run_counting_samples(cmd: list[str], total: int, desc: str, env=None) -> tuple[int, str]:
    """Run a runner that prints one JSON line per sample, with a progress bar (emulated ResNets
    take tens of seconds per sample). Returns (exit status, stderr)."""
    from tqdm import tqdm

    with tempfile.TemporaryFile("w+") as err, tqdm(total=total, desc=f"{desc} under qemu", unit="sample",
                                                    disable=None) as bar:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        for line in proc.stdout:
            if line.startswith('{"sample"'):
                bar.update(1)
        proc.wait()
        err.seek(0)
        return proc.returncode, err.read()


def compare_with_host(runner: str, edge: np.ndarray, host: np.ndarray, seconds: float, package,
                      min_agreement: float, max_logit_diff: float, labels: np.ndarray | None = None,
                      min_allowed: float = 0.0) -> dict:
    import numpy as np

    if edge.shape != host.shape:
        raise DataError(f"{package}: {runner} returned logits {edge.shape}, host {host.shape}")
    diff = float(np.abs(edge.astype(np.float64) - host).max())
    allowed = max(max_logit_diff * max(1.0, float(np.abs(host).max())), min_allowed)
    agreement = float((edge.argmax(1) == host.argmax(1)).mean())
    return {"runner": runner, "seconds": round(seconds, 2), "top1_agreement": agreement, "max_logit_diff": diff,
            "allowed_logit_diff": allowed,
            "disagreeing_samples": [int(i) for i in np.flatnonzero(edge.argmax(1) != host.argmax(1))],
            "max_logit_diff_per_sample": [float(v) for v in np.abs(edge.astype(np.float64) - host).max(1)],
            "passed": bool(agreement >= min_agreement and diff <= allowed),
            # With labelled samples, the accuracy on ARM beside the host's on the same samples.
            **({"top1": float((edge.argmax(1) == labels).mean()), "host_top1": float((host.argmax(1) == labels).mean())}
               if labels is not None else {})}


def qdq_allowance(reference) -> float:
    """For a QDQ model, the output steps `appliance compile` allows between its int8 build and
    onnxruntime's float reference (float rounding carried through the layers); 0 otherwise."""
    import onnx

    from appliance.deploy.compile import QDQ_UNITS
    from appliance.deploy.int8_rewrite import output_scale

    step = output_scale(onnx.load(str(reference)))
    return QDQ_UNITS * step * (1 + 1e-5) if step else 0.0


def verify_package(package, *, sample_files=None, num_samples=32, min_agreement=1.0,
                   max_logit_diff=None, sysroot=DEFAULT_SYSROOT, out_dir=None,
                   python=False, sysroot_debs=None) -> dict:
    import numpy as np

    from appliance.deploy.edge_sysroot import build_python_sysroot, default_debs_dir, run_python_runner
    from appliance.deploy.export import synthetic_samples
    from appliance.deploy.onnx_model import default_tolerance, ort_session, run_ort
    from appliance.deploy.samples import check_input_shape, load_samples

    package = Path(package)
    with tempfile.TemporaryDirectory(prefix="edge-verify-") as tmp:
        root = unpack_checked(package, Path(tmp))
        info = json.loads((root / "model.json").read_text())
        shape, preprocessing = info["input"]["shape"], info["preprocessing"]
        min_allowed = 0.0
        if max_logit_diff is None:
            max_logit_diff = default_tolerance(info.get("precision", "fp32"))
            min_allowed = qdq_allowance(root / "reference" / "model.onnx")
        if sample_files:
            samples = load_samples(sample_files, preprocessing, limit=num_samples)
        else:
            samples = synthetic_samples(preprocessing, shape[1], 16)
        check_input_shape(samples, shape, info["input"]["name"], package)
        host = run_ort(ort_session(root / "reference" / "model.onnx", optimize=False), samples.x)
        edge, seconds = run_native(root, samples.x, sysroot)
        routes = [compare_with_host("native runner (qemu-aarch64)", edge, host, seconds, package,
                                    min_agreement, max_logit_diff, samples.y, min_allowed)]
        if python:
            debs = Path(sysroot_debs) if sysroot_debs else default_debs_dir()
            py_sysroot, site = build_python_sysroot(debs, root, Path(tmp) / "python-sysroot")
            start = time.perf_counter()
            run_python_runner(root, py_sysroot, site, root / "verify-input.npy", root / "verify-python.npy",
                              len(samples.x))
            routes.append(compare_with_host("Python runner (arm64 python3.11 under qemu-aarch64)",
                                            np.load(root / "verify-python.npy"), host,
                                            time.perf_counter() - start, package, min_agreement, max_logit_diff,
                                            samples.y, min_allowed))
    report = {"made_by": "appliance edge verify", "package": str(package.resolve()), "samples": int(len(host)),
              "sample_source": samples.source, "min_agreement": min_agreement, "routes": routes,
              "passed": all(r["passed"] for r in routes)}
    if out_dir:
        from appliance.manifest import atomic_write_text, write_manifest

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out_dir / "verify.json", json.dumps(report, indent=2) + "\n")
        atomic_write_text(out_dir / "verify.html", verify_html(report))
        write_manifest(out_dir, "verify", [package, *samples.files],
                       {"min_agreement": min_agreement, "max_logit_diff": max_logit_diff, "sysroot": sysroot,
                        "python": python})
    return report


def verify_html(report: dict) -> str:
    import html

    from appliance.deploy.html_report import PALETTE, columns_svg, page

    rows, charts = [], []
    for i, r in enumerate(report["routes"]):
        rows.append(f"<tr><td>{html.escape(r['runner'])}</td><td>{r['top1_agreement'] * 100:.2f}%</td>"
                    f"<td>{r['max_logit_diff']:.3g} (allowed {r['allowed_logit_diff']:.3g})</td>"
                    f"<td>{r['seconds']:.1f} s</td><td class=\"{'PASS' if r['passed'] else 'FAIL'}\">"
                    f"{'PASS' if r['passed'] else 'FAIL'}</td></tr>")
        charts.append(columns_svg(f"max |edge - host| logit per sample: {r['runner']}",
                                  r["max_logit_diff_per_sample"], r["allowed_logit_diff"], PALETTE[i % len(PALETTE)]))
    body = (f"<p>{html.escape(report['package'])}: {report['samples']} {report['sample_source']} samples, each "
            "run on the host with onnxruntime and inside the package under qemu-aarch64.</p>"
            "<table><tr><th>runner</th><th>top-1 agreement</th><th>max logit difference</th><th>time</th><th></th></tr>"
            + "".join(rows) + "</table>" + "".join(charts))
    return page("Edge package vs host", "appliance edge verify", "verify.json", report["passed"], body)
