"""Benchmark: `appliance data check` throughput, and seeded augmentation vs plain torchvision.

    PYTHONPATH=. .venv/bin/python benchmarks/check.py [--records 20000] [--augment-samples 1500]

1. data check: records/s over N JPEG records (one file, serial; and 4 shards, one worker per
   core), next to the floor of the same work without the checks (read + verify + parse + decode).
2. decode + augment samples/s with 0, 1 and 2 DataLoader workers: our TrainTransform (seeded per
   sample, exact HSV units) vs the plain torchvision.transforms.v2 pipeline with the same ops
   (RandomResizedCrop, RandomHorizontalFlip, RandomRotation, ColorJitter, Normalize) over the same
   encoded images, both decoded by torchvision.io.decode_jpeg. Target: ours / torchvision >= 0.95.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_tools.augment import IMAGENET_MEAN, IMAGENET_STD, TrainTransform  # noqa: E402
from data_tools.check.image_probe import probe_image  # noqa: E402
from data_tools.check.run import run_check  # noqa: E402
from data_tools.example import decode_example, encode_example  # noqa: E402
from data_tools.tfrecord import read_records, write_records  # noqa: E402


def make_jpegs(n: int, size: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        base = rng.integers(0, 256, (size // 16, size // 16, 3), dtype=np.uint8)
        img = Image.fromarray(base).resize((size, size), Image.Resampling.BILINEAR)
        arr = (np.asarray(img, dtype=np.int16) + rng.integers(-12, 13, (size, size, 3))).clip(0, 255)
        buf = io.BytesIO()
        Image.fromarray(arr.astype(np.uint8)).save(buf, format="JPEG", quality=85)
        out.append(buf.getvalue())
    return out


def bench_check(tmp: Path, n: int) -> None:
    images = make_jpegs(n, 96)
    records = [encode_example({"image/encoded": im, "image/format": b"jpeg", "image/class/label": i % 10,
                               "image/class/text": f"class{i % 10}".encode()}) for i, im in enumerate(images)]
    one = tmp / "all.tfrecord"
    write_records(one, records)
    shards = [tmp / f"shard-{k}-of-4.tfrecord" for k in range(4)]
    for k, path in enumerate(shards):
        write_records(path, records[k::4])
    mb = one.stat().st_size / 1e6
    print(f"data check: {n} JPEG records (96x96, {mb:.1f} MB)")

    t = time.perf_counter()
    for data in read_records(one):
        probe_image(decode_example(bytes(data))["image/encoded"][0])
    floor = time.perf_counter() - t
    print(f"  floor: read+verify+parse+decode only, no checks: {n / floor:9.0f} records/s")

    t = time.perf_counter()
    report, _ = run_check([(str(one), None)], tmp / "out1", progress=False, jobs=1)
    serial = time.perf_counter() - t
    assert report["records_valid"] == n, report["checks"]
    print(f"  appliance data check, 1 file, 1 process:      {n / serial:9.0f} records/s "
          f"({mb / serial:.1f} MB/s; {floor / serial:.2f}x the no-check floor)")

    cores = len(os.sched_getaffinity(0))
    t = time.perf_counter()
    report, _ = run_check([(str(p), None) for p in shards], tmp / "out4", progress=False)
    parallel = time.perf_counter() - t
    assert report["records_valid"] == n
    print(f"  appliance data check, 4 shards, {min(4, cores)} processes:  {n / parallel:9.0f} records/s "
          f"({serial / parallel:.2f}x the 1-process run; {cores} cores here)")


class EncodedImages(torch.utils.data.Dataset):
    def __init__(self, encoded: list[bytes], transform, seeded: bool):
        self.encoded = [torch.frombuffer(bytearray(e), dtype=torch.uint8) for e in encoded]
        self.transform, self.seeded = transform, seeded

    def __len__(self):
        return len(self.encoded)

    def __getitem__(self, i):
        from torchvision.io import decode_jpeg

        image = decode_jpeg(self.encoded[i])
        return self.transform(image, i) if self.seeded else self.transform(image)


def samples_per_second(dataset, workers: int) -> tuple[float, float]:
    """(wall-clock samples/s, samples per CPU-second of this process; the latter only means much with 0 workers)."""
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, num_workers=workers, shuffle=False,
                                         persistent_workers=False)
    wall, cpu = time.perf_counter(), time.process_time()
    count = sum(batch.shape[0] for batch in loader)
    return count / (time.perf_counter() - wall), count / (time.process_time() - cpu)


def bench_augment(n: int, repeats: int) -> None:
    from torchvision.transforms import v2

    encoded = make_jpegs(n, 256, seed=1)
    ours = TrainTransform(224, seed=0)
    plain = v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip(),
                        v2.RandomRotation(15, interpolation=v2.InterpolationMode.BILINEAR),
                        v2.ToDtype(torch.float32, scale=True),
                        v2.ColorJitter(brightness=0.1, saturation=0.1, hue=0.1),
                        v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    pipelines = {"ours": EncodedImages(encoded, ours, True), "torchvision": EncodedImages(encoded, plain, False)}
    print(f"decode + augment: {n} JPEG images 256x256 -> 224x224, batch 32, best of {repeats} runs, "
          "alternating (torch intra-op threads = 1, as inside DataLoader workers)")
    for workers in (0, 1, 2):
        best = {name: (0.0, 0.0) for name in pipelines}
        for r in range(repeats):  # alternate who goes first so both see the same machine load
            for name in (("ours", "torchvision") if r % 2 else ("torchvision", "ours")):
                wall, cpu = samples_per_second(pipelines[name], workers)
                best[name] = (max(best[name][0], wall), max(best[name][1], cpu))
        ratio = best["ours"][0] / best["torchvision"][0]
        line = (f"  workers={workers}: ours {best['ours'][0]:7.1f} samples/s, torchvision "
                f"{best['torchvision'][0]:7.1f} samples/s, ratio {ratio:.2f} "
                f"({'meets' if ratio >= 0.95 else 'BELOW'} target 0.95)")
        if workers == 0:  # CPU time is not disturbed by other jobs on a shared box
            line += (f"; per CPU-second: ours {best['ours'][1]:.1f}, torchvision {best['torchvision'][1]:.1f}, "
                     f"ratio {best['ours'][1] / best['torchvision'][1]:.2f}")
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--augment-samples", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-check", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not args.skip_check:
        with tempfile.TemporaryDirectory() as tmp:
            bench_check(Path(tmp), args.records)
    bench_augment(args.augment_samples, args.repeats)


if __name__ == "__main__":
    main()
