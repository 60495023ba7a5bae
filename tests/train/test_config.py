"""Training configs: the example parses, every mistake is one line naming the file and key."""

import shutil
from pathlib import Path

import pytest

from appliance.core.errors import ConfigError, DataError
from appliance.train.config import check_data_report, load_config
from conftest import ROOT, run_appliance

MINIMAL = """
[run]
name = "r1"
[data]
train = ["train-*.tfrecord"]
classes = ["a", "b"]
"""


@pytest.fixture
def cfg_dir(tmp_path):
    (tmp_path / "train-0.tfrecord").write_bytes(b"")
    (tmp_path / "train-1.tfrecord").write_bytes(b"")
    return tmp_path


def _write(cfg_dir: Path, text: str) -> Path:
    path = cfg_dir / "train.toml"
    path.write_text(text)
    return path


def test_minimal_config_gets_defaults_and_resolved_paths(cfg_dir):
    cfg = load_config(_write(cfg_dir, MINIMAL))
    assert cfg.data.train == (str(cfg_dir / "train-0.tfrecord"), str(cfg_dir / "train-1.tfrecord"))
    assert cfg.run_dir == cfg_dir / "runs" / "r1"
    assert cfg.num_classes == 2 and cfg.model.architecture == "small_cnn" and cfg.train.precision == "auto"


def test_example_config_is_valid(tmp_path):
    example = tmp_path / "examples"
    shutil.copytree(ROOT / "examples", example)
    data = example / "data" / "checked"
    data.mkdir(parents=True)
    for name in ("train-0.tfrecord", "val-0.tfrecord"):
        (data / name).write_bytes(b"")
    cfg = load_config(example / "train.toml")
    assert cfg.model.architecture == "resnet18" and cfg.num_classes == 5 and cfg.checkpoint.keep_last == 3


@pytest.mark.parametrize("extra, message", [
    ("[train]\nbatchsize = 8", "[train] unknown key 'batchsize' (known keys: epochs, max_steps, batch_size"),
    ("[train]\nbatch_size = \"8\"", "[train] batch_size must be an integer, got '8'"),
    ("[train]\nbatch_size = 8.5", "[train] batch_size must be an integer, got 8.5"),
    ("[optimizer]\nlr = \"fast\"", "[optimizer] lr must be a number, got 'fast'"),
    ("[run.extra]\nx = 1", "[run] unknown key 'extra'"),
    ("[trian]\nepochs = 1", "unknown section [trian]"),
    ("[model]\narchitecture = \"resnet9\"", "[model] architecture 'resnet9' is not one of small_cnn, resnet18"),
    ("[train]\nprecision = \"fp8\"", "[train] precision 'fp8' is not one of auto, fp32, bf16, fp16"),
    ("[model]\nfrozen_prefixes = \"conv1\"", "[model] frozen_prefixes must be a list of strings"),
    ("[run.deterministic]", "[run] deterministic must be true or false, got {}"),
])
def test_mistakes_name_the_file_and_key(cfg_dir, extra, message):
    path = _write(cfg_dir, MINIMAL + extra)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: ")
    assert message in str(err.value)


def test_missing_files_and_sections(cfg_dir):
    with pytest.raises(ConfigError, match=r"\[data\] train: 'nope-\*\.tfrecord' matches no file"):
        load_config(_write(cfg_dir, MINIMAL.replace("train-*", "nope-*")))
    with pytest.raises(ConfigError, match=r"missing section \[data\]"):
        load_config(_write(cfg_dir, "[run]\nname = \"x\"\n"))
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(_write(cfg_dir, "[run\n"))
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(cfg_dir / "absent.toml")


def test_cli_prints_one_line_for_a_bad_config(cfg_dir):
    path = _write(cfg_dir, MINIMAL + "[train]\nbatchsize = 8\n")
    proc = run_appliance("train", str(path), "--dry-run")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(f"appliance train: error: {path}: [train] unknown key 'batchsize'")


def _checked(cfg_dir, fail_on):
    """A real `appliance data check` report over real records, and a config requiring it."""
    from data_tools.check.run import run_check
    from data_tools.tfrecord import write_records
    from train_data import image_records

    data = cfg_dir / "train-0.tfrecord"
    write_records(data, image_records(24, seed=0))
    with open(data, "ab") as f:
        f.write(b"\x00" * 40)  # a damaged tail: the check reports it as corrupt
    report, _ = run_check([(str(data), "train")], cfg_dir / "check", fail_on=fail_on, progress=False)
    return load_config(_write(cfg_dir, MINIMAL + 'check_report = "check/report.json"\n')), report


def test_required_data_check_report(cfg_dir):
    cfg, report = _checked(cfg_dir, fail_on="quarantined_fraction>0.5")
    assert check_data_report(cfg)["records_valid"] == report["records_valid"] == 24
    cfg, _ = _checked(cfg_dir, fail_on="corrupt>0")
    with pytest.raises(DataError, match="data check gate failed"):
        check_data_report(cfg)
    cfg, _ = _checked(cfg_dir, fail_on=None)
    with pytest.raises(DataError, match="ran without --fail-on"):
        check_data_report(cfg)
    (cfg_dir / "check" / "report.json").unlink()
    with pytest.raises(ConfigError, match="check_report: .* does not exist"):
        check_data_report(cfg)


@pytest.mark.parametrize("extra, message", [
    ("[optimizer]\nlr = inf", "[optimizer] lr must be a finite number, got inf"),
    ("[optimizer]\nlr = nan", "[optimizer] lr must be a finite number, got nan"),
    ("[optimizer]\nlr = 0", "[optimizer] lr must be greater than 0, got 0.0"),
    ("[optimizer]\nlr = -1e-3", "[optimizer] lr must be greater than 0, got -0.001"),
    ("[optimizer]\nweight_decay = -0.1", "[optimizer] weight_decay must be at least 0, got -0.1"),
    ("[optimizer]\nbetas = [0.9, nan]", "[optimizer] betas[1] must be a finite number, got nan"),
    ("[optimizer]\nmomentum = 1.5", "[optimizer] momentum must be less than 1, got 1.5"),
    ("[schedule]\nmin_lr_ratio = 2.0", "[schedule] min_lr_ratio must be at most 1, got 2.0"),
    ("[schedule]\nwarmup_steps = -5", "[schedule] warmup_steps must be at least 0, got -5"),
    ("[train]\ngrad_clip = -inf", "[train] grad_clip must be a finite number, got -inf"),
    ("[train]\nepochs = -1", "[train] epochs must be at least 0, got -1"),
    ("[train]\nmax_steps = -10", "[train] max_steps must be at least 0, got -10"),
    ("[train]\nbatch_size = 0", "[train] batch_size must be at least 1, got 0"),
    ("[data]\nnum_workers = -2", "[data] num_workers must be at least 0, got -2"),
    ("[data]\nstd = [0.0]\nchannels = 1\nmean = [0.5]", "[data] std[0] must be greater than 0, got 0.0"),
    ("[data]\nmean = [nan, 0.5, 0.5]", "[data] mean[0] must be a finite number, got nan"),
    ("[checkpoint]\nkeep_best = -1", "[checkpoint] keep_best must be at least 0, got -1"),
    ("[checkpoint]\nmin_free_gb = nan", "[checkpoint] min_free_gb must be a finite number, got nan"),
    ("[augment]\nflip_probability = 1.5", "[augment] flip_probability must be at most 1, got 1.5"),
    ("[augment]\nhue = nan", "[augment] hue must be a finite number, got nan"),
    ("[run]\nseed = -1", "[run] seed must be at least 0, got -1"),
    ("[distributed]\nbucket_cap_mb = 0", "[distributed] bucket_cap_mb must be greater than 0, got 0.0"),
    ("[distributed]\nbucket_cap_mb = 2048", "[distributed] bucket_cap_mb must be at most 1024, got 2048.0"),
])
def test_numbers_outside_their_range_are_refused_at_load_naming_the_key(cfg_dir, extra, message):
    # A TOML table may be written once: keys for MINIMAL's [run] and [data] go into them.
    header, keys = extra.split("\n", 1)
    text = MINIMAL.replace(f"{header}\n", f"{header}\n{keys}\n") if header in MINIMAL else MINIMAL + extra
    path = _write(cfg_dir, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: {message}"


def test_binary_or_non_utf8_or_directory_config_is_one_line(cfg_dir):
    path = cfg_dir / "train.toml"
    path.write_bytes(b"[run]\nname = \"r\xe9\"\n")  # Latin-1, not UTF-8
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: not a TOML text file (byte 15 is not UTF-8)"
    path.write_bytes(bytes(range(256)))
    with pytest.raises(ConfigError, match="not a TOML text file"):
        load_config(path)
    with pytest.raises(ConfigError) as err:
        load_config(cfg_dir)
    assert str(err.value) == f"{cfg_dir}: is a directory, not a config file"
    proc = run_appliance("train", str(path), "--dry-run")
    assert proc.returncode == 2 and proc.stderr == f"appliance train: error: {path}: not a TOML text file (byte 128 is not UTF-8)\n"


def test_bucket_size_is_in_the_training_hash_and_bucket_views_are_not(cfg_dir):
    def training_hash(extra=""):
        return load_config(_write(cfg_dir, MINIMAL + extra)).training_hash()

    plain = training_hash()
    # The default is DDP's own: writing it down (even as an integer) continues the same run.
    assert training_hash("[distributed]\nbucket_cap_mb = 25") == plain
    # Another layout sums the gradients in another order (other bits on 3 or more processes).
    assert training_hash("[distributed]\nbucket_cap_mb = 0.01") != plain
    assert training_hash("[distributed]\ngradient_as_bucket_view = true\niface = \"lo\"") == plain
