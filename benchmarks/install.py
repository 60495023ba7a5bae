"""Offline install time of a mid-size bundle: the installer's uv path against its pip path.

    PYTHONPATH=. .venv/bin/python benchmarks/install.py [--repeat N] [--cache DIR]

Builds one signed bundle of the `midsize` profile (numpy, onnx, onnxruntime, protobuf, pillow,
tensorboardX and this project; downloads on first run, then from the cache), then installs it
into fresh prefixes with `installer/install.sh --use uv` and `--use pip`, alternating, under
`unshare -n` when available. Prints each path's wall time (whole install.sh: verify, extract,
venv, install, self-test), its package-install step alone, the CPU seconds of the whole run
(steadier than wall time on a shared machine), and the uv/pip ratios, twice:
as shipped (both paths compile bytecode, pip's default, so a read-only PREFIX never recompiles)
and with --no-compile (uv's default). Target: uv path <= 0.35x pip time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.35


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=2, help="installs per path and mode, interleaved (default 2; medians are compared)")
    parser.add_argument("--cache", default=os.path.expanduser("~/.cache/appliance/wheels"))
    args = parser.parse_args()
    appliance = [sys.executable, "-m", "appliance"]
    python = getattr(sys, "_base_executable", sys.executable)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    offline = ["unshare", "-n"] if shutil.which("unshare") and os.geteuid() == 0 else []

    with tempfile.TemporaryDirectory(prefix="bench-install-") as tmp:
        tmp = Path(tmp)
        subprocess.run([*appliance, "bundle", "keygen", "--out", str(tmp / "k")], check=True, capture_output=True)
        t0 = time.monotonic()
        build = subprocess.run([*appliance, "bundle", "build", "--profile", "midsize", "--out", str(tmp / "out"),
                                "--sign-key", str(tmp / "k.key"), "--cache", args.cache],
                               capture_output=True, text=True)
        if build.returncode != 0:
            print(build.stderr, file=sys.stderr)
            return 1
        tar = Path(build.stdout.strip())
        manifest = json.loads(subprocess.run(["tar", "-xOf", str(tar), f"{tar.stem}/bundle.json"],
                                             capture_output=True, check=True).stdout)
        wheels = manifest["profiles"]["midsize"]["wheels"]
        print(f"bundle: {tar.name}, profile midsize: {len(wheels)} wheels, "
              f"{sum(w['bytes'] for w in wheels) / 1e6:.0f} MB (built in {time.monotonic() - t0:.0f} s)")

        modes = {"bytecode compiled (as shipped)": [], "--no-compile": ["--no-compile"]}
        results = {(mode, use): [] for mode in modes for use in ("uv", "pip")}
        for i in range(args.repeat):
            for (mode, use), runs in results.items():
                prefix = tmp / f"{use}-{i}"
                cmd = [*offline, str(ROOT / "installer" / "install.sh"), str(tar), "--prefix", str(prefix),
                       "--pubkey", str(tmp / "k.pub"), "--python", python, "--use", use, *modes[mode]]
                t0, cpu0 = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                wall, cpu1 = time.monotonic() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
                if proc.returncode != 0:
                    print(proc.stderr, file=sys.stderr)
                    return 1
                record = json.loads((prefix / "current" / "install.json").read_text())
                assert record["installer"] == use
                runs.append((wall, record["timings"]["install_s"], cpu))
                print(f"  {mode:31} {use:>3} run {i + 1}: install.sh {wall:6.1f} s, "
                      f"package install step {record['timings']['install_s']:6.1f} s, CPU {cpu:6.1f} s")
                shutil.rmtree(prefix)

    print(f"\n{'':33}{'':27}{'uv path':>9}{'pip path':>10}{'uv/pip':>8}")
    for mode in modes:
        med = {use: [statistics.median(r[k] for r in results[(mode, use)]) for k in (0, 1, 2)]
               for use in ("uv", "pip")}
        for k, label in enumerate(("install.sh, whole (s)", "package install step (s)", "CPU, whole (s)")):
            print(f"{mode:33}{label:27}{med['uv'][k]:9.1f}{med['pip'][k]:10.1f}{med['uv'][k] / med['pip'][k]:7.2f}x")
        ratio = med["uv"][1] / med["pip"][1]
        print(f"{'':33}target uv <= {TARGET}x pip (install step): {'met' if ratio <= TARGET else 'NOT met'} "
              f"({ratio:.2f}x)")
    print(f"load average now (1/5/15 min): {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} "
          "cores; bytecode compilation is CPU-bound in both paths, so it dominates on few cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
