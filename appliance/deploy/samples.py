"""Labelled samples for parity, calibration, evaluation and edge verification.

Two sources: TFRecord files of image examples (image/encoded + image/class/label, or, for
segmentation, DeepLab's image/segmentation/class/encoded mask; read with data_tools and
preprocessed by the one shared function), or an .npz/.npy of already preprocessed tensors
(`x`: float32 N,C,H,W and optional `y`: labels (N,) or masks (N,H,W)) for sites that prepare
their own. A mask is resized to the model's grid with nearest neighbour, as training evaluates. Either way the result is checked against the model's input shape here, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_tools.preprocessing import preprocess_image
from appliance.core.errors import DataError
from data_tools.example import decode_example
from data_tools.image_decode import ImageProblem, decode_image
from data_tools.detection import BOX_KEYS, LABEL_KEY as BOX_LABEL_KEY, PER_BOX_KEYS, BoxProblem, read_boxes
from data_tools.segmentation import MASK_KEY, MaskProblem, decode_mask
from data_tools.tfrecord import read_records

IMAGE_KEY, LABEL_KEY = "image/encoded", "image/class/label"


@dataclass
class Samples:
    x: np.ndarray            # float32 (N, C, H, W), preprocessed
    y: np.ndarray | None     # int64 (N,) labels or (N, H, W) masks, or None when the source has none
    files: list[Path]        # the files they came from (manifest inputs)
    source: str              # "tfrecord" or "tensors"


def load_samples(paths, preprocessing: dict, limit: int | None = None) -> Samples:
    """Read up to `limit` samples from TFRecord files or one .npz/.npy tensor file."""
    files = [Path(p) for p in paths]
    for f in files:
        if not f.is_file():
            raise DataError(f"{f}: " + ("not a regular file (a folder, device or pipe)" if Path(f).exists() else "no such file"))
    if len(files) == 1 and files[0].suffix in (".npz", ".npy"):
        return _load_tensors(files[0], limit)
    if not preprocessing or "image_size" not in preprocessing:
        raise DataError(f"{files[0]}: TFRecord images need the model's preprocessing (image size, channel order, "
                        "mean, std), which this model's metadata lacks (not made by `appliance export`): give "
                        "samples as a .npy/.npz of (N, C, H, W) float32 tensors")
    return _load_tfrecords(files, preprocessing, limit)


def _load_tensors(path: Path, limit: int | None) -> Samples:
    try:
        data = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as err:
        raise DataError(f"{path}: not a readable .npy/.npz ({err})") from None
    if isinstance(data, np.ndarray):
        x, y = data, None
    else:
        if "x" not in data:
            raise DataError(f"{path}: .npz needs an array named 'x' (N,C,H,W float32); found {list(data.keys())}")
        x, y = data["x"], (data["y"] if "y" in data else None)
    if x.ndim != 4:
        raise DataError(f"{path}: tensors must be (N, C, H, W), got shape {tuple(x.shape)}")
    if y is not None and (len(y) != len(x) or y.ndim not in (1, 3)):
        raise DataError(f"{path}: {len(x)} tensors but labels of shape {tuple(y.shape)} (need (N,) or (N, H, W))")
    if limit:
        x, y = x[:limit], (y[:limit] if y is not None else None)
    if x.dtype.kind not in "fiub":
        raise DataError(f"{path}: 'x' holds {x.dtype} values, not numbers (N, C, H, W float32)")
    with np.errstate(over="ignore"):  # float64 past float32's range becomes inf: judged below
        x = np.ascontiguousarray(x, dtype=np.float32)
    bad = int(x.size - np.count_nonzero(np.isfinite(x)))
    if bad:  # calibration's scales (and every comparison) would be NaN: onnxruntime's "scale issue" assertion
        first = np.argwhere(~np.isfinite(x))[0]
        raise DataError(f"{path}: 'x' holds {bad} values that are NaN or infinite (the first at sample "
                        f"{int(first[0])}, index {tuple(int(i) for i in first[1:])}); tensors must be finite")
    return Samples(x, None if y is None else np.asarray(y, dtype=np.int64), [path], "tensors")


def _load_tfrecords(files: list[Path], preprocessing: dict, limit: int | None) -> Samples:
    xs, ys, kinds = [], [], set()
    for f in files:
        for number, record in enumerate(read_records(f, strict=True)):
            if limit and len(xs) >= limit:
                break
            try:
                features = decode_example(bytes(record), keys=[IMAGE_KEY, LABEL_KEY, MASK_KEY, *PER_BOX_KEYS])
            except Exception as err:
                raise DataError(f"{f}: record {number}: not a tf.train.Example ({err})") from None
            target = LABEL_KEY if LABEL_KEY in features else MASK_KEY if MASK_KEY in features else BOX_LABEL_KEY
            if target == BOX_LABEL_KEY and BOX_LABEL_KEY not in features and BOX_KEYS[0] not in features:
                target = LABEL_KEY  # none of the three: named below
            elif target == BOX_LABEL_KEY:
                features.setdefault(BOX_LABEL_KEY, np.zeros(0, np.int64))
            if IMAGE_KEY not in features or target not in features:
                raise DataError(f"{f}: record {number}: needs {IMAGE_KEY} and {LABEL_KEY} (or {MASK_KEY}); "
                                f"found {sorted(features)}")
            try:  # the bounded decoder (data_tools.image_decode): a bomb is refused before it is decoded
                image = decode_image(features[IMAGE_KEY][0])
            except ImageProblem as err:
                raise DataError(f"{f}: record {number}: {IMAGE_KEY}: {err.check}: {err.detail}") from None
            try:
                xs.append(preprocess_image(image, preprocessing))
            except Exception as err:
                raise DataError(f"{f}: record {number}: {IMAGE_KEY} is not a decodable image ({err})") from None
            kinds.add(target)
            ys.append(int(features[LABEL_KEY][0]) if target == LABEL_KEY
                      else _mask(features[MASK_KEY][0], int(preprocessing["image_size"]), f, number)
                      if target == MASK_KEY else _boxes(features, f, number))
    if not xs:
        raise DataError(f"{files[0]}: no image examples found")
    if len(kinds) > 1:
        raise DataError(f"{files[0]}: mixes labelled, masked and boxed records")
    if kinds == {BOX_LABEL_KEY}:  # detection: rows [label, xmin, ymin, xmax, ymax] padded to the most boxes
        padded = np.zeros((len(ys), max([1] + [len(y) for y in ys]), 5), np.float32)
        for i, y in enumerate(ys):
            padded[i, :len(y)] = y
        return Samples(np.stack(xs), padded, files, "tfrecord")
    return Samples(np.stack(xs), np.stack(ys).astype(np.int64), files, "tfrecord")


def _boxes(features: dict, path: Path, number: int) -> np.ndarray:
    """A detection record's rows [label, xmin, ymin, xmax, ymax] (normalised), as training reads them."""
    try:
        boxes, labels = read_boxes(features)
    except BoxProblem as err:
        raise DataError(f"{path}: record {number}: {err.detail}") from None
    return np.concatenate([labels[:, None].astype(np.float32), boxes], 1)


def _mask(encoded: bytes, size: int, path: Path, number: int) -> np.ndarray:
    """A record's class mask on the model's size x size grid (nearest neighbour, as training evaluates)."""
    from PIL import Image  # late, as data_tools.preprocessing does

    try:
        mask = decode_mask(bytes(encoded))
    except MaskProblem as err:
        raise DataError(f"{path}: record {number}: {err.check}: {err.detail}") from None
    if mask.shape != (size, size):
        mask = np.asarray(Image.fromarray(mask).resize((size, size), Image.NEAREST))
    return mask


def check_input_shape(samples: Samples, expected: list, input_name: str, model_path) -> None:
    """One line naming the file when the tensors cannot feed the model's input (batch axis free)."""
    got = tuple(samples.x.shape[1:])
    want = tuple(expected[1:])
    if len(got) != len(want) or any(isinstance(w, int) and w > 0 and w != g for g, w in zip(got, want)):
        raise DataError(f"{samples.files[0]}: samples have shape (N, {', '.join(map(str, got))}) but "
                        f"{model_path} input {input_name!r} expects (batch, {', '.join(map(str, want))})")


def synthetic_samples(preprocessing: dict, channels: int, count: int, input_shape=None, source=None):
    """Seeded random images through the shared preprocessing, for when no data was given. A model
    without preprocessing metadata (one not made by `appliance export`, compiled as it came) gets
    seeded standard-normal tensors of its static input shape instead; one line when it has neither."""
    rng = np.random.default_rng(0)
    if not preprocessing or "image_size" not in preprocessing:
        dims = list(input_shape or [])[1:]
        if len(dims) == 3 and all(isinstance(d, int) and d > 0 for d in dims):
            return Samples(rng.standard_normal((count, *dims)).astype(np.float32), None, [], "synthetic")
        raise DataError(f"{source or 'the model'}: no preprocessing in its metadata and no static input shape "
                        f"({input_shape}): give samples as a .npy/.npz of (N, C, H, W) float32 tensors")
    size = preprocessing["image_size"]
    shape = (size, size, 3) if preprocessing["channel_order"] == "RGB" else (size, size)
    x = np.stack([preprocess_image(rng.integers(0, 256, shape, dtype=np.uint8), preprocessing)
                  for _ in range(count)])
    return Samples(x, None, [], "synthetic")
