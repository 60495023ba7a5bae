"""Thumbnails of outliers and duplicate groups for the HTML report.

The scan keeps no images, so the few records the report shows are read back from the clean
or quarantine shards they ended up in (one sequential read per shard involved).
"""

from __future__ import annotations

import base64
from pathlib import Path

from data_tools.check.image_probe import thumbnail_png
from data_tools.example import decode_example
from data_tools.tfrecord import read_records

MAX_OUTLIERS = 24
MAX_GROUPS = 8
MAX_GROUP_MEMBERS = 4


def collect_thumbnails(out: Path, report: dict, results, names) -> dict:
    """{"outliers": [{file, record_number, caption, png, width, height}], "groups": [{kind, size, members}]}.

    png is base64 (width and height are its pixels); a group's size counts all its records, members only those shown.
    """
    index_of = {r.path: i for i, r in enumerate(results)}
    outlier_items, seen = [], set()
    for o in report["outliers"]:
        key = (o["file"], o["record_number"])
        if key in seen:
            continue
        seen.add(key)
        rules = " + ".join(o["rules"])
        outlier_items.append({"file": o["file"], "record_number": o["record_number"],
                              "caption": f"{o['statistic']} = {o['value']:.4g} ({rules})"})
        if len(outlier_items) >= MAX_OUTLIERS:
            break
    group_items = []
    for kind in ("exact_groups", "near_groups"):
        for group in report["duplicates"][kind][:MAX_GROUPS]:
            group_items.append({"kind": "exact duplicates" if kind == "exact_groups" else "near duplicates",
                                "size": len(group),
                                "members": [dict(m, caption=f"{m['split']} split" if m["split"] else "")
                                            for m in group[:MAX_GROUP_MEMBERS]]})

    wanted = [(m["file"], m["record_number"]) for m in outlier_items]
    wanted += [(m["file"], m["record_number"]) for g in group_items for m in g["members"]]
    images = _read_images(out, results, names, index_of, set(wanted), report["schema"].get("image_key"))
    for item in outlier_items + [m for g in group_items for m in g["members"]]:
        png = images.get((item["file"], item["record_number"]))
        item["png"] = base64.b64encode(png).decode("ascii") if png else None
        if png:
            item["width"], item["height"] = png_size(png)
    return {"outliers": outlier_items, "groups": group_items}


def png_size(png: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, which always comes first."""
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")


def _read_images(out: Path, results, names, index_of, wanted: set, image_key) -> dict:
    if not image_key:
        return {}
    by_shard: dict[Path, dict[int, tuple]] = {}
    for path, number in wanted:
        i = index_of[path]
        result = results[i]
        for where, numbers in (("clean", result.clean_records), ("quarantine", result.quarantined_records)):
            if number in numbers:
                by_shard.setdefault(out / where / names[i], {})[numbers.index(number)] = (path, number)
    images = {}
    for shard, positions in by_shard.items():
        last = max(positions)
        for position, data in enumerate(read_records(shard)):
            if position in positions:
                encoded = decode_example(bytes(data)).get(image_key)
                if encoded:
                    images[positions[position]] = thumbnail_png(encoded[0])
            if position >= last:
                break
    return images
