"""appliance compile --tune / --tuning-db: a real MetaSchedule search on the small CNN, its database
reused without measuring, and bad databases refused with one line."""

import json

from conftest import run_appliance
from appliance.core.manifest import read_manifest

TRIALS = 2


def records(db):
    return (db / "database_tuning_record.json").read_text().splitlines()


def untuned_records(lines) -> int:
    """Records whose schedule only looks up the root block: the untuned kernel, timed like the candidates."""
    return sum(1 for line in lines if json.loads(line)[1][0] == [[["GetSBlock", [], ["root", "main"], ["b0"]]], []])


def assert_database_answers_with_its_fastest_record(db) -> None:
    """TVM's own query of every workload sees all its records, the untuned kernel's included, and
    answers with the fastest (TVM drops a record with an empty trace: the untuned kernel never won)."""
    from appliance.deploy.compiler.tuning.search import open_database, prepare_meta_schedule

    def mean(secs):
        return sum(float(t) for t in secs) / len(secs)

    in_file = {}
    for workload, record in (json.loads(line) for line in records(db)):
        in_file.setdefault(workload, []).append(mean(record[1]))
    prepare_meta_schedule()
    database = open_database(db)
    workloads = []
    for record in database.get_all_tuning_records():
        if not any(record.workload.same_as(w) for w in workloads):
            workloads.append(record.workload)
    answered = sorted(sorted(mean(r.run_secs) for r in database.get_top_k(w, 10_000)) for w in workloads)
    expected = sorted(sorted(times) for times in in_file.values())
    assert [len(a) for a in answered] == [len(e) for e in expected]  # every record is seen, untuned ones too
    assert answered == expected  # the same times, so TVM's answer, the first of each, is the fastest


def test_tune_writes_a_reusable_database_and_reuse_measures_nothing(tmp_path, exported, val_npz):
    model = exported / "model.onnx"
    db = tmp_path / "db"
    proc = run_appliance("compile", str(model), "--target", "x86_64", "--out", str(tmp_path / "tuned"),
                         "--tune", str(TRIALS), "--tuning-db", str(db), "--samples", str(val_npz))
    assert proc.returncode == 0, proc.stderr
    assert "tuning: tasks done" in proc.stdout and "ETA" in proc.stdout
    header = json.loads((db / "tuning.json").read_text())
    assert header["made_by"] == "appliance compile --tune" and header["trials_per_task"] == TRIALS
    assert header["tvm"].startswith("0.27") and header["target"] == "x86_64"
    from appliance.core.manifest import sha256_file
    assert header["model_sha256"] == sha256_file(model)
    tuned = records(db)
    assert len(tuned) == header["records"] and header["tasks"] < len(tuned) <= header["tasks"] * (TRIALS + 1)
    # every task's untuned kernel is a record too, so a candidate is applied only where it was faster
    assert untuned_records(tuned) == header["tasks"] and 0 <= header["untuned_kept"] <= header["tasks"]
    assert f"tuning: {header['untuned_kept']} of {header['tasks']} tasks keep their untuned kernel" in proc.stdout
    assert_database_answers_with_its_fastest_record(db)
    info = json.loads((tmp_path / "tuned" / "compile.json").read_text())
    assert info["tuning"]["reused"] is False
    manifest_inputs = [i["path"] for i in read_manifest(tmp_path / "tuned")["inputs"]]
    assert any(p.endswith("database_tuning_record.json") for p in manifest_inputs)
    assert info["check"]["passed"] and info["check"]["max_abs_diff"] <= 1e-4 and info["check"]["top1_agreement"] == 1.0

    before = (db / "database_tuning_record.json").read_bytes()
    proc = run_appliance("compile", str(model), "--target", "x86_64", "--out", str(tmp_path / "reused"),
                         "--tune", str(TRIALS), "--tuning-db", str(db), "--samples", str(val_npz))
    assert proc.returncode == 0, proc.stderr
    assert f"reused tuning database {db} ({len(tuned)} records" in proc.stdout and "no new measurements" in proc.stdout
    assert "tuning: tasks done" not in proc.stdout
    assert (db / "database_tuning_record.json").read_bytes() == before
    info = json.loads((tmp_path / "reused" / "compile.json").read_text())
    assert info["tuning"]["reused"] is True and info["check"]["passed"]
    # the same tuned kernels: the reused build gives the tuned build's outputs
    assert info["check"]["max_abs_diff"] <= 1e-4


def test_bad_or_mismatched_database_is_one_line(tmp_path, exported):
    model = exported / "model.onnx"
    db = tmp_path / "db"
    db.mkdir()
    proc = run_appliance("compile", str(model), "--target", "x86_64", "--out", str(tmp_path / "o"),
                         "--tuning-db", str(db))
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"{db / 'tuning.json'}: not found" in proc.stderr

    header = {"made_by": "appliance compile --tune", "model_sha256": "0" * 64, "target": "x86_64",
              "tvm_target": {"kind": "llvm"}, "trials_per_task": 1, "tasks": 1, "records": 1, "tvm": "0.27.0.post1"}
    (db / "tuning.json").write_text(json.dumps(header))
    proc = run_appliance("compile", str(model), "--target", "x86_64", "--out", str(tmp_path / "o"),
                         "--tuning-db", str(db))
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"{db / 'tuning.json'}: tuned for another model" in proc.stderr
    assert not (tmp_path / "o" / "model.so").exists()


def test_damaged_record_file_is_named(tmp_path, exported):
    from appliance.deploy.compiler.tuning.search import tuning_target
    from appliance.core.manifest import sha256_file
    from appliance.deploy.compiler.targets import target_for

    model = exported / "model.onnx"
    db = tmp_path / "db"
    db.mkdir()
    header = {"made_by": "appliance compile --tune", "model_sha256": sha256_file(model), "target": "x86_64",
              "tvm_target": tuning_target(target_for("x86_64")), "trials_per_task": 1, "tasks": 1, "records": 1,
              "tvm": __import__("tvm").__version__}
    (db / "tuning.json").write_text(json.dumps(header))
    (db / "database_workload.json").write_text("")
    (db / "database_tuning_record.json").write_text('[0, [[["GetSBlock"\n')
    proc = run_appliance("compile", str(model), "--target", "x86_64", "--out", str(tmp_path / "o"),
                         "--tuning-db", str(db))
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"{db / 'database_tuning_record.json'}: line 1: not a MetaSchedule JSON record" in proc.stderr


def test_int8_build_tunes_and_says_so(tmp_path, exported, val_npz):
    """The default int8 compute of a QDQ model goes through MetaSchedule like FP32 does."""
    import numpy as np

    from appliance.deploy.quantize import quantize_int8

    model = tmp_path / "model.int8.onnx"
    quantize_int8(exported / "model.onnx", model, np.load(val_npz)["x"][:16], "input", "minmax", per_channel=True)
    proc = run_appliance("compile", str(model), "--target", "x86_64", "--out", str(tmp_path / "tuned"),
                         "--tune", str(TRIALS), "--samples", str(val_npz))
    assert proc.returncode == 0, proc.stderr
    info = json.loads((tmp_path / "tuned" / "compile.json").read_text())
    header = json.loads((tmp_path / "tuned" / "tuning" / "tuning.json").read_text())
    assert info["layers"]["int8"] == 6 and info["layers"]["simulated"] == 0
    assert info["tuned_tasks"] == header["tasks"] > 0 and info["check"]["passed"]
    # One output step at most: the requantize multiplies by the scale's reciprocal where onnxruntime
    # divides, which moves a value across a rounding boundary now and then; the step measured through
    # float dequantization is 1 within float32 rounding (1.0000005 seen), never 2.
    assert info["check"]["max_quantized_units"] <= 1 + 1e-4 and info["host_latency_ms"] > 0
