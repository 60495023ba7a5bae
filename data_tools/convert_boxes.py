"""Make detection TFRecords (Object Detection API convention) from a COCO JSON or a Pascal VOC folder.

COCO: `instances.json` (images, annotations with bbox = [x, y, width, height] in pixels,
categories) and the folder its file_names are relative to. Category ids (sparse in COCO: 1..90)
become labels 1..K in id order; the map is kept in label_map.pbtxt and the manifest.
VOC: a folder holding Annotations/*.xml and JPEGImages/; class names sorted become labels 1..K.
Pixel boxes are normalised as the API's create_coco_tf_record.py / create_pascal_tf_record.py do
(x / width, y / height). Whether each box is valid is the data check's job: convert writes what the
annotations say, so the check's quarantine can name the exact record.
"""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from appliance.core.errors import DataError
from appliance.core.inputs import require_file
from appliance.core.manifest import atomic_write_text, write_manifest
from data_tools.convert import check_val_fraction, read_image, split_images, write_shards
from data_tools.detection import encode_detection_example


@dataclass
class Annotated:
    """One image and its boxes in pixels (xmin, ymin, xmax, ymax) with labels from 1."""

    path: Path
    width: int
    height: int
    boxes: list = field(default_factory=list)
    labels: list = field(default_factory=list)
    difficult: list = field(default_factory=list)
    crowd: list = field(default_factory=list)
    source_id: str = ""


def is_voc_folder(folder: str | os.PathLike) -> bool:
    root = Path(folder)
    return (root / "Annotations").is_dir() and (root / "JPEGImages").is_dir()


def read_coco(annotations: str | os.PathLike, images_dir: str | os.PathLike) -> tuple[list[str], list[Annotated]]:
    """(class names for labels 1..K, images with their boxes) of a COCO instances JSON."""
    path = require_file(annotations, "COCO annotations file")
    try:
        coco = json.loads(Path(path).read_text())
        categories = sorted((int(c["id"]), str(c["name"])) for c in coco["categories"])
        label_of = {cid: i + 1 for i, (cid, _) in enumerate(categories)}
        items = {}
        for image in coco["images"]:
            items[int(image["id"])] = Annotated(Path(images_dir) / image["file_name"], int(image["width"]),
                                                int(image["height"]), source_id=str(image["id"]))
        for n, a in enumerate(coco["annotations"]):
            item = items.get(int(a["image_id"]))
            if item is None:
                raise DataError(f"{path}: annotations[{n}] names image_id {a['image_id']}, which no image has")
            if int(a["category_id"]) not in label_of:
                raise DataError(f"{path}: annotations[{n}] names category_id {a['category_id']}, "
                                "which no category has")
            x, y, w, h = (float(v) for v in a["bbox"])
            item.boxes.append((x, y, x + w, y + h))
            item.labels.append(label_of[int(a["category_id"])])
            item.crowd.append(int(a.get("iscrowd", 0)))
            item.difficult.append(0)
    except (KeyError, TypeError, ValueError) as err:
        raise DataError(f"{path}: not a COCO instances file ({type(err).__name__}: {err})") from None
    return [name for _, name in categories], [items[k] for k in sorted(items)]


def read_voc(folder: str | os.PathLike) -> tuple[list[str], list[Annotated]]:
    """(class names for labels 1..K, images with their boxes) of a VOC folder (Annotations/ + JPEGImages/)."""
    root = Path(folder)
    parsed = []
    for xml in sorted((root / "Annotations").glob("*.xml")):
        try:
            tree = ET.parse(xml).getroot()
            size = tree.find("size")
            item = Annotated(root / "JPEGImages" / tree.findtext("filename").strip(),
                             int(size.findtext("width")), int(size.findtext("height")), source_id=xml.stem)
            names = []
            for obj in tree.iter("object"):
                box = obj.find("bndbox")
                item.boxes.append(tuple(float(box.findtext(k)) for k in ("xmin", "ymin", "xmax", "ymax")))
                item.difficult.append(int(obj.findtext("difficult") or 0))
                item.crowd.append(0)
                names.append(obj.findtext("name").strip())
        except (ET.ParseError, AttributeError, TypeError, ValueError) as err:
            raise DataError(f"{xml}: not a Pascal VOC annotation ({type(err).__name__}: {err})") from None
        parsed.append((item, names))
    if not parsed:
        raise DataError(f"{root / 'Annotations'}: no *.xml annotation files")
    classes = sorted({n for _, names in parsed for n in names})
    for item, names in parsed:
        item.labels = [classes.index(n) + 1 for n in names]
    return classes, [item for item, _ in parsed]


def label_map_text(classes: list[str]) -> str:
    """The Object Detection API's label_map.pbtxt (ids from 1)."""
    return "".join(f"item {{\n  id: {i + 1}\n  name: {json.dumps(name)}\n}}\n" for i, name in enumerate(classes))


def convert_boxes(classes: list[str], items: list[Annotated], out_dir, source: dict, shards: int = 1,
                  prefix: str = "data", seed: int = 0, progress: Callable[[int], None] | None = None,
                  val_fraction: float = 0.0, near_distance: int = 4) -> list[Path]:
    """Write shuffled, sharded, indexed detection TFRecords; returns the shard paths.

    With val_fraction > 0: the split_images rule (seeded, near duplicates on one side), stratified by
    the rarest class in each image (0: no boxes), into train-* and val-* shards. out_dir gets
    labels.txt, label_map.pbtxt and manifest.json."""
    if shards < 1:
        raise DataError(f"--shards must be at least 1, not {shards}")
    check_val_fraction(val_fraction)
    for item in items:
        require_file(item.path, "image")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    by_path = {item.path: item for item in items}
    params = {**source, "shards": shards, "prefix": prefix, "seed": seed, "task": "detection", "classes": classes,
              "made_by": "appliance data convert (boxes)"}
    boxes_per_class = Counter(label for item in items for label in item.labels)
    if val_fraction > 0:
        strata = [(item.path, min(item.labels, key=lambda c: (boxes_per_class[c], c)) if item.labels else 0)
                  for item in items]
        split = split_images(strata, len(classes) + 1, val_fraction, seed, near_distance)
        params.pop("prefix")
        params["split"] = {"val_fraction": val_fraction, "near_distance": near_distance,
                           "groups_kept_together": split.groups_kept_together,
                           "counts": {"train": len(split.train), "val": len(split.val)}}
        sides = [("train", split.train, shards), ("val", split.val, max(1, round(shards * val_fraction)))]
    else:
        sides = [(prefix, [(item.path, 0) for item in items], shards)]

    def encode(path: Path) -> bytes:
        item = by_path[path]
        encoded, fmt = read_image(path)
        w, h = item.width, item.height
        boxes = [(x0 / w, y0 / h, x1 / w, y1 / h) for x0, y0, x1, y1 in item.boxes]
        return encode_detection_example(encoded, fmt, h, w, boxes, item.labels,
                                        [classes[c - 1] if 0 < c <= len(classes) else "" for c in item.labels],
                                        filename=path.name, source_id=item.source_id, difficult=item.difficult,
                                        is_crowd=item.crowd)

    paths = []
    for name, chosen, count in sides:
        paths += write_shards([p for p, _ in chosen], out, name, count, seed, progress, encode)
    atomic_write_text(out / "labels.txt", "".join(f"{name}\n" for name in classes))
    atomic_write_text(out / "label_map.pbtxt", label_map_text(classes))
    write_manifest(out, "convert", inputs=sorted(by_path), params=params)
    return paths
