"""The edge package on a device: its glibc floor, and bin/run's errors, self-test and bench under qemu.

qemu runs bin/run against the cross toolchain's glibc 2.36, which would hide a binary that needs
more than the device has, so the floor is asserted by reading the symbol versions of every ELF.
"""

import json
import shutil
import subprocess
import tarfile

import numpy as np
import pytest

from conftest import run_appliance
from appliance.deploy.edge.glibc_floor import read_needs, version_key

QEMU = ["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu"]


@pytest.fixture(scope="module")
def package_dir(tmp_path_factory, edge_package):
    root = tmp_path_factory.mktemp("edge-runner")
    with tarfile.open(edge_package) as tar:
        tar.extractall(root, filter="data")
    return root / "edge-package"


@pytest.fixture(scope="module")
def other_model_library(tmp_path_factory, card):
    """model.so of another model with the same input: an untrained small_cnn, compiled for aarch64."""
    import torch

    from appliance.deploy.compiler.driver import compile_model
    from appliance.deploy.export import export_model
    from appliance.models import build_model, save_trained_model

    torch.manual_seed(123)
    base = tmp_path_factory.mktemp("other-model")
    save_trained_model(base / "run" / "model", build_model("small_cnn", 4).eval(), card)
    export_model(base / "run", base / "export")
    compile_model(base / "export" / "model.onnx", "aarch64", base / "compile")
    return base / "compile" / "model.so"


def run(package_dir, *args, cwd=None):
    return subprocess.run([*QEMU, str(package_dir / "bin" / "run"), *args], capture_output=True, text=True,
                          cwd=cwd, timeout=600)


def objdump_glibc(path) -> str:
    """The highest GLIBC_ version objdump -T lists: an independent reading to check ours against."""
    out = subprocess.run(["aarch64-linux-gnu-objdump", "-T", str(path)], capture_output=True, text=True,
                         check=True).stdout
    import re

    return max(re.findall(r"\(GLIBC_([0-9.]+)\)", out), key=version_key)


def test_every_shipped_elf_is_within_the_glibc_floor(package_dir):
    elves = {name: package_dir / name for name in ("bin/run", "model.so", "lib/libtvm_runtime.so", "lib/libtvm_ffi.so")}
    needs = {name: read_needs(path) for name, path in elves.items()}
    for name, n in needs.items():
        assert version_key(n.highest("GLIBC")) <= version_key("2.28"), (name, n.highest("GLIBC"))
        assert n.highest("GLIBC") == objdump_glibc(elves[name]), name
    tvm_glibcxx = max((needs[lib].highest("GLIBCXX") for lib in ("lib/libtvm_runtime.so", "lib/libtvm_ffi.so")),
                      key=version_key)
    # The runner carries zig's own libc++: it needs no libstdc++ at all, so none above the TVM libraries'.
    assert needs["bin/run"].highest("GLIBCXX") is None and needs["bin/run"].highest("CXXABI") is None
    assert needs["model.so"].highest("GLIBCXX") is None or (
        version_key(needs["model.so"].highest("GLIBCXX")) <= version_key(tvm_glibcxx))
    dynamic = subprocess.run(["readelf", "-d", str(elves["bin/run"])], capture_output=True, text=True).stdout
    assert "libstdc++" not in dynamic and "libtvm_runtime.so" in dynamic and "$ORIGIN/../lib" in dynamic
    # What the package records is what the files say.
    recorded = json.loads((package_dir / "manifest.json").read_text())["params"]["elf_needs"]
    assert recorded["bin/run"]["GLIBC"] == needs["bin/run"].highest("GLIBC")
    assert recorded["lib/libtvm_runtime.so"]["GLIBCXX"] == tvm_glibcxx


def test_a_library_needing_glibc_2_34_makes_package_refuse(tmp_path, compiled_arm):
    """A model library linked against a newer glibc (Debian 12's gcc: pthread_create moved into libc
    at 2.34) is refused, naming the file and the symbol, and no tar is written."""
    from appliance.core.manifest import read_manifest, write_manifest

    planted_src = tmp_path / "planted.c"
    planted_src.write_text("#include <pthread.h>\nstatic void *f(void *a) { return a; }\n"
                           "int start(void) { pthread_t t; return pthread_create(&t, 0, f, 0); }\n")
    compiled = tmp_path / "compile"
    shutil.copytree(compiled_arm, compiled)
    subprocess.run(["aarch64-linux-gnu-gcc", "-shared", "-fPIC", "-o", str(compiled / "model.so"), str(planted_src)],
                   check=True)
    old = read_manifest(compiled)
    write_manifest(compiled, old["stage"], [i["path"] for i in old["inputs"]], old["params"])
    proc = run_appliance("package", str(compiled), "--out", str(tmp_path / "p.tar"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"appliance package: error: {compiled / 'model.so'}: needs pthread_create@GLIBC_2.34, above the package's "
        "glibc floor 2.28 (--glibc-floor); it would not load on such a device"]
    assert not (tmp_path / "p.tar").exists()


def test_a_floor_below_the_tvm_runtime_names_its_wheel_and_symbol(tmp_path, compiled_arm):
    proc = run_appliance("package", str(compiled_arm), "--out", str(tmp_path / "p.tar"), "--glibc-floor", "2.17")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("appliance package: error: ") and "apache_tvm-0.27" in proc.stderr
    assert ".whl:tvm/lib/libtvm_runtime.so: needs expf@GLIBC_2.27, above the package's glibc floor 2.17" in proc.stderr
    assert not (tmp_path / "p.tar").exists()


def test_a_bad_glibc_floor_is_one_line(tmp_path, compiled_arm):
    proc = run_appliance("package", str(compiled_arm), "--out", str(tmp_path / "p.tar"), "--glibc-floor", "2.x")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "--glibc-floor: expected a glibc version such as 2.28, got '2.x'" in proc.stderr


def test_runner_error_paths_are_one_line_and_exit_2(package_dir, tmp_path):
    x = np.load(package_dir / "selftest" / "inputs.npy")
    cases = {}
    cases["missing model"] = (["--model", str(tmp_path / "none.so"), "--input", str(package_dir / "selftest/inputs.npy")],
                              f"{tmp_path / 'none.so'}: no such file (model library)")
    np.save(tmp_path / "shape.npy", x[:, :, :8, :8])
    cases["wrong shape"] = (["--input", str(tmp_path / "shape.npy")],
                            f"{tmp_path / 'shape.npy'}: shape (8, 3, 8, 8), the model needs (N, 3, 16, 16)")
    np.save(tmp_path / "dtype.npy", x.astype(np.float64))
    cases["wrong dtype"] = (["--input", str(tmp_path / "dtype.npy")],
                            f"{tmp_path / 'dtype.npy'}: dtype is '<f8', the model needs float32 ('<f4')")
    data = (package_dir / "selftest" / "inputs.npy").read_bytes()
    (tmp_path / "cut.npy").write_bytes(data[:len(data) - 100])
    cases["truncated"] = (["--input", str(tmp_path / "cut.npy")],
                          f"{tmp_path / 'cut.npy'}: truncated: header says shape (8, 3, 16, 16) (24576 bytes), "
                          f"file holds {x.nbytes - 100}")
    (tmp_path / "text.npy").write_text("not a tensor\n")
    cases["not npy"] = (["--input", str(tmp_path / "text.npy")], f"{tmp_path / 'text.npy'}: not a .npy file")
    cases["missing input"] = (["--input", str(tmp_path / "none.npy")],
                              f"{tmp_path / 'none.npy'}: no such file (input tensor)")
    cases["not a library"] = (["--model", str(package_dir / "model.json"), "--input",
                               str(package_dir / "selftest/inputs.npy")], None)
    cases["bad flag"] = (["--bench", "--runs", "zero"], "--runs: expected an integer >= 1, got 'zero'")
    for what, (args, line) in cases.items():
        proc = run(package_dir, *args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and proc.stdout == "", (what, proc.returncode, proc.stderr)
        if line is not None:
            assert lines == [f"run: error: {line}"], what
    assert run(package_dir, *cases["not a library"][0]).stderr.startswith(
        f"run: error: {package_dir / 'model.json'}: cannot load the model library: ")


def test_runner_predicts_like_the_packaged_host_outputs(package_dir, tmp_path):
    proc = run(package_dir, "--input", str(package_dir / "selftest/inputs.npy"), "--output", str(tmp_path / "y.npy"),
               "--top-k", "2")
    assert proc.returncode == 0, proc.stderr
    expected = np.load(package_dir / "selftest/expected.npy")
    got = np.load(tmp_path / "y.npy")
    assert got.shape == expected.shape and np.abs(got - expected).max() < 1e-4
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [line["top_k"][0]["class"] for line in lines] == list(expected.argmax(1))


def test_selftest_passes_on_the_package(package_dir):
    proc = run(package_dir, "--selftest")
    assert proc.returncode == 0, proc.stderr
    [line] = proc.stdout.strip().splitlines()
    assert line.startswith("selftest PASS: 8 golden samples: top-1 agreement 1.0000 (need 1), max logit diff ")
    proc = run(package_dir, "--selftest", "--json")
    report = json.loads(proc.stdout)
    info = json.loads((package_dir / "model.json").read_text())["selftest"]
    assert report["passed"] and report["samples"] == 8 and report["top1_agreement"] == 1.0
    assert report["max_abs_diff"] <= report["allowed_abs_diff"] == pytest.approx(info["max_abs_diff"])


def test_selftest_fails_when_the_model_is_another_models(package_dir, other_model_library, tmp_path):
    swapped = tmp_path / "edge-package"
    shutil.copytree(package_dir, swapped)
    shutil.copyfile(other_model_library, swapped / "model.so")
    proc = run(swapped, "--selftest")
    assert proc.returncode == 1 and proc.stderr == ""
    [line] = proc.stdout.strip().splitlines()
    assert line.startswith("selftest FAIL: 8 golden samples: ")
    report = json.loads(run(swapped, "--selftest", "--json").stdout)
    assert not report["passed"] and report["max_abs_diff"] > report["allowed_abs_diff"]


def test_bench_figures_json_and_gate(package_dir):
    proc = run(package_dir, "--bench", "--runs", "12", "--warmup", "2", "--threads", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    b = json.loads(proc.stdout)
    assert b["runs"] == 12 and b["warmup"] == 2 and b["threads"] == 1 and b["max_fluctuation"] is None
    assert 0 < b["min_ms"] <= b["median_ms"] <= b["p90_ms"] <= b["p99_ms"] <= b["max_ms"]
    assert b["fluctuation"] == pytest.approx((b["p99_ms"] - b["median_ms"]) / b["median_ms"], rel=1e-6)
    # The gate is exactly fluctuation > max: a zero allowance fails unless every run took as long.
    gated = run(package_dir, "--bench", "--runs", "12", "--warmup", "1", "--json", "--max-fluctuation", "0")
    g = json.loads(gated.stdout)
    assert gated.returncode == (1 if g["fluctuation"] > 0 else 0) and g["passed"] is (g["fluctuation"] == 0)
    text = run(package_dir, "--bench", "--runs", "5", "--warmup", "0", "--max-fluctuation", "1000")
    assert text.returncode == 0
    assert text.stdout.startswith("bench: 5 runs after 0 warmup, ") and text.stdout.rstrip().endswith("(max 1000): PASS")
    bad = run(package_dir, "--bench", "--max-fluctuation", "nan")
    assert bad.returncode == 2 and bad.stderr == "run: error: --max-fluctuation: expected a finite number >= 0, got 'nan'\n"


# A prebuilt runner (appliance.assets.edge_runner): what a bundle carries so that a site's first package skips zig.

@pytest.fixture(scope="module")
def carried_runner(tmp_path_factory):
    """edge-runner/ as `appliance bundle build` makes it (the same function, real zig), from the edge wheels."""
    from appliance.deploy.package import default_wheelhouse, locked_wheels
    from appliance.assets.edge_runner import build_carried

    base = tmp_path_factory.mktemp("carried")
    build_carried(locked_wheels(default_wheelhouse()), base / "edge-runner", base / "work")
    return base / "edge-runner"


def copy_carried(carried, dest, **edit):
    """A copy of the carried folder with runner.json's fields (or its inputs', key recomputed) edited."""
    from appliance.assets.edge_runner import runner_key

    shutil.copytree(carried, dest)
    record = json.loads((dest / "runner.json").read_text())
    inputs = {k: v for k, v in edit.items() if k in record["inputs"]}
    if inputs:
        record["inputs"] |= inputs
        record["key"] = runner_key(record["inputs"])
    record |= {k: v for k, v in edit.items() if k not in inputs}
    (dest / "runner.json").write_text(json.dumps(record))
    return dest


def package_env(carried, tmp_path, block_zig=False) -> dict:
    """This environment with the carried folder given; block_zig: `import ziglang`, so `python -m ziglang`, fails."""
    import os

    from conftest import ROOT

    path = [str(ROOT)]
    if block_zig:
        shim = tmp_path / "no-zig" / "ziglang"
        shim.mkdir(parents=True)
        (shim / "__init__.py").write_text("raise ImportError('ziglang blocked by the test: zig must not run')\n")
        path.insert(0, str(shim.parent))
    return os.environ | {"PYTHONPATH": os.pathsep.join(path), "APPLIANCE_EDGE_RUNNER_DIR": str(carried)}


def unpack(tar_path, into):
    with tarfile.open(tar_path) as tar:
        tar.extractall(into, filter="data")
    return into / "edge-package"


def test_a_carried_runner_is_shipped_without_running_zig(tmp_path, compiled_arm, carried_runner):
    import sys

    env = package_env(carried_runner, tmp_path, block_zig=True)
    blocked = subprocess.run([sys.executable, "-m", "ziglang", "version"], capture_output=True, text=True, env=env)
    assert blocked.returncode != 0 and "ziglang blocked by the test" in blocked.stderr
    key = json.loads((carried_runner / "runner.json").read_text())["key"]
    proc = run_appliance("package", str(compiled_arm), "--out", str(tmp_path / "p.tar"), env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"bin/run: the bundle's prebuilt runner (key {key[:12]}...)" in proc.stderr.splitlines()
    root = unpack(tmp_path / "p.tar", tmp_path / "unpacked")
    assert (root / "bin" / "run").read_bytes() == (carried_runner / "run").read_bytes()
    params = json.loads((root / "manifest.json").read_text())["params"]
    assert params["runner"] == {"source": "bundle", "key": key}
    # The floor check read the carried file like a built one.
    assert version_key(params["elf_needs"]["bin/run"]["GLIBC"]) <= version_key("2.28")


def test_a_carried_runner_from_other_inputs_is_passed_over_and_zig_builds_the_same_file(
        tmp_path, compiled_arm, carried_runner):
    other_floor = copy_carried(carried_runner, tmp_path / "floor-2.31", glibc_floor="2.31")
    proc = run_appliance("package", str(compiled_arm), "--out", str(tmp_path / "p.tar"),
                         env=package_env(other_floor, tmp_path))
    assert proc.returncode == 0, proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("bin/run: ")]
    assert line.startswith("bin/run: built with zig (key ") and "glibc_floor 2.31 vs 2.28" in line, line
    root = unpack(tmp_path / "p.tar", tmp_path / "unpacked")
    params = json.loads((root / "manifest.json").read_text())["params"]
    assert params["runner"]["source"] == "built"
    # Equal inputs, equal key, equal file: what the key promises, with zig's output as the judge.
    assert params["runner"]["key"] == json.loads((carried_runner / "runner.json").read_text())["key"]
    assert (root / "bin" / "run").read_bytes() == (carried_runner / "run").read_bytes()


def test_an_unreadable_or_altered_carried_runner_is_named_and_not_used(tmp_path, carried_runner, monkeypatch):
    from appliance.deploy.package import default_wheelhouse, locked_wheels
    from appliance.assets.edge_runner import extract_runtime, find_carried, runner_inputs

    (tmp_path / "sdk").mkdir()
    (tmp_path / "lib").mkdir()
    extract_runtime(locked_wheels(default_wheelhouse()), tmp_path / "sdk", tmp_path / "lib")
    inputs = runner_inputs(tmp_path / "sdk", tmp_path / "lib", "2.28")
    monkeypatch.setenv("APPLIANCE_EDGE_RUNNER_DIR", str(carried_runner))
    assert find_carried(inputs)[0] == carried_runner / "run"

    broken = copy_carried(carried_runner, tmp_path / "broken")
    (broken / "runner.json").write_text("{not json")
    edited = copy_carried(carried_runner, tmp_path / "edited", key="0" * 64)
    replaced = copy_carried(carried_runner, tmp_path / "replaced")
    (replaced / "run").write_bytes(b"\x7fELF not the runner")
    zig = copy_carried(carried_runner, tmp_path / "zig", zig="0.16.0")
    for folder, why in ((broken, f"{broken / 'runner.json'} is unreadable (JSONDecodeError"),
                        (edited, f"{edited}'s key 000000000000... is not this package's (runner.json edited)"),
                        (replaced, f"{replaced / 'run'} is missing or not the file runner.json names"),
                        (zig, "(zig 0.16.0 vs 0.17.0)")):
        monkeypatch.setenv("APPLIANCE_EDGE_RUNNER_DIR", str(folder))
        found, line = find_carried(inputs)
        assert found is None and line.startswith("bin/run: built with zig (key ") and why in line, line


def test_a_carried_runner_above_the_floor_is_refused_like_a_built_one(tmp_path, compiled_arm, carried_runner):
    """The ELF check runs on the carried file: one needing GLIBC_2.34 (with a runner.json that vouches
    for it) makes package refuse, naming bin/run."""
    import hashlib

    planted = copy_carried(carried_runner, tmp_path / "planted")
    (tmp_path / "planted.c").write_text("#include <pthread.h>\nstatic void *f(void *a) { return a; }\n"
                                        "int main(void) { pthread_t t; return pthread_create(&t, 0, f, 0); }\n")
    subprocess.run(["aarch64-linux-gnu-gcc", "-o", str(planted / "run"), str(tmp_path / "planted.c")], check=True)
    copy_carried(planted, tmp_path / "vouched", sha256=hashlib.sha256((planted / "run").read_bytes()).hexdigest())
    proc = run_appliance("package", str(compiled_arm), "--out", str(tmp_path / "p.tar"),
                         env=package_env(tmp_path / "vouched", tmp_path, block_zig=True))
    assert proc.returncode == 2
    assert "bin/run: the bundle's prebuilt runner (key " in proc.stderr
    error = proc.stderr.splitlines()[-1]
    assert error.startswith("appliance package: error: ") and "/bin/run: needs " in error, error
    assert "@GLIBC_2.34, above the package's glibc floor 2.28" in error and not (tmp_path / "p.tar").exists()
