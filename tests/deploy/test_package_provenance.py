"""The edge package's own manifest answers what made it, from which data, with which settings,
and how to remake it: checked against the `appliance package` command that made it."""

import json
import shlex
import subprocess
import tarfile
from pathlib import Path

from appliance import __version__
from conftest import appliance_cmd, offline_cmd


def test_edge_package_manifest_names_its_command_and_its_lineage(tmp_path, compiled_arm, exported, val_tfrecord):
    args = ["package", str(compiled_arm), "--target", "aarch64", "--out", "edge.tar"]
    proc = subprocess.run(offline_cmd(appliance_cmd(*args)), capture_output=True, text=True, cwd=tmp_path,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with tarfile.open(tmp_path / "edge.tar") as tar:
        manifest = json.load(tar.extractfile("edge-package/manifest.json"))
    # How to remake it: this command, in this directory, with this version of the code.
    assert manifest["command"] == shlex.join(["appliance", *args]) and manifest["cwd"] == str(tmp_path)
    assert manifest["appliance_version"] == __version__ and "commit" in manifest["git"]
    # What made it, with which settings: the compile and export stages, each with its own command and params.
    steps = {s["stage"]: s for s in manifest["lineage"]}
    assert list(steps) == ["export", "compile"]
    assert steps["compile"]["dir"] == str(Path(compiled_arm).resolve())
    assert steps["compile"]["params"]["target"] == "aarch64" and steps["export"]["params"]["opset"]
    assert all(s["command"] and s["appliance_version"] == __version__ for s in steps.values())
    # From which data: the validation file export measured parity on, by sha256.
    compiled_inputs = {i["path"] for i in steps["compile"]["inputs"]}
    assert str(exported / "model.onnx") in compiled_inputs
    from appliance.core.manifest import sha256_file
    assert {"path": str(val_tfrecord), "sha256": sha256_file(val_tfrecord)} in steps["export"]["inputs"]
