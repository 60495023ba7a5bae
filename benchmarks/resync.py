"""Damage benchmark: how fast the lossless reader gets past damaged regions, and in how much memory.

    .venv/bin/python benchmarks/resync.py [--rounds 3] [--bomb-mib 1024]

Cases (issue 18; targets: the 16 MB zero region read in under 1 s, the bomb in seconds with
bounded memory):
- plain file, 50 records + 16 MB of zeros + 50 records (every offset of the hole passes the
  zero-length test, so a per-offset CRC scan pays 16 M Python CRCs);
- the same with 16 MB of random bytes instead of zeros;
- the zero case compressed with GZIP;
- a gzip bomb: ~1 MB of GZIP expanding to --bomb-mib MiB of zeros behind a record header that
  claims 2^31-1 bytes (its length CRC valid), read lossless and strict, each in a fresh process
  whose peak RSS is reported.
Each figure is the median wall time over --rounds runs. No peer is timed: TensorFlow's reader
stops at the first damage and the `tfrecord` package checks no CRC, so neither resynchronises.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data_tools.tfrecord import frame, masked_crc, read_records  # noqa: E402

BOMB_CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
from data_tools.tfrecord import TFRecordError, read_records
t = time.perf_counter()
damage, n, error = [], 0, None
try:
    for _ in read_records(sys.argv[2], strict=sys.argv[3] == "strict", on_damage=damage.append):
        n += 1
except TFRecordError as err:
    error = str(err)
print(json.dumps({"seconds": time.perf_counter() - t, "records": n, "damaged": len(damage), "error": error,
                  "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def records(n: int, seed: int) -> list[bytes]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.bytes(int(rng.integers(200, 2000))) for _ in range(n)]


def hole_file(hole: bytes) -> tuple[bytes, int]:
    before, after = records(50, 1), records(50, 2)
    return b"".join(frame(r) for r in before) + hole + b"".join(frame(r) for r in after), len(before) + len(after)


def write_bomb(path: Path, mib: int) -> None:
    length = struct.pack("<Q", (1 << 31) - 1)
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    with open(path, "wb") as f:
        f.write(z.compress(frame(b"first") + length + struct.pack("<I", masked_crc(length))))
        block = bytes(1 << 20)
        for _ in range(mib):
            f.write(z.compress(block))
        f.write(z.compress(frame(b"last")) + z.flush())


def time_read(path: Path, expected: int, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        damage = []
        n = sum(1 for _ in read_records(path, on_damage=damage.append))
        times.append(time.perf_counter() - t)
        assert n == expected and len(damage) == 1, (path, n, damage)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bomb-mib", type=int, default=1024, help="MiB of zeros the bomb expands to")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        zeros, n = hole_file(bytes(16 << 20))
        noise, _ = hole_file(os.urandom(16 << 20))
        cases = {"plain, 16 MB of zeros": (zeros, False), "plain, 16 MB of random bytes": (noise, False),
                 "GZIP, 16 MB of zeros": (zeros, True)}
        for name, (body, gz) in cases.items():
            path = tmp / "case"
            path.write_bytes(zlib.compress(body, 6, 31) if gz else body)
            path.read_bytes()  # page cache
            times = time_read(path, n, args.rounds)
            figures[name] = {"median_s": statistics.median(times), "runs_s": times}
            print(f"{name:<36}{statistics.median(times):8.3f} s  (runs {' '.join(f'{t:.3f}' for t in times)})")
        bomb = tmp / "bomb.gz"
        write_bomb(bomb, args.bomb_mib)
        print(f"gzip bomb: {bomb.stat().st_size / 1e6:.2f} MB expanding to {args.bomb_mib} MiB of zeros "
              f"behind a 2^31-1 length claim")
        for mode in ("lossless", "strict"):
            runs = []
            for _ in range(args.rounds):
                done = subprocess.run([sys.executable, "-c", BOMB_CHILD, str(ROOT), str(bomb), mode],
                                      capture_output=True, text=True, check=True, timeout=1800)
                runs.append(json.loads(done.stdout))
            seconds = [r["seconds"] for r in runs]
            rss = max(r["max_rss_mb"] for r in runs)
            figures[f"bomb, {mode}"] = {"median_s": statistics.median(seconds), "runs_s": seconds,
                                        "max_rss_mb": rss, "records": runs[0]["records"]}
            print(f"  {mode:<34}{statistics.median(seconds):8.3f} s  peak RSS {rss:.0f} MB  "
                  f"records {runs[0]['records']}  (runs {' '.join(f'{t:.2f}' for t in seconds)})")
        t = time.perf_counter()
        d = zlib.decompressobj(31)
        with open(bomb, "rb") as f:
            while chunk := f.read(1 << 16):
                while chunk:
                    d.decompress(chunk, 1 << 22)
                    chunk = d.unconsumed_tail
        inflate = time.perf_counter() - t
        figures["zlib inflate of the bomb alone"] = {"median_s": inflate}
        print(f"  (zlib alone inflates the bomb in {inflate:.3f} s on this machine: the floor of one pass)")
    print(f"\nload average: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    if args.json:
        Path(args.json).write_text(json.dumps({"made_by": "benchmarks/resync.py", "figures": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
