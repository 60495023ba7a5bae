"""`appliance data convert IMAGE_DIR --val-fraction F`: a seeded, stratified split with near
duplicates kept on one side, proven on real image files and on the shards it writes."""

import json

import numpy as np
from PIL import Image

from conftest import run_appliance
from data_tools.check.stage import check_stage
from data_tools.example import decode_example
from data_tools.tfrecord import read_records

COUNTS = {"ant": 23, "bee": 17, "cow": 11}  # val at 0.2: 4.6, 3.4 and 2.2 images


def _save(array: np.ndarray, path, fmt="PNG", **kw):
    Image.fromarray(array.astype(np.uint8), mode="RGB").save(path, format=fmt, **kw)


def make_folder(root):
    """Distinct noise images per class, a near-duplicate pair (a JPEG re-encode, brighter) in "ant"
    and an exact copy in "bee"."""
    rng = np.random.default_rng(0)
    for name, n in COUNTS.items():
        (root / name).mkdir(parents=True)
        for i in range(n):
            _save(rng.integers(0, 256, (32, 32, 3)), root / name / f"{i:02d}.png")
    original = np.asarray(Image.open(root / "ant" / "00.png"), dtype=np.int16)
    (root / "ant" / "00.png").unlink()  # replace one image with the re-encoded twin: counts stay
    _save(original, root / "ant" / "00.png")
    _save(np.clip(original + 12, 0, 255), root / "ant" / "00-copy.jpg", fmt="JPEG", quality=85)
    (root / "ant" / "01.png").unlink()
    (root / "bee" / "exact-copy.png").write_bytes((root / "bee" / "00.png").read_bytes())
    (root / "bee" / "01.png").unlink()
    return root


def _split_of(out):
    """{encoded image bytes: (split, class)} read back from the shards."""
    found = {}
    for shard in sorted(out.glob("*.tfrecord")):
        for record in read_records(shard, strict=True):
            ex = decode_example(record)
            found[ex["image/encoded"][0]] = (shard.name.split("-")[0], ex["image/class/text"][0].decode())
    return found


def _images_in(shard):
    return [decode_example(r)["image/encoded"][0] for r in read_records(shard, strict=True)]


def test_split_is_stratified_deterministic_and_keeps_near_duplicates_together(tmp_path):
    images = make_folder(tmp_path / "images")
    runs = {}
    for name, seed in (("a", "3"), ("b", "3"), ("c", "4")):
        out = tmp_path / name
        proc = run_appliance("data", "convert", str(images), "--out", str(out), "--val-fraction", "0.2",
                             "--seed", seed, "--shards", "2", offline=True)
        assert proc.returncode == 0, proc.stderr
        runs[name] = (out, proc)
    out, proc = runs["a"]
    assert sorted(p.name for p in out.glob("*.tfrecord")) == [
        "train-00000-of-00002.tfrecord", "train-00001-of-00002.tfrecord", "val-00000-of-00001.tfrecord"]
    split = _split_of(out)
    assert len(split) == sum(COUNTS.values()) - 1  # the exact copy is one image twice: same bytes
    manifest = json.loads((out / "manifest.json").read_text())["params"]["split"]
    for name, n in COUNTS.items():
        val = sum(1 for side, c in split.values() if (side, c) == ("val", name))
        assert abs(manifest["counts"]["val"][name] - 0.2 * n) <= 1, (name, manifest["counts"])
        assert manifest["counts"]["val"][name] + manifest["counts"]["train"][name] == n
        if name != "bee":  # bee's exact copy is one key above
            assert val == manifest["counts"]["val"][name]
        assert f"  {name}  {manifest['counts']['train'][name]:5d}  {manifest['counts']['val'][name]:5d}" in proc.stdout
    # The planted pairs are each one group, on one side.
    groups = manifest["groups_kept_together"]
    assert sorted([p.rsplit("/", 2)[-1] for p in g] for g in groups) == [["00-copy.jpg", "00.png"],
                                                                         ["00.png", "exact-copy.png"]]
    twin_a = (images / "ant" / "00.png").read_bytes(), (images / "ant" / "00-copy.jpg").read_bytes()
    assert split[twin_a[0]][0] == split[twin_a[1]][0]
    # Same seed, another process (another hash seed): byte-identical shards; another seed: another split.
    for shard in out.glob("*.tfrecord"):
        assert (runs["b"][0] / shard.name).read_bytes() == shard.read_bytes(), shard.name
    assert _split_of(runs["c"][0]) != split
    # The data check, with its own hash, finds no leakage between the splits convert made.
    result = check_stage([(p, p.name.split("-")[0]) for p in sorted(out.glob("*.tfrecord"))], tmp_path / "check",
                         fail_on="leakage>0")
    checks = json.loads(result.report_json.read_text())["checks"]
    assert checks == {"duplicate": 1}, checks  # the exact copy, on one side; no leakage


def test_a_fraction_outside_0_1_is_one_line(tmp_path):
    images = make_folder(tmp_path / "images")
    proc = run_appliance("data", "convert", str(images), "--out", str(tmp_path / "o"), "--val-fraction", "1.5")
    assert proc.returncode != 0 and proc.stderr.strip().splitlines() == [
        "appliance data convert: error: argument --val-fraction: must be less than 1, got 1.5 "
        "(see appliance data convert --help)"], proc.stderr
