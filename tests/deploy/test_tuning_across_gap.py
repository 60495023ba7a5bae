"""A tuning database made with `compile --tune`, carried in a bundle, installed, and applied by a plain
`appliance compile` on the installed side with no measuring; one made for another target applies nothing."""

import json
import os
import shutil
import subprocess
import sys

import bundle_kit
from conftest import ROOT, offline_cmd, run_appliance

TRIALS = 2


def test_carried_database_is_applied_on_the_installed_side(tmp_path, tmp_path_factory, exported, val_npz):
    model = exported / "model.onnx"
    db = tmp_path / "db"
    proc = run_appliance("compile", str(model), "--target", "x86_64", "--out", str(tmp_path / "tuned"),
                         "--tune", str(TRIALS), "--tuning-db", str(db), "--samples", str(val_npz))
    assert proc.returncode == 0, proc.stderr
    header = json.loads((db / "tuning.json").read_text())
    assert header["tasks"] > 0

    # The connected side: a bundle of the test profile carrying the database.
    base = tmp_path_factory.getbasetemp() / "bundles"
    base.mkdir(exist_ok=True)
    key, pub = bundle_kit.keys(base)
    src = tmp_path / "src"
    src.mkdir()
    bundle_kit.source_copy(src, "0.1.0")
    proc = bundle_kit.build(tmp_path / "bundle", "--profile", "test", "--sign-key", str(key), "--tuning-db", str(db),
                            source=src, cache=base / "cache")
    assert proc.returncode == 0, proc.stderr
    tar = tmp_path / "bundle" / "appliance-bundle-0.1.0.tar"
    import tarfile

    with tarfile.open(tar) as t:
        manifest = json.loads(t.extractfile("appliance-bundle-0.1.0/bundle.json").read())
        sums = t.extractfile("appliance-bundle-0.1.0/SHA256SUMS").read().decode()
    [carried] = manifest["tuning_databases"]
    assert carried["target"] == "x86_64" and carried["cpu"] == header["tvm_target"]["mcpu"]
    assert carried["tasks"] == header["tasks"] and carried["records"] == header["records"]
    for f in carried["files"]:
        assert f"{f['sha256']}  {f['file']}\n" in sums

    # The air-gapped side: install offline; the database lands next to the release's venv.
    prefix = tmp_path / "site"
    proc = bundle_kit.install(tar, prefix, pubkey=pub)
    assert proc.returncode == 0, proc.stderr
    installed = prefix / "current" / "tuning" / carried["name"]
    for name in ("tuning.json", "database_workload.json", "database_tuning_record.json"):
        assert (installed / name).read_bytes() == (db / name).read_bytes()
    record = json.loads((prefix / "current" / "install.json").read_text())
    assert record["tuning_databases"] == [carried["name"]]

    # A plain compile with the installed venv's interpreter finds it at the default place (tuning/ next
    # to the venv). The test profile carries no TVM, so the checkout and the dev venv's packages are on
    # PYTHONPATH; sys.prefix, which decides where the databases are looked for, is the installed venv's.
    site = next(p for p in sys.path if p.endswith("site-packages") and "/.venv/" in p)
    env = {k: v for k, v in os.environ.items() if k != "APPLIANCE_TUNING_DIR"}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{site}"
    python = prefix / "current" / "venv" / "bin" / "python"
    out = tmp_path / "on-site"
    proc = subprocess.run(offline_cmd([str(python), "-m", "appliance", "compile", str(model), "--target", "x86_64",
                                       "--out", str(out), "--samples", str(val_npz)]),
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"tuning database {installed} (x86_64 {carried['cpu']}): {header['tasks']} of" in proc.stdout
    assert "tuning: tasks done" not in proc.stdout  # applied, not measured
    info = json.loads((out / "compile.json").read_text())
    assert info["tuned_tasks"] == header["tasks"] > 0
    [entry] = info["installed_tuning"]
    assert entry["database"] == str(installed) and entry["applied"] and entry["tuned_tasks"] == header["tasks"]
    assert info["check"]["passed"] and info["check"]["max_abs_diff"] <= 1e-4 and info["check"]["top1_agreement"] == 1.0

    # $APPLIANCE_TUNING_DIR: a database made for another target applies nothing, in one line.
    other = tmp_path / "other" / "aarch64-db"
    shutil.copytree(installed, other)
    fake = {**header, "target": "aarch64", "tvm_target": {"kind": "llvm", "mtriple": "aarch64-linux-gnu",
                                                            "mattr": ["+neon"], "num-cores": 4}}
    (other / "tuning.json").write_text(json.dumps(fake))
    proc = run_appliance("compile", str(model), "--target", "x86_64", "--out", str(tmp_path / "mismatched"),
                         "--samples", str(val_npz), env={**os.environ, "APPLIANCE_TUNING_DIR": str(other.parent)})
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("tuning database")]
    assert lines == [f"tuning database {other}: not applied (made for aarch64 +neon, this build is "
                     f"x86_64 {carried['cpu']})"], proc.stdout
    info = json.loads((tmp_path / "mismatched" / "compile.json").read_text())
    assert info["tuned_tasks"] == 0 and info["installed_tuning"][0]["applied"] is False
    assert info["check"]["passed"]

    # --no-installed-tuning ignores even a matching one.
    proc = run_appliance("compile", str(model), "--target", "x86_64", "--out", str(tmp_path / "plain"),
                         "--no-installed-tuning", env={**os.environ, "APPLIANCE_TUNING_DIR": str(installed)})
    assert proc.returncode == 0, proc.stderr
    info = json.loads((tmp_path / "plain" / "compile.json").read_text())
    assert info["tuned_tasks"] == 0 and info["installed_tuning"] == []
