"""Every manifest says how it was made: the command as typed, the appliance version, the git
commit of the code (when it runs from a checkout), and the lineage the manifest writer assembles
from the manifests that made its inputs."""

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from appliance import __version__
from appliance.core.errors import DataError
from appliance.core.manifest import write_manifest
from conftest import appliance_cmd, offline_cmd

ROOT = Path(__file__).resolve().parents[1]


def _image_folder(root: Path) -> Path:
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        (root / name).mkdir(parents=True)
        for i in range(10):
            Image.fromarray(rng.integers(0, 256, (16, 16, 3)).astype(np.uint8)).save(root / name / f"{i}.png")
    return root


def _git(*args) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()


def _run(args, cwd):
    """`appliance ARGS` offline, as a user types it; returns the argv after `appliance`."""
    proc = subprocess.run(offline_cmd(appliance_cmd(*args)), capture_output=True, text=True, cwd=cwd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_convert_then_check_manifests_record_command_version_commit_and_lineage(tmp_path):
    _image_folder(tmp_path / "images")
    convert = ["data", "convert", "images", "--out", "shards", "--val-fraction", "0.2", "--seed", "5"]
    _run(convert, tmp_path)  # relative paths: the manifest keeps the directory they are relative to
    check = ["data", "check", "--train", *sorted(p.name for p in (tmp_path / "shards").glob("train-*.tfrecord")),
             "--val", "val-00000-of-00001.tfrecord", "--out", str(tmp_path / "checked")]
    _run(check, tmp_path / "shards")

    made = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert made["command"] == shlex.join(["appliance", *convert]) and made["cwd"] == str(tmp_path)
    assert made["appliance_version"] == __version__
    # This test runs from a git checkout: the commit of the code that ran, and whether it was edited.
    assert made["git"] == {"commit": _git("rev-parse", "HEAD"),
                           "dirty": bool(_git("status", "--porcelain", "--untracked-files=no"))}
    assert made["lineage"] == []  # image files: nothing made them

    checked = json.loads((tmp_path / "checked" / "manifest.json").read_text())
    assert checked["command"] == shlex.join(["appliance", *check]) and checked["cwd"] == str(tmp_path / "shards")
    [step] = checked["lineage"]
    assert step["stage"] == "convert" and step["dir"] == str(tmp_path / "shards")
    assert step["command"] == made["command"] and step["params"]["split"] == made["params"]["split"]
    # Inputs are recorded as given; the step's cwd makes them whole again.
    assert {str(Path(step["cwd"]) / i["path"]) for i in step["inputs"]} == {
        str(p) for p in (tmp_path / "images").rglob("*.png")}


def test_lineage_follows_only_the_file_a_stage_made_and_names_a_damaged_manifest(tmp_path):
    up = tmp_path / "up"
    up.mkdir()
    (up / "made.bin").write_bytes(b"made by up")
    write_manifest(up, "up", [], {"k": 1})
    down = tmp_path / "down"
    down.mkdir()
    assert [s["stage"] for s in write_manifest(down, "down", [up / "made.bin"], {})["lineage"]] == ["up"]
    further = tmp_path / "further"
    further.mkdir()
    chain = write_manifest(further, "further", [down / "manifest.json", up / "made.bin"], {})["lineage"]
    assert [s["stage"] for s in chain] == ["up"]  # down's manifest is not one of down's outputs
    (up / "made.bin").write_bytes(b"changed after up made it")
    assert write_manifest(down, "down", [up / "made.bin"], {})["lineage"] == []
    (up / "manifest.json").write_text('{"stage": "up", "outputs": [')
    with pytest.raises(DataError, match=r"up/manifest.json: damaged stage manifest"):
        write_manifest(down, "down", [up / "made.bin"], {})


def test_no_git_no_commit_and_outside_the_cli_the_process_argv(tmp_path):
    code = ("import json; from appliance.core.manifest import provenance; print(json.dumps(provenance()))")
    env = {k: v for k, v in os.environ.items() if k not in ("APPLIANCE_COMMAND", "APPLIANCE_COMMAND_CWD")}
    cmd = offline_cmd([sys.executable, "-c", code])
    cmd[0] = shutil.which(cmd[0])
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path,
                          env={**env, "PATH": str(tmp_path)}, timeout=60)  # no git on PATH
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert "git" not in found and found["appliance_version"] == __version__
    assert found["command"] == "-c" and found["cwd"] == str(tmp_path)


def test_a_changed_output_stops_package_and_the_sysroot_in_one_line_naming_it(tmp_path):
    """One check of a stage's outputs against its manifest (core.manifest.check_outputs) serves the
    edge package (a compile directory) and the arm64 sysroot (its .debs directory)."""
    from appliance.deploy.edge.sysroot import build_python_sysroot
    from appliance.deploy.package import build_package

    compiled, debs = tmp_path / "compiled", tmp_path / "debs"
    for directory, name in ((compiled, "model.so"), (debs, "libc6_arm64.deb")):
        directory.mkdir()
        (directory / name).write_bytes(b"as made")
        write_manifest(directory, "test", [], {}, outputs=[directory / name])
        (directory / name).write_bytes(b"changed")
    (compiled / "compile.json").write_text(json.dumps({"target": "aarch64-linux-gnu"}))
    with pytest.raises(DataError) as err:
        build_package(compiled, tmp_path / "pkg")
    assert str(err.value) == f"{compiled}: changed since it was compiled: {compiled / 'model.so'}: sha256 mismatch"
    with pytest.raises(DataError) as err:
        build_python_sysroot(debs, tmp_path, tmp_path / "edge")
    assert str(err.value) == f"{debs}: {debs / 'libc6_arm64.deb'}: sha256 mismatch"
    assert not (tmp_path / "pkg").exists() and not (tmp_path / "edge").exists()
