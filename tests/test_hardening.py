"""The adversarial campaign of issue 31, as tests: each case a user or an attacker tried is one line
(`appliance VERB: error: ...`), exit 2, no traceback, no "internal error", and fast.

In-process through appliance.cli.main (a subprocess per case would cost a second of imports each).
"""

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from appliance.cli import main
from data_tools.example import encode_example
from data_tools.tfrecord import write_records

sys.path.insert(0, str(Path(__file__).resolve().parent / "train"))
from train_data import config_over_shared_data, image_records, make_config  # noqa: E402


def one_line(capsys, *argv, code=2) -> str:
    """Run `appliance ARGV`; its stderr must be one error line and its status `code`."""
    status = main(list(argv))
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert status == code and len(lines) == 1, (status, err[-3000:])
    assert "internal error" not in err and "Traceback" not in err
    return lines[0]


def edit_config(path: Path, section: str, line: str) -> Path:
    """Put `line` (TOML) at the end of [section], replacing a key of the same name."""
    key = line.split("=", 1)[0].strip()
    out, current = [], None
    for text in path.read_text().splitlines():
        if text.startswith("["):
            if current == section:
                out.append(line)
            current = text.strip("[]")
        elif current == section and text.split("=", 1)[0].strip() == key:
            continue
        out.append(text)
    if current == section:
        out.append(line)
    elif f"[{section}]" not in out:
        out += [f"[{section}]", line]
    path.write_text("\n".join(out) + "\n")
    return path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """One small real dataset shared by the config cases (they differ only in their config)."""
    base = tmp_path_factory.mktemp("campaign")
    make_config(base, train_records=8, val_records=3)
    return base


@pytest.fixture
def config(data_dir, tmp_path):
    return config_over_shared_data(data_dir, tmp_path)


@pytest.mark.parametrize("section, line, expected", [
    ("run", "seed = 9223372036854775807", "[run] seed must be at most 4294967295"),
    ("checkpoint", "min_free_gb = 1e300", "[checkpoint] min_free_gb must be at most 1000000"),
    ("optimizer", "lr = " + "9" * 400, "[optimizer] lr must be a finite number, got an integer of 400 digits"),
    ("train", "max_steps = " + "9" * 40, "[train] max_steps must be at most 1000000000"),
    ("run", 'name = "a\\u0000b"', "[run] name must not contain a NUL character"),
    ("run", 'out_dir = "runs\\u0000x"', "[run] out_dir must not contain a NUL character"),
    ("distributed", 'env = {NCCL_DEBUG = "IN\\u0000FO"}', "[distributed] env.NCCL_DEBUG must not contain a NUL"),
    ("distributed", 'env = {"A=B" = "1"}', "[distributed] env key 'A=B' is not an environment variable name"),
    ("distributed", 'env = {"A\\u0000" = "1"}', "[distributed] env key 'A\\x00' must not contain a NUL"),
    ("checkpoint", 'monitor = "banana"', "[checkpoint] monitor 'banana' is not one of val_loss, val_acc"),
    ("data", "image_size = 1000000", "[data] image_size must be at most 4096, got 1000000"),
    ("data", "num_classes = 4000000000", "[data] num_classes must be at most 100000, got 4000000000"),
    ("data", 'image_key = ""', "[data] image_key must name a feature, got an empty string"),
    ("data", "num_workers = 100000", "[data] num_workers must be at most 256"),
    ("train", "batch_size = 10000000", "[train] batch_size must be at most 65536"),
])
def test_bad_values_are_one_line_naming_key_and_bound(capsys, config, section, line, expected):
    edit_config(config, section, line)
    message = one_line(capsys, "train", str(config), "--dry-run")
    assert message.startswith(f"appliance train: error: {config}: ") and expected in message, message


def test_nested_arrays_are_one_line(capsys, config):
    config.write_text(config.read_text() + "[profile]\nsteps = " + "[" * 2000 + "]" * 2000 + "\n")
    assert "nested too deeply" in one_line(capsys, "train", str(config), "--dry-run")


@pytest.mark.parametrize("what, expected", [
    ("/dev/zero", "/dev/zero: is a device, not a config file"),
    ("dir", "is a directory, not a config file"),
])
def test_a_config_that_is_no_file_is_refused_before_reading(capsys, tmp_path, what, expected):
    path = "/dev/zero" if what == "/dev/zero" else str(tmp_path)
    started = time.monotonic()
    assert one_line(capsys, "train", path, "--dry-run").endswith(expected)
    assert time.monotonic() - started < 5  # not read: /dev/zero never ends


def test_a_config_too_large_to_be_one_is_refused(capsys, tmp_path):
    path = tmp_path / "big.toml"
    path.write_bytes(b"# padding\n" * (1 << 20))  # 10 MiB of valid TOML comments
    assert "big.toml: a config file of more than 4 MiB" in one_line(capsys, "train", str(path), "--dry-run")


@pytest.mark.parametrize("entry, expected", [
    ("/dev/zero", "/dev/zero is a device, not a TFRecord file"),
    ("DIR", "is a directory, not a TFRecord file"),
])
def test_data_that_is_no_file_is_named_as_what_it_is(capsys, config, tmp_path, entry, expected):
    entry = str(tmp_path) if entry == "DIR" else entry
    edit_config(config, "data", f"train = [{json.dumps(entry)}]")
    assert expected in one_line(capsys, "train", str(config), "--dry-run")


def test_dry_run_opens_the_data_files_as_a_real_start_does(capsys, config, tmp_path):
    notes = tmp_path / "notes.tfrecord"
    notes.write_text("these are my notes, not TFRecords\n")
    edit_config(config, "data", f"val = [{json.dumps(str(notes))}]")
    assert f"{notes}: not a TFRecord file" in one_line(capsys, "train", str(config), "--dry-run")


def test_dry_run_refuses_a_binary_check_report(capsys, config, tmp_path):
    report = tmp_path / "report.json"
    report.write_bytes(bytes(range(256)) * 4)
    edit_config(config, "data", f"check_report = {json.dumps(str(report))}")
    assert f"{report}: not a data check report" in one_line(capsys, "train", str(config), "--dry-run")


@pytest.mark.parametrize("flags, expected", [
    (["--nnodes", "2", "--node-rank", "5", "--rdzv-endpoint", "127.0.0.1:29400"],
     "--node-rank 5 is not a node of --nnodes 2 (ranks 0..1)"),
    (["--nnodes", "2", "--rdzv-endpoint", "not a host:99999"], "--rdzv-endpoint 'not a host:99999': expected HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "not a host:29400"], "--rdzv-endpoint 'not a host:29400': expected HOST:PORT"),
])
def test_node_flags_that_cannot_meet_are_refused_before_a_rendezvous(capsys, config, flags, expected):
    assert expected in one_line(capsys, "train", str(config), "--dry-run", *flags)


def test_a_good_config_still_dry_runs(capsys, config):
    assert main(["train", str(config), "--dry-run"]) == 0
    assert "appliance.train.agent" in capsys.readouterr().out


def test_an_onnx_init_without_architecture_means_architecture_onnx(config, tmp_path):
    import onnx
    from onnx import TensorProto, helper

    from appliance.train.config import load_config

    node = helper.make_node("Flatten", ["input"], ["logits"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 1, 8, 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 64])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "vendor.onnx"))
    config.write_text(config.read_text().replace('architecture = "small_cnn"', 'init = "vendor.onnx"'))
    cfg = load_config(config)
    assert (cfg.model.architecture, cfg.model.init) == ("onnx", str(tmp_path / "vendor.onnx"))
    # Said otherwise, the intent is not clear: one line.
    config.write_text(config.read_text() + '')
    edit_config(config, "model", 'architecture = "resnet18"')
    from appliance.core.errors import ConfigError

    with pytest.raises(ConfigError, match='"onnx" goes with an ONNX init'):
        load_config(config)


def test_argparse_mistakes_are_one_error_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["export", "--opset", "999"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and "usage:" not in err
    assert err.startswith("appliance export: error: ")


@pytest.mark.parametrize("opset", ["999", "1"])
def test_export_opset_outside_the_exporters_is_refused(capsys, opset):
    with pytest.raises(SystemExit):
        main(["export", "run", "--out", "out", "--opset", opset])
    err = capsys.readouterr().err
    assert "--opset: must be" in err and ("at most 20" in err or "at least 7" in err)


@pytest.mark.parametrize("section, line, expected", [
    ("export", "opset = 999", "[export] opset must be at most 20, got 999"),
    ("export", "opset = 1", "[export] opset must be at least 7, got 1"),
    ("pipeline", 'out = "a-file"', "[pipeline] out: "),
])
def test_pipeline_values_fail_before_training(capsys, config, section, line, expected):
    (config.parent / "a-file").write_text("not a directory\n")
    edit_config(config, section, line)
    started = time.monotonic()
    assert expected in one_line(capsys, "pipeline", str(config))
    assert time.monotonic() - started < 20 and not (config.parent / "pipeline-out").exists()


@pytest.mark.parametrize("flag", ["--image-key", "--label-key"])
def test_data_check_refuses_an_empty_feature_key(capsys, data_dir, tmp_path, flag):
    line = one_line(capsys, "data", "check", str(data_dir / "data" / "val-0.tfrecord"), "--out",
                    str(tmp_path / "out"), flag, "")
    assert line == f"appliance data check: error: data check: {flag} must name a feature, got ''"


@pytest.mark.parametrize("path, expected", [("/dev/null", "is a device, not a file"),
                                            ("DIR", "is a directory, not a file")])
def test_data_index_says_what_a_non_file_is(capsys, tmp_path, path, expected):
    path = str(tmp_path) if path == "DIR" else path
    assert one_line(capsys, "data", "index", path) == f"appliance data index: error: {path}: {expected}"


def test_a_huge_label_is_quarantined_without_allocating(capsys, tmp_path):
    """A label of 2^62 once made the check count 2^62 classes (4 GB in 24 s)."""
    import resource

    records = list(image_records(12, seed=4))
    records.append(encode_example({"image/encoded": b"x", "image/class/label": 2**62}))
    write_records(tmp_path / "data.tfrecord", records)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    status = main(["data", "check", str(tmp_path / "data.tfrecord"), "--out", str(tmp_path / "out"),
                   "--no-progress", "--jobs", "1"])
    assert status == 0 and time.monotonic() - started < 20
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 500_000  # KiB
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["records_quarantined"] == 1 and report["records_valid"] == 12
    reasons = (tmp_path / "out" / "quarantine" / "reasons.jsonl").read_text()
    assert f"image/class/label = {2**62} outside" in reasons


@pytest.mark.parametrize("out, expected", [("DIR", "is a directory; give the file to write"),
                                           ("FILE/x.tar", "is not a writable directory")])
def test_package_out_that_cannot_be_the_package_is_refused_before_work(capsys, tmp_path, out, expected):
    (tmp_path / "FILE").write_text("a file\n")
    out = str(tmp_path) if out == "DIR" else str(tmp_path / out)
    with pytest.raises(SystemExit) as exit_:
        main(["package", str(tmp_path), "--target", "aarch64", "--out", out])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and expected in err, err


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null"])
def test_data_check_says_a_device_is_one_and_reads_nothing(capsys, tmp_path, device):
    started = time.monotonic()
    status = main(["data", "check", device, "--out", str(tmp_path / "out"), "--no-progress", "--jobs", "1"])
    err = capsys.readouterr().err
    assert status == 2 and time.monotonic() - started < 10
    assert f"appliance data check: error: {device}: is a device, not a TFRecord file" in err.splitlines()
