"""One bounded decoder (data_tools.image_decode) for every image and mask a record carries: a PNG
bomb mask, a JPEG whose header claims 12000x12000 and a 144 Mpx image and mask are quarantined by
the check and refused by training in the same words (image_too_large), with the record's address,
before any pixel is decoded; each decode path's peak memory on them stays small."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS / "train"))
from hostile_images import lying_jpeg, zero_png  # noqa: E402
from seg_data import _png, make_seg_config, seg_records  # noqa: E402

from appliance.core.errors import DataError  # noqa: E402
from appliance.tasks import task_for  # noqa: E402
from appliance.train.config import load_config  # noqa: E402
from appliance.train.data import _dataset  # noqa: E402
from data_tools.check.run import run_check  # noqa: E402
from data_tools.example import encode_example  # noqa: E402
from data_tools.segmentation import encode_segmentation_example  # noqa: E402
from data_tools.tfrecord import write_records  # noqa: E402

BOMB = (30000, 30000)  # 900 M pixels of class 0 in ~0.9 MB
BIG = (12000, 12000)  # 144 M pixels: past the 64 M default limit, under Pillow's own guard's error


def seg_file(path: Path) -> Path:
    """Records 0..5 good; 6: a PNG bomb mask; 7: a 144 Mpx image with its 144 Mpx mask."""
    records = list(seg_records(6, seed=1))
    image = _png(np.random.default_rng(2).integers(0, 255, (16, 16), dtype=np.uint8))
    records.append(encode_segmentation_example(image, "png", 16, 16, zero_png(*BOMB)))
    records.append(encode_segmentation_example(zero_png(*BIG), "png", BIG[1], BIG[0], zero_png(*BIG)))
    write_records(path, records)
    return path


def classification_file(path: Path) -> Path:
    """Records 0..5 good (labels 0..2); 6: a JPEG whose frame header claims 12000x12000."""
    rng = np.random.default_rng(3)
    records = [encode_example({"image/encoded": _png(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)),
                               "image/class/label": i % 3}) for i in range(6)]
    records.append(encode_example({"image/encoded": lying_jpeg(*BIG), "image/class/label": 1}))
    write_records(path, records)
    return path


def quarantined(out: Path) -> dict:
    lines = (out / "quarantine" / "reasons.jsonl").read_text().splitlines()[1:]
    return {q["record_number"]: (q["check"], q["detail"]) for q in map(json.loads, lines)}


def test_check_quarantines_a_png_bomb_mask_and_a_144_mpx_record_and_reports_the_good_ones(tmp_path):
    path = seg_file(tmp_path / "seg.tfrecord")
    report, status = run_check([(str(path), None)], tmp_path / "out", jobs=1, progress=False)
    assert status == 0 and report["records_valid"] == 6 and report["records_quarantined"] == 2
    bad = quarantined(tmp_path / "out")
    assert bad[6][0] == "image_too_large" and "mask is 30000x30000 = 900000000 pixels > limit 64000000" in bad[6][1]
    assert bad[7] == ("image_too_large", "image is 12000x12000 = 144000000 pixels > limit 64000000")
    assert (tmp_path / "out" / "report.html").is_file()


def test_check_num_classes_past_what_a_mask_holds_is_a_report(tmp_path):
    """--num-classes 300 on masks (ids 0..255) was an internal IndexError."""
    write_records(tmp_path / "seg.tfrecord", seg_records(4, seed=1))
    report, status = run_check([(str(tmp_path / "seg.tfrecord"), None)], tmp_path / "out", jobs=1, progress=False,
                               num_classes=300)
    seg = report["segmentation"]
    assert status == 0 and seg["num_classes"] == 300 and 299 in seg["classes_in_no_image"]


@pytest.mark.parametrize("augment", [False, True])
def test_segmentation_training_refuses_the_bomb_and_the_144_mpx_record_in_the_checks_words(tmp_path, augment):
    path = seg_file(tmp_path / "seg.tfrecord")
    cfg = load_config(make_seg_config(tmp_path, augment={"enabled": augment}))
    samples = task_for(cfg.task).dataset(cfg, (str(path),), augment)
    assert tuple(samples[0][1].shape) == (16, 16)
    for number, what in ((6, "mask is 30000x30000 = 900000000 pixels"), (7, "image is 12000x12000 = 144000000")):
        with pytest.raises(DataError) as err:
            samples[number]
        assert str(err.value).startswith(f"{path}: record {number}: image_too_large: {what}"), err.value


@pytest.mark.parametrize("decode,augment", [("cpu", False), ("cpu", True), ("gpu", False), ("gpu", True)])
def test_classification_training_refuses_a_lying_jpeg_header_as_the_check_quarantines_it(tmp_path, decode, augment):
    path = classification_file(tmp_path / "cls.tfrecord")
    report, _ = run_check([(str(path), None)], tmp_path / "out", jobs=1, progress=False)
    assert quarantined(tmp_path / "out") == {6: ("image_too_large", "image is 12000x12000 = 144000000 pixels > limit 64000000")}
    config = tmp_path / "t.toml"
    config.write_text(f'[run]\nname = "t"\n[data]\ntrain = ["{path}"]\nnum_classes = 3\nimage_size = 8\n'
                      f'num_workers = 0\ndecode = "{decode}"\n[augment]\nenabled = {str(augment).lower()}\n')
    dataset = _dataset(load_config(config), (str(path),), augment=augment, decode=decode)
    dataset[0]
    with pytest.raises(DataError) as err:
        dataset[6]
    assert str(err.value).startswith(f"{path}: record 6: image_too_large: image is 12000x12000 = 144000000 pixels "
                                     "> limit 64000000"), err.value


def test_max_pixels_is_the_configs_and_bounded(tmp_path):
    """[data] max_pixels is the check's --max-pixels: a 20x20 image past a limit of 100 is refused."""
    path = classification_file(tmp_path / "cls.tfrecord")
    config = tmp_path / "t.toml"
    config.write_text(f'[run]\nname = "t"\n[data]\ntrain = ["{path}"]\nnum_classes = 3\nimage_size = 8\n'
                      'num_workers = 0\nmax_pixels = 63\n')
    with pytest.raises(DataError, match="record 0: image_too_large: image is 8x8 = 64 pixels > limit 63"):
        _dataset(load_config(config), (str(path),))[0]
    config.write_text(config.read_text().replace("max_pixels = 63", "max_pixels = 2000000000"))
    from appliance.core.errors import ConfigError
    with pytest.raises(ConfigError, match=r"max_pixels.*at most 1000000000"):
        load_config(config)


def rss_kib(field: str) -> int:
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
    return int(line.split()[1])


def peak_growth(call) -> int:
    """Bytes the process's peak RSS rose above its RSS while `call` ran (writing 5 to clear_refs resets
    the peak to the current RSS, so a peak reached by an earlier test does not hide this one's)."""
    Path("/proc/self/clear_refs").write_text("5")
    before = rss_kib("VmRSS")
    try:
        call()
    except DataError as err:
        refused = str(err)
    except Exception as err:  # noqa: BLE001 - ImageProblem, MaskProblem: their words; anything else fails below
        refused = f"{getattr(err, 'check', type(err).__name__)}: {getattr(err, 'detail', err)}"
    else:
        refused = None
    return (rss_kib("VmHWM") - before) << 10, refused


def test_every_decode_paths_peak_memory_on_the_bomb_and_the_lying_header_is_small(tmp_path):
    from appliance.deploy.samples import load_samples
    from appliance.train.data import decode_for_augmentation, decode_pixels
    from appliance.train.device_decode import encode_for_device
    from data_tools.check.image_probe import probe_image, thumbnail_png
    from data_tools.preview import write_preview
    from data_tools.segmentation import decode_mask

    inputs = {"bomb": zero_png(*BOMB), "lying jpeg": lying_jpeg(*BIG), "144 Mpx": zero_png(*BIG)}
    write_records(tmp_path / "calib.tfrecord", [encode_example({"image/encoded": b, "image/class/label": 0})
                                                for b in inputs.values()])
    preprocessing = {"image_size": 8, "mean": [0.5] * 3, "std": [0.5] * 3, "channel_order": "RGB"}
    paths = {
        "check": probe_image, "check thumbnail": thumbnail_png, "mask (check, train, calibration)": decode_mask,
        "train decode cpu": lambda b: decode_pixels(b, 8, 3), "train augment": lambda b: decode_for_augmentation(b, 1),
        "train decode gpu header": lambda b: encode_for_device(b, lambda e: decode_pixels(e, 8, 3)),
    }
    grown = {}
    for name, decode in paths.items():
        for kind, data in inputs.items():
            grown[f"{name}, {kind}"] = peak_growth(lambda: decode(data))
    grown["calibration samples"] = peak_growth(lambda: load_samples([tmp_path / "calib.tfrecord"], preprocessing))
    grown["preview"] = peak_growth(lambda: write_preview(tmp_path / "calib.tfrecord", tmp_path / "p.png"))
    print("\n".join(f"{name}: peak +{size / 2**20:.1f} MiB, {refused}" for name, (size, refused) in grown.items()))
    for name, (size, refused) in grown.items():
        assert size < 32 << 20, f"{name}: the peak RSS rose by {size >> 20} MiB"
        if "thumbnail" in name:
            assert refused is None  # decoration: a refused image has none
        else:
            assert "image_too_large" in refused or "no record with a decodable" in refused, (name, refused)


def test_no_other_module_opens_image_bytes():
    """The bounded decoder is the only door: Image.open anywhere else in the product would decode
    untrusted bytes unbounded. preprocessing.py is the edge package's own copy (numpy and Pillow only,
    on the device); on the host every caller hands it an image the bounded decoder opened."""
    import re

    root = TESTS.parent
    opened = sorted(str(p.relative_to(root)) for package in ("appliance", "data_tools")
                    for p in (root / package).rglob("*.py") if re.search(r"Image\.open\(", p.read_text()))
    assert opened == ["data_tools/image_decode.py", "data_tools/preprocessing.py"]
