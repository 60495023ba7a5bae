"""The held-out re-run of issue 31's campaign on the training and data side, as tests: cases the first
round did not list (a pipe as data, records with no image or two, path values no file system takes,
values of 100,000 characters, lenient integer parsing, flags past any real cluster, --resume values
only a worker refused). Each is one line naming the file, key or flag, exit 2, no traceback.

In-process through appliance.cli.main like tests/test_hardening.py; the pipe case runs the real
command in a subprocess with a timeout, since a hang is what it guards against.
"""

import json
import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

from appliance.cli import main
from data_tools.check.run import run_check
from data_tools.example import encode_example
from data_tools.tfrecord import write_records

sys.path.insert(0, str(Path(__file__).resolve().parent / "train"))
sys.path.insert(0, str(Path(__file__).resolve().parent / "data_tools"))
from conftest import run_appliance  # noqa: E402
from test_check_train_agree import png, train_config  # noqa: E402
from test_hardening import edit_config  # noqa: E402
from train_data import config_over_shared_data, image_records, make_config  # noqa: E402


def one_line(capsys, *argv, code=2) -> str:
    """Run `appliance ARGV`; its stderr must be one error line and its status `code`."""
    try:
        status = main(list(argv))
    except SystemExit as exit_:  # argparse's refusals
        status = exit_.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert status == code and len(lines) == 1, (status, err[-3000:])
    assert "internal error" not in err and "Traceback" not in err
    return lines[0]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("campaign-train")
    make_config(base, train_records=8, val_records=3)
    return base


@pytest.fixture
def config(data_dir, tmp_path):
    return config_over_shared_data(data_dir, tmp_path)


# --- data files ---------------------------------------------------------------------------------

def test_data_check_of_a_pipe_is_one_line_not_a_hang(tmp_path, data_dir):
    """open() of a FIFO blocks until a writer comes: the check's schema sample waited for ever."""
    fifo = tmp_path / "pipe.tfrecord"
    os.mkfifo(fifo)
    for files in ([fifo], [fifo, data_dir / "data" / "train-0.tfrecord"]):
        proc = run_appliance("data", "check", *map(str, files), "--out", str(tmp_path / "out"), "--quiet",
                             timeout=60)  # TimeoutExpired: the hang is back
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert f"{fifo}: is a pipe, not a TFRecord file" in proc.stderr and "Traceback" not in proc.stderr


def test_the_reader_refuses_a_pipe_before_opening_it(tmp_path):
    from appliance.core.errors import DataError
    from data_tools.tfrecord import read_records

    fifo = tmp_path / "pipe.tfrecord"
    os.mkfifo(fifo)

    def hung(signum, frame):
        raise TimeoutError("read_records blocked on the pipe")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)  # blocked in open() before: fail, do not hang the suite
    try:
        with pytest.raises(DataError, match="is a pipe, not a TFRecord file"):
            list(read_records(fifo))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("make, expected", [
    (lambda p: os.symlink(p, p), "Too many levels of symbolic links"),
    (lambda p: os.symlink(p.parent / "gone.tfrecord", p), "No such file or directory"),
])
def test_a_broken_link_listed_as_data_is_named_by_key(capsys, config, tmp_path, make, expected):
    link = tmp_path / "link.tfrecord"
    make(link)
    edit_config(config, "data", f"val = [{json.dumps(str(link))}]")
    line = one_line(capsys, "train", str(config), "--dry-run")
    assert f"{config}: [data] val: {link}: {expected}" in line, line


# --- records: the check passes only what training reads -------------------------------------------

def test_records_without_one_image_are_quarantined_as_training_refuses_them(tmp_path):
    """The check probed the image only when the record held exactly one; with none, or two, or
    numbers under the image key, the record passed (its schema was inferred from the sample), and
    training then refused it."""
    from appliance.train.data import _dataset

    good = png(np.random.default_rng(5).integers(0, 255, (8, 8, 3), dtype=np.uint8))
    odd = [{"image/class/label": 1},
           {"image/encoded": [good, good], "image/class/label": 1},
           {"image/encoded": [1, 2, 3], "image/class/label": 1}]
    records = list(image_records(9, seed=6)) + [encode_example(f) for f in odd]
    write_records(tmp_path / "mixed.tfrecord", records)
    report, _ = run_check([(str(tmp_path / "mixed.tfrecord"), None)], tmp_path / "out", jobs=1, progress=False,
                          num_classes=3)
    assert report["records_valid"] == 9 and report["records_quarantined"] == len(odd), report["checks"]
    clean = [tmp_path / "out" / f["clean_shard"] for f in report["files"] if f.get("clean_shard")]
    dataset = _dataset(train_config(tmp_path, clean, 3, 3), tuple(map(str, clean)))
    assert len(dataset) == report["records_valid"]
    for index in range(len(dataset)):
        dataset[index]  # DataError for a record training refuses

    write_records(tmp_path / "odd.tfrecord", [encode_example(f) for f in odd])
    dataset = _dataset(train_config(tmp_path, [tmp_path / "odd.tfrecord"], 3, 3), (str(tmp_path / "odd.tfrecord"),))
    from appliance.core.errors import DataError
    for number, expected in enumerate(["missing required feature 'image/encoded'", "has 2 values; an image is exactly one",
                                       "holds int64 numbers, not encoded image bytes"]):
        with pytest.raises(DataError, match=expected):
            dataset[number]


@pytest.mark.parametrize("drop", ["image/encoded", "image/class/label"])
def test_a_file_whose_records_all_lack_the_key_passes_nothing(tmp_path, drop):
    """The inferred schema had no image (or label) key when no sampled record held it: every record passed."""
    records = []
    for data in image_records(6, seed=4):
        from data_tools.example import decode_example
        features = {k: v for k, v in decode_example(data).items() if k != drop}
        records.append(encode_example(features))
    write_records(tmp_path / "data.tfrecord", records)
    report, _ = run_check([(str(tmp_path / "data.tfrecord"), None)], tmp_path / "out", jobs=1, progress=False)
    assert report["records_valid"] == 0 and report["records_quarantined"] == 6, report["checks"]


# --- config values --------------------------------------------------------------------------------

LONG = "a" * 5000


@pytest.mark.parametrize("section, line, expected", [
    ("run", f'out_dir = "{LONG}"', "[run] out_dir must be a path of at most 4095 bytes, got 5000 bytes"),
    ("run", f'name = "{"n" * 300}"', "[run] name must have names of at most 255 bytes between its slashes"),
    ("run", 'name = "a\\nb"', "[run] name must not contain a control character ('\\n')"),
    ("run", 'out_dir = "runs\\u001b[31m"', "[run] out_dir must not contain a control character ('\\x1b')"),
    ("data", f'check_report = "{"r" * 300}.json"', "[data] check_report must have names of at most 255 bytes"),
    ("data", 'check_report = "a\\nb"', "[data] check_report must not contain a control character"),
    ("model", f'init = "{"w" * 300}.safetensors"', "[model] init must have names of at most 255 bytes"),
    ("data", f'train = ["{"t" * 300}/*.tfrecord"]', "[data] train[0] must have names of at most 255 bytes"),
    ("data", "train = []", "[data] train lists no file"),
    ("data", 'classes = ["left", "", "top"]', "[data] classes has an empty name"),
    ("data", 'classes = ["left", "left", "top"]', "[data] classes names 'left' twice"),
])
def test_path_and_name_values_no_file_system_takes_are_one_line(capsys, config, section, line, expected):
    edit_config(config, section, line)
    message = one_line(capsys, "train", str(config), "--dry-run")
    assert message.startswith(f"appliance train: error: {config}: ") and expected in message, message


@pytest.mark.parametrize("section, line, expected", [
    ("run", 'seed = "' + "s" * 100000 + '"', "[run] seed must be an integer, got 'sss"),
    ("data", "mean = [" + ", ".join(["0.5"] * 5000) + "]", "[data] mean needs 1 values"),
    ("data", "image_size = [" + ", ".join(["1"] * 5000) + "]", "[data] image_size must be an integer, got [1, 1"),
    ("model", 'architecture = "' + "x" * 100000 + '"', "[model] architecture 'xxx"),
])
def test_a_huge_value_makes_a_short_line(capsys, config, section, line, expected):
    edit_config(config, section, line)
    message = one_line(capsys, "train", str(config), "--dry-run")
    assert expected in message and len(message) < 5000, message[:300]


def test_an_unknown_interface_names_the_key_or_the_flag(capsys, config):
    edit_config(config, "distributed", 'iface = "nosuch0"')
    assert f"{config.resolve()}: [distributed] iface: network interface 'nosuch0' does not exist" in one_line(
        capsys, "train", str(config), "--dry-run")
    assert "error: --iface: network interface 'nosuch1' does not exist" in one_line(
        capsys, "train", str(config), "--dry-run", "--iface", "nosuch1")


# --- flags ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, expected", [
    (["--nproc-per-node", "100000"], "--nproc-per-node: must be 'auto' or a number of processes from 1 to 1024"),
    (["--nproc-per-node", " 2"], "--nproc-per-node: must be 'auto' or a number of processes"),
    (["--nproc-per-node", "\u0663"], "--nproc-per-node: must be 'auto' or a number of processes"),
    (["--nproc-per-node", "1_0"], "--nproc-per-node: must be 'auto' or a number of processes"),
    (["--nnodes", "100000", "--rdzv-endpoint", "h:1"], "--nnodes: must be at most 16384 nodes"),
    (["--max-restarts", "9" * 23], "--max-restarts: must be at most 1000"),
    (["--profile", "9" * 23], "--profile: must be at most 100000"),
    (["--node-rank", "1_0"], "--node-rank: must be an integer, got '1_0'"),
    (["--node-rank", " 1"], "--node-rank: must be an integer, got ' 1'"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:29400:1"], "--rdzv-endpoint 'h:29400:1': expected HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1_0"], "(PORT must be 1..65535)"),
    (["--nnodes", "2", "--rdzv-endpoint", "h: 29400"], "(PORT must be 1..65535)"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:\u0663\u0663"], "(PORT must be 1..65535)"),
    (["--nnodes", "2", "--rdzv-endpoint", "a" * 300 + ":1"], "(HOST must be a host name"),
    (["--nnodes", "2", "--rdzv-endpoint", "[not-v6]:1"], "(HOST must be a host name"),
    (["--resume", "banana"], "--resume 'banana': expected auto, none or a checkpoint directory"),
    (["--resume", "/dev/null"], "--resume '/dev/null': expected auto, none or a checkpoint directory"),
    (["--resume", "RUN"], "--resume"),  # a directory, not a step-NNNNNNNN checkpoint
])
def test_absurd_flags_are_refused_before_torchrun(capsys, config, flags, expected):
    flags = [str(config.parent) if f == "RUN" else f for f in flags]
    line = one_line(capsys, "train", str(config), "--dry-run", *flags)
    assert expected in line and line.startswith("appliance train: error: "), line


def test_a_good_ipv6_endpoint_still_dry_runs(capsys, config):
    assert main(["train", str(config), "--dry-run", "--nnodes", "2", "--rdzv-endpoint", "[fe80::1%eth0]:29400"]) == 0
    assert "[fe80::1%eth0]:29400" in capsys.readouterr().out


def test_train_slurm_refuses_a_process_count_that_is_shell(capsys, config):
    line = one_line(capsys, "train", "slurm", str(config), "--nodes", "2", "--nproc-per-node", "$(reboot)")
    assert "--nproc-per-node: must be 'auto' or a number of processes" in line


@pytest.mark.parametrize("section, line, expected", [
    ("pipeline", 'nproc_per_node = "two"', "[pipeline] nproc_per_node must be 'auto' or a number of processes"),
    ("quantize", 'method = "banana"', "[quantize] method must be minmax, entropy, percentile, got 'banana'"),
    ("pipeline", f'out = "{LONG}"', "[pipeline] out must be a path of at most 4095 bytes"),
])
def test_pipeline_values_a_later_stage_refused_are_refused_at_load(capsys, config, section, line, expected):
    edit_config(config, section, line)
    message = one_line(capsys, "pipeline", str(config))
    assert expected in message, message


@pytest.mark.parametrize("flags, expected", [
    (["--out", "/dev/null"], "--out: /dev/null exists and is not a directory"),
    (["--out", "/proc/no-such-dir"], "/proc/no-such-dir"),  # root: mkdir fails; others: /proc is not writable
    (["--epochs", "1_0"], "--epochs: must be an integer, got '1_0'"),
    (["--epochs", "9" * 23], "--epochs: must be at most 100000"),
])
def test_demo_flags_are_refused_before_any_shard_is_written(capsys, flags, expected):
    line = one_line(capsys, "demo", *flags)
    assert expected in line, line


# --- data verbs' flags and outputs ----------------------------------------------------------------

def bomb_png(width: int, height: int) -> bytes:
    """A valid 1-bit PNG of width x height zero pixels, a few hundred bytes (Pillow refuses to open it)."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = zlib.compress(b"\0" * (1 + (width + 7) // 8) * min(height, 4096), 9)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", rows) + chunk(b"IEND", b""))


@pytest.mark.parametrize("flags, expected", [
    (["--size", "1000000"], "--size: must be at most 1024"),  # MemoryError
    (["--variants", "100000000"], "--variants: must be at most 32"),  # OverflowError in Pillow
    (["--count", "256", "--size", "1024"], "make a grid of 5144x263172 pixels; at most 64 M pixels"),
    (["--degrees", "1e300"], "--degrees: must be at most 180"),
    (["--saturation", "5"], "--saturation: must be less than 1"),
    (["--out", "DIR"], "is a directory; give the file to write"),  # IsADirectoryError
])
def test_preview_flags_past_any_grid_are_one_line(capsys, data_dir, tmp_path, flags, expected):
    out = ["--out", str(tmp_path / "p.png")] if "--out" not in flags else []
    flags = [str(tmp_path) if f == "DIR" else f for f in flags]
    line = one_line(capsys, "data", "preview", str(data_dir / "data" / "train-0.tfrecord"), *out, *flags)
    assert expected in line, line


def test_preview_skips_a_decompression_bomb_like_any_undecodable_image(tmp_path):
    """Pillow's DecompressionBombError was an internal error. A subprocess: this test process may have
    imported data_tools.check.image_probe, which turns Pillow's own guard off (it checks max_pixels)."""
    records = [encode_example({"image/encoded": bomb_png(200000, 200000), "image/class/label": 0})]
    records += list(image_records(2, seed=8))
    write_records(tmp_path / "bomb.tfrecord", records)
    proc = run_appliance("data", "preview", str(tmp_path / "bomb.tfrecord"), "--out", str(tmp_path / "p.png"),
                         timeout=120)
    assert proc.returncode == 0 and "wrote" in proc.stdout and "2 records" in proc.stdout, proc.stderr[-2000:]


def test_no_output_replaces_a_device_or_a_pipe(capsys, config, data_dir, tmp_path):
    """As root, `data preview --out /dev/null` renamed its PNG over /dev/null: the device was gone (found
    by this campaign, the hard way). A pipe stands in for the device here (the same refusal)."""
    from appliance.core.errors import ConfigError
    from appliance.core.manifest import atomic_write_text

    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    assert "exists and is not a regular file" in one_line(
        capsys, "data", "preview", str(data_dir / "data" / "train-0.tfrecord"), "--out", str(fifo))
    assert "exists and is not a regular file" in one_line(capsys, "train", "slurm", str(config), "--nodes", "2",
                                                          "--out", str(fifo))
    with pytest.raises(ConfigError, match="is a pipe; refusing to replace it with a file"):
        atomic_write_text(fifo, "text")
    from data_tools.preview import write_preview
    with pytest.raises(ConfigError, match="is a pipe; refusing to replace it"):
        write_preview(data_dir / "data" / "train-0.tfrecord", fifo)
    assert os.path.exists(fifo) and not os.path.isfile(fifo)  # still the pipe


@pytest.mark.parametrize("prefix", ["../../escaped", "a/b", "", ".hidden"])
def test_convert_prefix_is_a_file_name_in_out(capsys, tmp_path, prefix):
    """'../../escaped' wrote the shards two directories above --out; 'a/b' was an internal error."""
    from PIL import Image

    for label in ("a", "b"):
        (tmp_path / "images" / label).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(np.random.default_rng(i).integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(
                tmp_path / "images" / label / f"{i}.png")
    out = tmp_path / "deep" / "er" / "out"
    line = one_line(capsys, "data", "convert", str(tmp_path / "images"), "--out", str(out), f"--prefix={prefix}")
    assert "--prefix: must be the start of a file name" in line, line
    assert not list(tmp_path.rglob("*.tfrecord"))


@pytest.mark.parametrize("flags, expected", [
    (["--jobs", "100000"], "--jobs: must be at most 256"),  # forked until the box gave out
    (["--num-classes", "999999999"], "--num-classes: must be at most 100000"),
    (["--ignore-label", "99999999999"], "--ignore-label: must be at most 255"),
])
def test_data_check_flags_are_bounded(capsys, data_dir, tmp_path, flags, expected):
    line = one_line(capsys, "data", "check", str(data_dir / "data" / "train-0.tfrecord"), "--out",
                    str(tmp_path / "out"), *flags)
    assert expected in line, line


def test_convert_out_that_is_a_pipe_is_refused(capsys, tmp_path):
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    (tmp_path / "images" / "a").mkdir(parents=True)
    assert "exists and is not a directory" in one_line(capsys, "data", "convert", str(tmp_path / "images"),
                                                       "--out", str(fifo))


def test_a_config_that_is_a_loop_of_links_is_one_line_for_every_verb(capsys, tmp_path):
    loop = tmp_path / "loop.toml"
    os.symlink(loop, loop)
    for argv in (["train", str(loop), "--dry-run"], ["pipeline", str(loop)], ["train", "slurm", str(loop), "--nodes", "2"]):
        line = one_line(capsys, *argv)  # train slurm: an internal RuntimeError from Path.resolve()
        assert f"'{loop}': cannot read the" in line and "Too many levels of symbolic links" in line, line


def test_train_slurm_without_out_writes_into_the_run_directory(capsys, config):
    assert main(["train", "slurm", str(config), "--nodes", "2"]) == 0
    assert capsys.readouterr().out.strip().endswith("campaign/train.sbatch")


@pytest.mark.parametrize("key", ["image_key", "label_key"])
def test_a_feature_key_the_data_lacks_is_refused_by_the_dry_run(capsys, config, key):
    """Every worker refused it at its first record; --dry-run said the run would start."""
    edit_config(config, "data", f'{key} = "image/nowhere"')
    line = one_line(capsys, "train", str(config), "--dry-run")
    assert f"[data] {key} 'image/nowhere' is no feature of the first record of" in line, line
    assert "'image/class/label', 'image/class/text', 'image/encoded', 'image/format'" in line


def test_a_loss_that_overflows_is_the_guards_one_line(tmp_path):
    """lr = 1e300: the guard's line came after tensorboardX's 'NaN or Inf found in input tensor.' Such an
    lr is refused by the config now ([optimizer] lr is at most 10); a non-finite loss (the test hook's, at
    the second step, after the first validation was logged) is still the guard's one line."""
    config = make_config(tmp_path, train_records=8, val_records=3, optimizer={"lr": 1e300})
    proc = run_appliance("train", str(config), "--quiet", timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().endswith("[optimizer] lr must be at most 10, got 1e+300")
    # One step per epoch (8 records, batch 16): the second step's loss stops the run.
    config = make_config(tmp_path, train_records=8, val_records=3)
    proc = run_appliance("train", str(config), "--quiet", timeout=300,
                         env={**os.environ, "APPLIANCE_TEST_FAULT": "nan-loss:2:0"})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "the training loss is not finite" in lines[0] and "Traceback" not in proc.stderr


@pytest.mark.parametrize("damage, expected", [
    (lambda p: p.write_bytes(bytes(range(256))), "not an index file"),  # UnicodeDecodeError
    (lambda p: p.write_text("0 269\n-5 270\n"), "a damaged index (a negative offset)"),
    (lambda p: p.write_text("0 269\n99999999999999 269\n"), "a damaged index (a record past the end of its"),
    (lambda p: p.write_text("0 269\n100 270\n"), "a damaged index (records out of order or overlapping)"),
    (lambda p: p.write_text("0 269\n" + "1076 5\n" * 100000), "a TFRecord index of more than"),
    (lambda p: p.write_text(""), "a damaged index (empty, for a"),
    (lambda p: (p.unlink(), p.mkdir()), "is a directory, not a TFRecord index"),  # IsADirectoryError
    (lambda p: (p.unlink(), os.mkfifo(p)), "is a pipe, not a TFRecord index"),  # hung
    (lambda p: os.truncate(p, 4 << 30), "a TFRecord index of more than"),  # MemoryError
])
def test_a_damaged_index_is_one_line_before_torchrun(capsys, config, data_dir, tmp_path, damage, expected):
    import shutil

    from data_tools.index import build_index

    data = tmp_path / "own"
    data.mkdir()
    for name in ("train-0.tfrecord", "val-0.tfrecord"):
        shutil.copy(data_dir / "data" / name, data / name)  # a copy: its index is this test's to damage
    edit_config(config, "data", f'train = ["{data}/train-0.tfrecord"]')
    edit_config(config, "data", f'val = ["{data}/val-0.tfrecord"]')
    index = build_index(data / "train-0.tfrecord")
    damage(index)
    line = one_line(capsys, "train", str(config), "--dry-run")
    assert f"{index}: " in line and expected in line, line
