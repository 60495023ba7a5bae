"""appliance package and appliance edge verify: the tar, its runners, and agreement under qemu.

The glibc floor, the runner's error paths, self-test and bench are in test_edge_runner.py;
install.sh on a device is in test_edge_install.py."""

import io
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from PIL import Image

from conftest import run_appliance
from appliance.core import minisign
from appliance.deploy.edge.signing import default_key_path, public_path
from data_tools import preprocessing as host_preprocessing


def _unpack(tmp_path_factory, tar_path):
    root = tmp_path_factory.mktemp("unpacked")
    with tarfile.open(tar_path) as tar:
        tar.extractall(root, filter="data")
    return root / "edge-package"


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory, edge_package):
    return _unpack(tmp_path_factory, edge_package)


@pytest.fixture(scope="module")
def python_package(tmp_path_factory, compiled_arm):
    from appliance.deploy.package import build_package

    out = tmp_path_factory.mktemp("package-py") / "edge-package-py.tar"
    build_package(compiled_arm, out, with_python=True)
    return out


@pytest.fixture(scope="module")
def unpacked_python(tmp_path_factory, python_package):
    return _unpack(tmp_path_factory, python_package)


def test_package_contents_checksums_and_lineage(unpacked, edge_package):
    names = {str(p.relative_to(unpacked)) for p in unpacked.rglob("*") if p.is_file()}
    assert names == {"model.so", "model.json", "bin/run", "lib/libtvm_runtime.so", "lib/libtvm_ffi.so", "install.sh",
                     "reference/model.onnx", "selftest/inputs.npy", "selftest/expected.npy", "SHA256SUMS",
                     "SHA256SUMS.minisig", "signing-key.pub", "manifest.json"}
    # Slim by default: the native runner, the model and the TVM runtime, no wheels.
    assert edge_package.stat().st_size < 12e6
    for tool_check in (["readelf", "-h", str(unpacked / "bin/run")],):
        assert "AArch64" in subprocess.run(tool_check, capture_output=True, text=True, check=True).stdout
    needed = subprocess.run(["readelf", "-d", str(unpacked / "bin/run")], capture_output=True, text=True).stdout
    assert "libtvm_runtime.so" in needed and "$ORIGIN/../lib" in needed
    # sha256sum -c is what install.sh runs on the device.
    assert subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=unpacked).returncode == 0

    listed = {line.split("  ", 1)[1] for line in (unpacked / "SHA256SUMS").read_text().splitlines()}
    assert listed == names - {"SHA256SUMS", "SHA256SUMS.minisig"}
    # Signed with the site key.
    assert "target:aarch64" in minisign.verify_file(str(unpacked / "SHA256SUMS"), str(unpacked / "SHA256SUMS.minisig"),
                                                    str(public_path(default_key_path())))

    info = json.loads((unpacked / "model.json").read_text())
    assert info["input"] == {"name": "input", "shape": [1, 3, 16, 16], "dtype": "float32"}
    assert info["glibc_floor"] == "2.28"
    # Golden samples are the real validation samples export checked parity on, with host outputs.
    assert info["selftest"]["source"] == "tfrecord" and info["selftest"]["samples"] == 8
    golden, expected = np.load(unpacked / "selftest/inputs.npy"), np.load(unpacked / "selftest/expected.npy")
    assert golden.shape == (8, 3, 16, 16) and expected.shape == (8, 4)
    # Clear-cut samples: a device output within tolerance cannot change their top-1.
    top2 = np.sort(expected, axis=1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 2 * info["selftest"]["max_abs_diff"]
    assert info["class_names"][3] == "south-east" and info["preprocessing"]["image_size"] == 16
    manifest = json.loads((unpacked / "manifest.json").read_text())
    assert [s["stage"] for s in manifest["lineage"]] == ["export", "compile"]
    assert any(i["path"].endswith("val.tfrecord") for i in manifest["lineage"][0]["inputs"])
    assert manifest["params"]["glibc_floor"] == "2.28" and manifest["params"]["with_python"] is False


def test_with_python_adds_the_runner_and_hash_pinned_wheels(unpacked_python):
    from appliance.core.manifest import sha256_file

    names = {str(p.relative_to(unpacked_python)) for p in unpacked_python.rglob("*") if p.is_file()}
    assert {"python/run.py", "python/preprocessing.py", "wheels/requirements.txt"} <= names
    # The device preprocesses with the host's own file, byte for byte.
    assert (unpacked_python / "python/preprocessing.py").read_bytes() == open(host_preprocessing.__file__, "rb").read()
    wheels = sorted(unpacked_python.glob("wheels/*.whl"))
    assert any(w.name.startswith("apache_tvm-") and w.name.endswith("aarch64.whl") for w in wheels)
    assert not any(w.name.startswith("onnxruntime-") for w in wheels)  # not needed by python/run.py
    pins = (unpacked_python / "wheels/requirements.txt").read_text()
    for w in wheels:
        assert f"--hash=sha256:{sha256_file(w)}" in pins


def test_native_runner_runs_under_qemu(unpacked, val_npz, tmp_path):
    x = np.load(val_npz)["x"][:3]
    np.save(tmp_path / "x.npy", x)
    proc = subprocess.run(["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu", str(unpacked / "bin/run"),
                           "--input", str(tmp_path / "x.npy"), "--top-k", "2"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [line["sample"] for line in lines] == [0, 1, 2] and all(len(line["top_k"]) == 2 for line in lines)


def test_edge_verify_agrees_on_every_sample(edge_package, val_tfrecord, tmp_path):
    proc = run_appliance("edge", "verify", str(edge_package), "--samples", str(val_tfrecord), "--num-samples", "24",
                         "--out", str(tmp_path / "verify"))
    assert proc.returncode == 0, proc.stderr
    assert "native runner (qemu-aarch64): 24 samples: top-1 agreement 1.0000" in proc.stdout
    lines = proc.stdout.strip().splitlines()
    assert lines[0].endswith("PASS") and "bin/run --selftest (qemu-aarch64): 8 golden samples" in lines[1]
    assert lines[1].endswith("PASS") and "estimated on the device" in lines[2]
    assert "bin/run --bench (emulated, not gated): 20 runs: median" in lines[3]
    report = json.loads((tmp_path / "verify" / "verify.json").read_text())
    [native] = report["routes"]
    assert report["selftest"]["passed"] and report["selftest"]["top1_agreement"] == 1.0
    bench = report["bench"]
    assert bench["emulated"] and not bench["gated"] and bench["runs"] == 20
    assert 0 < bench["median_ms"] <= bench["p90_ms"] <= bench["p99_ms"] <= bench["max_ms"]
    assert bench["fluctuation"] == pytest.approx((bench["p99_ms"] - bench["median_ms"]) / bench["median_ms"],
                                                 rel=1e-6)
    page = (tmp_path / "verify" / "verify.html").read_text()
    assert "<svg" in page and "PASS" in page and "<script" not in page
    assert report["passed"] and native["disagreeing_samples"] == [] and native["max_logit_diff"] <= 1e-4


@pytest.fixture(scope="session")
def sysroot_debs(tmp_path_factory):
    """The arm64 python3.11 .debs: the bundle's copy when present, else fetched (a connected step)."""
    from appliance.deploy.edge.sysroot import default_debs_dir

    if (default_debs_dir() / "manifest.json").is_file():
        return default_debs_dir()
    out = tmp_path_factory.mktemp("sysroot-debs")
    proc = run_appliance("edge", "sysroot", "--out", str(out))
    assert proc.returncode == 0, f"fetching arm64 .debs needs the Debian mirror: {proc.stderr}"
    return out


def test_edge_verify_python_route_under_qemu(python_package, val_tfrecord, sysroot_debs, tmp_path):
    proc = run_appliance("edge", "verify", str(python_package), "--samples", str(val_tfrecord), "--num-samples", "8",
                         "--python", "--sysroot-debs", str(sysroot_debs), "--bench-runs", "0",
                         "--out", str(tmp_path / "v"), offline=True)
    assert proc.returncode == 0, proc.stderr
    native, python = json.loads((tmp_path / "v" / "verify.json").read_text())["routes"]
    assert python["runner"].startswith("Python runner (arm64 python3.11")
    assert python["top1_agreement"] == 1.0 and python["max_logit_diff"] <= 1e-4
    assert len(proc.stdout.strip().splitlines()) == 4  # native, Python, self-test, device estimate


def test_package_builds_offline_and_verify_json_is_one_object(compiled_arm, tmp_path):
    """No network when packaging (zig, its cache, onnxruntime for the golden outputs) or verifying."""
    tar = tmp_path / "offline.tar"
    proc = run_appliance("package", str(compiled_arm), "--out", str(tar), offline=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote {tar} (") and "glibc >= 2.28, 8 golden samples (tfrecord)" in proc.stdout
    proc = run_appliance("edge", "verify", str(tar), "--json", "--bench-runs", "3", offline=True)
    assert proc.returncode == 0, proc.stderr
    [line] = proc.stdout.strip().splitlines()
    report = json.loads(line)
    assert report["passed"] and report["glibc_floor"] == "2.28" and report["selftest"]["passed"]
    assert report["bench"]["runs"] == 3 and report["bench"]["emulated"] is True


def test_python_route_of_a_slim_package_is_one_line(edge_package):
    proc = run_appliance("edge", "verify", str(edge_package), "--python")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"appliance edge verify: error: {edge_package}: has no Python runner (packaged without --with-python); "
        "verify it without --python, or repackage with --with-python"]


def test_a_file_that_is_not_a_package_is_one_line(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("remember to verify the package\n" * 40)
    proc = run_appliance("edge", "verify", str(notes))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"appliance edge verify: error: {notes}: not an edge package (not a tar archive; make one with "
        "`appliance package`)"]


def test_tampered_package_is_one_line(edge_package, tmp_path):
    tampered = tmp_path / "tampered.tar"
    with tarfile.open(edge_package) as src, tarfile.open(tampered, "w") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read() if member.isfile() else None
            if member.name == "edge-package/model.json":
                data = data.replace(b"south-east", b"south-EAST")
                member.size = len(data)
            dst.addfile(member, io.BytesIO(data) if data is not None else None)
    proc = run_appliance("edge", "verify", str(tampered))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"appliance edge verify: error: {tampered}: model.json: sha256 does not match SHA256SUMS "
                     "(modified after packaging)"]


def test_package_without_the_aarch64_wheelhouse_is_one_line(tmp_path, compiled_arm, exported):
    proc = run_appliance("package", str(compiled_arm), "--out", str(tmp_path / "p.tar"),
                         "--wheelhouse", str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "no aarch64 apache-tvm/apache-tvm-ffi wheels" in proc.stderr and "--edge-wheels" in proc.stderr
    assert not (tmp_path / "p.tar").exists()


def test_python_runner_decodes_an_image_like_the_host(unpacked_python, exported, card, tmp_path):
    """run.py decoding a PNG, with the runtime-only TVM on a host build of the same model (the
    aarch64 route is test_edge_verify_python_route_under_qemu, which feeds tensors)."""
    from appliance.deploy.compiler.driver import compile_model
    from appliance.deploy.onnx_model import ort_session, run_ort
    from data_tools.preprocessing import preprocess_image, preprocessing_of

    compile_model(exported / "model.onnx", "x86_64", tmp_path / "x86")
    img = np.random.default_rng(5).integers(0, 256, (20, 20, 3), dtype=np.uint8)
    Image.fromarray(img).save(tmp_path / "img.png")
    proc = subprocess.run([sys.executable, str(unpacked_python / "python/run.py"), "--input", str(tmp_path / "img.png"),
                           "--top-k", "4", "--model", str(tmp_path / "x86" / "model.so")],
                          capture_output=True, text=True, env={**os.environ, "TVM_USE_RUNTIME_LIB": "1"})
    assert proc.returncode == 0, proc.stderr
    top = json.loads(proc.stdout)["top_k"]
    expected = run_ort(ort_session(exported / "model.onnx"), preprocess_image(img, preprocessing_of(card))[None])[0]
    assert [t["class"] for t in top] == list(np.argsort(-expected, kind="stable"))
    assert top[0]["name"] == card.class_names[top[0]["class"]]
    assert abs(top[0]["logit"] - float(expected.max())) < 1e-4


def test_int8_model_through_compile_package_and_verify(tmp_path, exported, calib_tfrecord, val_tfrecord):
    """The usual edge route: S8S8 QDQ model -> aarch64 library -> package -> agrees with host onnxruntime."""
    from appliance.deploy.compiler.driver import compile_model
    from appliance.deploy.package import build_package
    from appliance.deploy.quantize import quantize_model
    from appliance.deploy.verify import verify_package

    quantize_model(exported / "model.onnx", [calib_tfrecord], tmp_path / "int8", val_files=[val_tfrecord])
    compile_model(tmp_path / "int8" / "model.int8.onnx", "aarch64", tmp_path / "arm")
    build_package(tmp_path / "arm", tmp_path / "int8.tar")
    report = verify_package(tmp_path / "int8.tar", sample_files=[val_tfrecord], num_samples=16, bench_runs=0)
    assert report["passed"] and report["routes"][0]["top1_agreement"] == 1.0 and report["selftest"]["passed"]
    with tarfile.open(tmp_path / "int8.tar") as tar:
        manifest = json.load(tar.extractfile("edge-package/manifest.json"))
    assert [s["stage"] for s in manifest["lineage"]] == ["export", "quantize", "compile"]
    assert any(i["path"] == str(calib_tfrecord) for i in manifest["lineage"][1]["inputs"])


def test_sysroot_fetch_offline_and_missing_debs_are_one_line(tmp_path, python_package):
    proc = run_appliance("edge", "sysroot", "--out", str(tmp_path / "debs"), offline=True)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "no package lists downloaded" in proc.stderr and "needs a connected host" in proc.stderr
    assert not (tmp_path / "debs" / "manifest.json").exists()
    proc = run_appliance("edge", "verify", str(python_package), "--python", "--sysroot-debs", str(tmp_path / "none"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert f"{tmp_path / 'none'}: no arm64 sysroot .debs (run `appliance edge sysroot" in proc.stderr


def test_a_model_compiled_as_it_came_packages_and_verifies_on_tensors(tmp_path):
    """An ONNX model with no `appliance export` metadata (no preprocessing): the package's golden
    samples are seeded tensors of its input shape, and edge verify passes under qemu; what needs the
    preprocessing (the Python runner, TFRecord images) is refused in one line naming the file."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                              torch.nn.Flatten(), torch.nn.Linear(8, 4)).eval()
    torch.onnx.export(net, (torch.randn(1, 3, 16, 16),), str(tmp_path / "raw.onnx"), dynamo=False,
                      input_names=["input"], output_names=["logits"])
    proc = run_appliance("compile", str(tmp_path / "raw.onnx"), "--target", "aarch64", "--no-device-estimate",
                         "--out", str(tmp_path / "c"), offline=True)
    assert proc.returncode == 0, proc.stderr
    proc = run_appliance("package", str(tmp_path / "c"), "--out", str(tmp_path / "p.tar"), offline=True)
    assert proc.returncode == 0, proc.stderr
    assert "golden samples (synthetic)" in proc.stdout
    proc = run_appliance("edge", "verify", str(tmp_path / "p.tar"), "--out", str(tmp_path / "v"), offline=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0].endswith("PASS")
    proc = run_appliance("package", str(tmp_path / "c"), "--out", str(tmp_path / "p2.tar"), "--with-python")
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1
    assert f"{tmp_path / 'c' / 'compile.json'}: --with-python needs the model's preprocessing" in proc.stderr
    (tmp_path / "val.tfrecord").write_bytes(b"")
    proc = run_appliance("edge", "verify", str(tmp_path / "p.tar"), "--samples", str(tmp_path / "val.tfrecord"),
                         "--out", str(tmp_path / "v2"))
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1
    assert f"{tmp_path / 'val.tfrecord'}: TFRecord images need the model's preprocessing" in proc.stderr
