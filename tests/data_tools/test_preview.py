"""`appliance data preview`: a grid of originals beside what training's augmentation makes of them."""

import io

import numpy as np
import torch
from PIL import Image

from check_datasets import make_planted
from conftest import run_appliance
from data_tools.example import decode_example
from data_tools.preview import write_preview


def test_preview_grid_shows_originals_and_seeded_augmentations(tmp_path):
    planted = make_planted(tmp_path / "data", per_class=2, minority=2)
    grid_path = tmp_path / "grid.png"
    proc = run_appliance("data", "preview", str(planted.train), "--out", str(grid_path), "--count", "3",
                         "--variants", "2", "--size", "64", offline=True)
    assert proc.returncode == 0, proc.stderr
    grid = Image.open(grid_path)
    assert grid.size == (4 + 3 * (64 + 4), 4 + 3 * (64 + 4))
    assert "appliance data preview" in grid.info["Software"]
    pixels = np.asarray(grid.convert("RGB"), dtype=np.int16)

    def tile(row, col):
        y, x = 4 + row * 68, 4 + col * 68
        return pixels[y:y + 64, x:x + 64]

    encoded = decode_example(planted.train_records[0])["image/encoded"][0]
    original = np.asarray(Image.open(io.BytesIO(encoded)).convert("RGB").resize((64, 64)), dtype=np.int16)
    assert np.abs(tile(0, 0) - original).mean() < 12  # the original, as it is
    assert np.abs(tile(0, 1) - tile(0, 2)).mean() > 5  # epochs 0 and 1 augment differently
    again = tmp_path / "again.png"
    threads = torch.get_num_threads()
    try:
        write_preview(planted.train, again, count=3, variants=2, size=64)
    finally:
        torch.set_num_threads(threads)
    assert np.array_equal(np.asarray(Image.open(again)), np.asarray(grid))  # seeded: reproducible


def test_preview_of_a_file_without_images_is_one_line(tmp_path):
    empty = tmp_path / "nothing.tfrecord"
    empty.write_bytes(b"")
    proc = run_appliance("data", "preview", str(empty), "--out", str(tmp_path / "g.png"))
    assert proc.returncode == 2
    assert proc.stderr == (f"appliance data preview: error: {empty}: no record with a decodable "
                           "'image/encoded' image to preview\n")
