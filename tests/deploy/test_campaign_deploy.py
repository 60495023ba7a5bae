"""The re-run of issue 31's campaign against the edge side, with cases the first round did not list.

install.sh (run as on a device: its aarch64 programs under qemu-aarch64): an upgrade whose install
list (PREFIX/.appliance-edge/files) was tampered, or whose folders were made links, never removes or
writes anything outside what it installed; odd prefixes and a second installer are one line each.
`appliance edge verify`: links, special files, a bomb, a SHA256SUMS the device would refuse, a damaged
reference model or golden samples (each signed by the site) are one line naming the package."""

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
import zlib

import pytest

from conftest import one_line as conftest_one_line, run_appliance
from appliance.core import minisign
from appliance.deploy.edge.signing import default_key_path
from deploy.test_edge_install import (device_sysroot, install, installed_files, package, resign,  # noqa: F401
                                      site_pub, trusted_install, upgrade)


def one_line(proc, code=1):
    return conftest_one_line(proc, code)


@pytest.fixture
def device(tmp_path, trusted_install, package):
    """A copy of a device that installed the genuine package, and a next package signed by the site."""
    prefix = tmp_path / "device"
    shutil.copytree(trusted_install, prefix, symlinks=True)
    (package / "model.json").write_text((package / "model.json").read_text().replace("south-east", "south-east v2"))
    resign(package)
    return prefix, package


def tamper(prefix, case, outside):
    """What someone (or a broken tool) left in PREFIX before the upgrade; returns the outside file that must survive."""
    listed = prefix / ".appliance-edge" / "files"
    victim = outside / "victim"
    victim.write_text("not the installer's\n")
    if case == "a listed folder":  # the site's own folder named as if it were an installed file
        (prefix / "etc").mkdir()
        victim = prefix / "etc" / "site.conf"
        victim.write_text("the site's\n")
        listed.write_text(listed.read_text() + "etc\n")
    elif case == "a folder made a link":  # lib -> a folder outside, with a listed name there
        for lib in (prefix / "lib").iterdir():
            shutil.copy(lib, outside / lib.name)
        shutil.rmtree(prefix / "lib")
        (prefix / "lib").symlink_to(outside)
        listed.write_text(listed.read_text() + "lib/victim\n")
    elif case == "a state file made a link":
        (prefix / ".appliance-edge" / "files.tmp").symlink_to(victim)
    else:  # a listed name that is no path of the package
        listed.write_text(listed.read_text() + case + "\n")
    return victim


TAMPERED = {
    "a listed folder": "{prefix}/etc: is a directory where {prefix}/.appliance-edge/files or the package has a "
                       "file; install.sh removes only files it put there; nothing installed",
    "a folder made a link": "{prefix}/lib: is a symbolic link; install.sh writes and removes only inside {prefix}; "
                            "nothing installed",
    "a state file made a link": "{prefix}/.appliance-edge/files.tmp: not a regular file; nothing installed",
    **{name: "{prefix}/.appliance-edge/files: malformed: '" + name + "' is not a path this installer puts in "
             "{prefix}; {prefix} left as it was"
       for name in (".appliance-edge", ".", "../../victim", "/etc/passwd", "bin/../../victim", "bin/.")},
}


@pytest.mark.parametrize("case", list(TAMPERED))
def test_a_tampered_install_list_never_reaches_outside_what_was_installed(case, device, device_sysroot, tmp_path):
    prefix, new = device
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = tamper(prefix, case, outside)
    before = {**installed_files(prefix), **installed_files(outside)}
    proc = upgrade(prefix, new, device_sysroot)
    assert one_line(proc) == "install.sh: error: " + TAMPERED[case].format(prefix=prefix)
    assert victim.read_text() in ("not the installer's\n", "the site's\n")
    assert {**installed_files(prefix), **installed_files(outside)} == before
    assert (prefix / ".appliance-edge" / "trusted.pub").is_file()  # the device still trusts its key


def test_an_untampered_upgrade_still_replaces_its_files(device, device_sysroot):
    prefix, new = device
    proc = upgrade(prefix, new, device_sysroot)
    assert proc.returncode == 0, proc.stderr
    assert "south-east v2" in (prefix / "model.json").read_text()
    assert not list(prefix.glob(".install.*"))  # staging copy and lock are gone
    assert sorted(p.name for p in (prefix / ".appliance-edge").iterdir()) == ["files", "installed", "trusted.pub"]
    assert sorted((prefix / ".appliance-edge" / "files").read_text().split()) == sorted(installed_files(new))


def test_odd_prefixes_are_one_line_each(package, device_sysroot, site_pub, tmp_path):
    (tmp_path / "a-file").write_text("x")
    proc = install(package, tmp_path / "a-file", device_sysroot, site_pub)
    assert one_line(proc) == f"install.sh: error: {tmp_path / 'a-file'}: exists and is not a directory"
    proc = install(package, tmp_path / "two\nlines", device_sysroot, site_pub)
    assert one_line(proc) == f"install.sh: error: a path holds a line break ({tmp_path / 'two'}...); refused"
    # A link to / (a slip of the keyboard): refused after looking at 1000 names, not at the whole disk.
    (tmp_path / "root").symlink_to("/")
    proc = install(package, tmp_path / "root", device_sysroot, site_pub)
    assert one_line(proc).startswith(f"install.sh: error: {tmp_path / 'root'}: holds 1000 or more file(s) this "
                                     "installer did not put there (")
    assert not any(n.startswith(".install.") for n in os.listdir("/"))


def test_a_prefix_with_a_leading_dash_is_a_name_not_an_option(package, device_sysroot, site_pub, tmp_path):
    proc = subprocess.run(["sh", str(package / "install.sh"), "--prefix", "-dash", "--pubkey", str(site_pub)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "EDGE_EMULATOR": f"qemu-aarch64 -L {device_sysroot}"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith(f"installed in {tmp_path}/-dash (SHA256SUMS ")


def test_a_second_installer_is_refused_and_a_dead_ones_lock_taken_over(device, device_sysroot):
    prefix, new = device
    (prefix / ".install.lock").mkdir()
    (prefix / ".install.lock" / "pid").write_text(f"{os.getpid()}\n")  # alive: this test
    before = installed_files(prefix)
    proc = upgrade(prefix, new, device_sysroot)
    assert one_line(proc) == (f"install.sh: error: {prefix}: another install.sh (pid {os.getpid()}) is installing "
                              f"into it; nothing installed: wait for it to finish (or remove {prefix}/.install.lock "
                              "if none is running)")
    assert installed_files(prefix) == before
    dead = subprocess.Popen(["true"])
    dead.wait()
    (prefix / ".install.lock" / "pid").write_text(f"{dead.pid}\n")  # an installer killed with -9
    proc = upgrade(prefix, new, device_sysroot)
    assert proc.returncode == 0, proc.stderr
    assert not (prefix / ".install.lock").exists()


# `appliance edge verify`: what the device refuses is refused on the host first, in one line naming the
# package; nothing is written for a member the headers already condemn.

def package_files(edge_package):
    with tarfile.open(edge_package) as tar:
        return {m.name[len("edge-package/"):]: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def write_package(out, files, sums=None, extra=()):
    """A package tar of files (name -> bytes), SHA256SUMS (the sums given, else of the files) signed by
    the site key, plus extra (TarInfo, bytes or None) members."""
    files = {n: d for n, d in files.items() if n not in ("SHA256SUMS", "SHA256SUMS.minisig")}
    sums = sums if sums is not None else "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n"
                                                 for n, d in sorted(files.items())).encode()
    files["SHA256SUMS"] = sums
    (out.parent / "sums").write_bytes(sums)
    files["SHA256SUMS.minisig"] = minisign.sign_file(str(out.parent / "sums"), str(default_key_path()), "t").encode()
    with tarfile.open(out, "w") as tar:
        for name, data in files.items():
            if name in [info.name[len("edge-package/"):] for info, _ in extra]:
                continue
            info = tarfile.TarInfo(f"edge-package/{name}")
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
        for info, data in extra:
            tar.addfile(info, io.BytesIO(data) if data else None)
    return out


def member(name, kind, link=""):
    info = tarfile.TarInfo(f"edge-package/{name}")
    info.type, info.linkname = kind, link
    return info


def sums_of(files):
    return "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in sorted(files.items())
                   if n not in ("SHA256SUMS", "SHA256SUMS.minisig"))


VERIFY_CASES = {
    "sums with CRLF": (lambda f: ({}, sums_of(f).replace("\n", "\r\n").encode(), ()),
                       "SHA256SUMS line 1 is not '<sha256>  <relative path>'"),
    "a name listed twice": (lambda f: ({}, (sums_of(f) + sums_of(f).splitlines()[0] + "\n").encode(), ()),
                            "SHA256SUMS line 12: bin/run is listed twice"),
    "the signature a symlink": (lambda f: ({}, None, [(member("SHA256SUMS.minisig", tarfile.SYMTYPE, "model.json"),
                                                       None)]),
                                "member 'edge-package/SHA256SUMS.minisig' is a symbolic link (to model.json); an edge "
                                "package holds only files and folders; refused"),
    "the signature a FIFO": (lambda f: ({}, None, [(member("SHA256SUMS.minisig", tarfile.FIFOTYPE), None)]),
                             "member 'edge-package/SHA256SUMS.minisig' is a device, pipe or other special file; an "
                             "edge package holds only files and folders; refused"),
    "a hard link": (lambda f: ({}, None, [(member("run2", tarfile.LNKTYPE, "edge-package/bin/run"), None)]),
                    "member 'edge-package/run2' is a hard link (to edge-package/bin/run); an edge package holds "
                    "only files and folders; refused"),
    "a damaged reference model": (lambda f: ({"reference/model.onnx": b"not onnx"}, None, ()),
                                  "reference/model.onnx: not a readable ONNX model (Error parsing message with type "
                                  "'onnx.ModelProto': Wire format was corrupt)"),
    "no reference model": (lambda f: ({"reference/model.onnx": None}, None, ()),
                           "reference/model.onnx: not a readable ONNX model ([Errno 2] No such file or directory: "
                           "'edge-package/reference/model.onnx')"),
    "damaged golden samples": (lambda f: ({"selftest/inputs.npy": b"not npy"}, None, ()),
                               "edge-package/bin/run --selftest: failed under qemu (exit 2): run: error: "
                               "edge-package/bin/../selftest/inputs.npy: not a .npy file"),
}


@pytest.mark.parametrize("case", list(VERIFY_CASES))
def test_edge_verify_refuses_what_the_device_would_in_one_line_naming_the_package(case, edge_package, tmp_path):
    """Each signed by the site (what a signer's broken tool can make), so only these checks stand between it
    and a device."""
    change, expected = VERIFY_CASES[case]
    files = package_files(edge_package)
    replace, sums, extra = change(files)
    for name, data in replace.items():
        if data is None:
            del files[name]
        else:
            files[name] = data
    tar = write_package(tmp_path / "p.tar", files, sums, extra)
    proc = run_appliance("edge", "verify", str(tar), "--bench-runs", "0", timeout=300)
    assert one_line(proc, 2) == f"appliance edge verify: error: {tar}: {expected}"


def test_a_compressed_bomb_is_refused_at_its_header_before_anything_is_written(tmp_path):
    """A 5 GiB member in a gzip of about 5 MB (unsigned: anyone can make one): refused by its header."""
    zeros = zlib.compressobj(1, zlib.DEFLATED, 31)
    chunk = zeros.compress(bytes(64 << 20)) + zeros.flush()  # one gzip member of 64 MiB of zeros
    info = tarfile.TarInfo("edge-package/model.so")
    info.size = 80 * (64 << 20)
    bomb = tmp_path / "bomb.tar.gz"
    bomb.write_bytes(gzip.compress(info.tobuf(tarfile.GNU_FORMAT), 1) + chunk * 80)
    temp = tmp_path / "temp"
    temp.mkdir()
    start = time.monotonic()
    proc = run_appliance("edge", "verify", str(bomb), "--bench-runs", "0", timeout=300,
                         env={**os.environ, "TMPDIR": str(temp)})
    assert one_line(proc, 2) == (f"appliance edge verify: error: {bomb}: more than 4 GiB or 100000 members (at "
                                 "'edge-package/model.so', 5368709120 bytes); not an edge package `appliance package` "
                                 "makes; refused")
    assert time.monotonic() - start < 60 and not list(temp.iterdir())


# ONNX handed to quantize and compile: each refused by load_onnx in one line naming the file.

def conv_model(path, shape=(1, 3, 16, 16), weights=None, loop_trips=None):
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weights = np.ones((4, 3, 3, 3), np.float32) if weights is None else weights
    nodes, inits = [helper.make_node("Conv", ["input", "w"], ["c"])], [numpy_helper.from_array(weights, "w")]
    if loop_trips is not None:  # c doubled trip-count times
        body = helper.make_graph(
            [helper.make_node("Identity", ["go"], ["go_out"]), helper.make_node("Add", ["v", "v"], ["v_out"])], "body",
            [helper.make_tensor_value_info("i", TensorProto.INT64, []),
             helper.make_tensor_value_info("go", TensorProto.BOOL, []),
             helper.make_tensor_value_info("v", TensorProto.FLOAT, ["n", 4, "h", "w"])],
            [helper.make_tensor_value_info("go_out", TensorProto.BOOL, []),
             helper.make_tensor_value_info("v_out", TensorProto.FLOAT, ["n", 4, "h", "w"])])
        inits += [numpy_helper.from_array(np.array(loop_trips, np.int64), "trips"),
                  numpy_helper.from_array(np.array(True), "go")]
        nodes.append(helper.make_node("Loop", ["trips", "go", "c"], ["looped"], body=body, name="repeat"))
    nodes += [helper.make_node("GlobalAveragePool", [nodes[-1].output[0]], ["p"]),
              helper.make_node("Flatten", ["p"], ["logits"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@pytest.fixture(scope="module")
def calib_npz(tmp_path_factory):
    import numpy as np

    path = tmp_path_factory.mktemp("calib") / "calib.npz"
    np.savez(path, x=np.random.default_rng(0).random((8, 3, 16, 16), np.float32), y=np.zeros(8, np.int64))
    return path


ONNX_CASES = {
    "a zero-size input": (dict(shape=(1, 3, 0, 16)), "input 'input' is shaped [1, 3, 0, 16]: an image input's sizes "
                                                     "are positive"),
    "a negative input size": (dict(shape=(1, 3, -5, 16)), "input 'input' is shaped [1, 3, -5, 16]: an image input's "
                                                          "sizes are positive"),
    "a loop of 2^40 trips": (dict(loop_trips=1 << 40), "Loop node 'repeat': a loop in the graph (an image model needs "
                                                       "none; TVM cannot compile it, onnxruntime would run it as long "
                                                       "as its trip count says)"),
    "NaN weights": (dict(weights="nan"), "initializer 'w' holds 108 NaN or infinite value(s) of 108: not usable "
                                         "weights (a diverged training run?)"),
}


@pytest.mark.parametrize("verb", ["quantize", "compile"])
@pytest.mark.parametrize("case", list(ONNX_CASES))
def test_hostile_onnx_is_one_line_for_quantize_and_compile(case, verb, calib_npz, tmp_path):
    import numpy as np

    kwargs, expected = ONNX_CASES[case]
    if kwargs.get("weights") == "nan":
        kwargs = {**kwargs, "weights": np.full((4, 3, 3, 3), np.nan, np.float32)}
    model = conv_model(tmp_path / "m.onnx", **kwargs)
    args = (["quantize", str(model), "--calib", str(calib_npz)] if verb == "quantize"
            else ["compile", str(model), "--target", "x86_64", "--no-device-estimate"])
    proc = run_appliance(*args, "--out", str(tmp_path / "out"), timeout=120)
    assert one_line(proc, 2) == f"appliance {verb}: error: {model}: {expected}"


# `appliance package` of a compile directory someone changed: one line, never a read of a device.

@pytest.mark.parametrize("case", ["model.so a link to /dev/zero", "model.so a FIFO", "compile.json not UTF-8"])
def test_package_of_a_changed_compile_dir_is_one_line_and_never_hangs(case, compiled_arm, tmp_path):
    from appliance.core.manifest import sha256_file

    compiled = tmp_path / "compiled"
    shutil.copytree(compiled_arm, compiled)
    if case == "model.so a link to /dev/zero":
        (compiled / "model.so").unlink()
        (compiled / "model.so").symlink_to("/dev/zero")
        expected = f"{compiled / 'model.so'}: not a regular file (a device, pipe or socket); refusing to read it"
    elif case == "model.so a FIFO":
        (compiled / "model.so").unlink()
        os.mkfifo(compiled / "model.so")
        expected = f"{compiled / 'model.so'}: not a regular file (a device, pipe or socket); refusing to read it"
    else:  # and the manifest re-summed to match: only reading it can tell
        with open(compiled / "compile.json", "ab") as f:
            f.write(b"\xff")
        manifest = json.loads((compiled / "manifest.json").read_text())
        for entry in manifest["outputs"]:
            if entry["path"] == "compile.json":
                entry["sha256"] = sha256_file(compiled / "compile.json")
        (compiled / "manifest.json").write_text(json.dumps(manifest))
        expected = f"{compiled / 'compile.json'}: damaged ('utf-8' codec can't decode byte 0xff in position "
        expected += f"{(compiled / 'compile.json').stat().st_size - 1}: invalid start byte); rerun that stage"
    proc = run_appliance("package", str(compiled), "--out", str(tmp_path / "p.tar"), timeout=60)
    assert one_line(proc, 2) == f"appliance package: error: {expected}"
    assert not (tmp_path / "p.tar").exists()


@pytest.mark.parametrize("key", ["/dev/zero", "a folder", "a FIFO"])
def test_a_public_key_that_is_no_file_is_named_as_such(key, edge_package, package, device_sysroot, tmp_path):
    if key == "a folder":
        key = tmp_path
    elif key == "a FIFO":
        key = tmp_path / "key.fifo"
        os.mkfifo(key)
    proc = run_appliance("edge", "verify", str(edge_package), "--bench-runs", "0", "--pubkey", str(key), timeout=60)
    assert one_line(proc, 2) == f"appliance edge verify: error: {key}: not a regular file (a device, pipe or folder), " \
                                "so not a public key"
    proc = install(package, tmp_path / "prefix", device_sysroot, key)
    assert one_line(proc) == f"install.sh: error: {key}: not a regular file (a device, pipe or folder), so not a " \
                             "public key"


# `appliance export` of a run directory whose model/ was changed: one line, never a wait on a FIFO.

@pytest.mark.parametrize("case", ["weights a FIFO", "weights a link to /dev/zero", "card not UTF-8", "card nested"])
def test_export_of_a_damaged_model_dir_is_one_line(case, run_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    weights, card = run / "model" / "model.safetensors", run / "model" / "model.json"
    if case.startswith("weights"):
        weights.unlink()
        os.mkfifo(weights) if "FIFO" in case else weights.symlink_to("/dev/zero")
        expected = f"{weights}: not a regular file (a device, pipe or folder)"
    elif case == "card not UTF-8":
        size = card.stat().st_size
        with open(card, "ab") as f:
            f.write(b"\xff")
        expected = f"{card}: not a valid model card (byte {size} is not UTF-8 text)"
    else:
        card.write_text("[" * 100_000 + "]" * 100_000)
        expected = (f"{card}: not a valid model card (maximum recursion depth exceeded while decoding a JSON array "
                    "from a unicode string)")
    proc = run_appliance("export", str(run), "--out", str(tmp_path / "out"), timeout=60)
    assert one_line(proc, 2) == f"appliance export: error: {expected}"


@pytest.mark.parametrize("which", ["model", "calib"])
def test_a_model_or_samples_path_that_is_a_fifo_is_named_as_such(which, calib_npz, tmp_path):
    fifo = tmp_path / "x.fifo"
    os.mkfifo(fifo)
    model = fifo if which == "model" else conv_model(tmp_path / "m.onnx")
    calib = fifo if which == "calib" else calib_npz
    proc = run_appliance("quantize", str(model), "--calib", str(calib), "--out", str(tmp_path / "out"), timeout=60)
    assert one_line(proc, 2) == f"appliance quantize: error: {fifo}: not a regular file (a folder, device or pipe)"
