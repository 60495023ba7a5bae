"""benchmarks/gpu_check.py's shared helpers, run in its check processes: the product's commands, a
logged run of one, the synthetic TFRecords and training configs, and a run's step figures."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DISTINCT_IMAGES = 1024  # per file written by write_data
TRAIN_RECORDS_MAX = 8192  # the train check's data: one epoch of its steps (a restart of the loader per epoch is not what it measures)
NUM_CLASSES = 10

def appliance_cmd(*args: str) -> list[str]:
    """`appliance ...` as a user types it: the venv's console script, else `python -m appliance`."""
    script = Path(sys.executable).parent / "appliance"
    return [str(script), *args] if script.exists() else [sys.executable, "-m", "appliance", *args]


def child_env(**extra: str) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            **extra}


def run_logged(cmd: list[str], log: Path, timeout: float, env=None, cwd=None) -> subprocess.CompletedProcess:
    """Run cmd in its own session (a timeout kills torchrun and its workers too); output kept in log."""
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or child_env(),
                            cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=max(1, timeout))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n(killed after {timeout:.0f} s)"
        proc.returncode = 124
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{out}{err}\n(exit {proc.returncode})\n\n")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def last_line(proc: subprocess.CompletedProcess) -> str:
    """The line that says what went wrong: an `error:` line, else the last non-empty one."""
    lines = [x.strip() for x in (proc.stderr + "\n" + proc.stdout).splitlines() if x.strip()]
    errors = [x for x in lines if "error" in x.lower() and not x.startswith("$")]
    return (errors or lines or [f"exit status {proc.returncode}"])[-1][:300]


def write_data(root: Path, size: int, train_records: int = 1024, val_records: int = 128) -> Path:
    """Learnable synthetic JPEG TFRecords: class c is a bright square in cell c of a 4x3 grid on a
    smooth random background. Two train shards and one val file, made once per image size and count;
    beyond DISTINCT_IMAGES per file the examples repeat (decoding costs the same, writing much less)."""
    import numpy as np
    from PIL import Image

    from data_tools.example import encode_example
    from data_tools.tfrecord import write_records

    out = root / f"data-{size}-{train_records}"
    if (out / "done").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)

    def examples(n: int, seed: int):
        rng = np.random.default_rng(seed)
        cell = size // 4
        made = []
        for i in range(n):
            if len(made) == DISTINCT_IMAGES:
                yield made[i % DISTINCT_IMAGES]
                continue
            label = int(rng.integers(0, NUM_CLASSES))
            small = rng.integers(0, 110, (8, 8, 3), dtype=np.uint8)
            img = np.asarray(Image.fromarray(small).resize((size, size), Image.BILINEAR)).copy()
            r, c = divmod(label, 4)
            img[r * cell + cell // 4:r * cell + 3 * cell // 4, c * cell + cell // 4:c * cell + 3 * cell // 4,
                label % 3] = 230
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="JPEG", quality=90)
            made.append(encode_example({"image/encoded": buf.getvalue(), "image/format": b"jpeg",
                                        "image/class/label": label}))
            yield made[-1]

    half = train_records // 2
    write_records(out / "train-0.tfrecord", examples(half, 1))
    write_records(out / "train-1.tfrecord", examples(train_records - half, 2))
    write_records(out / "val.tfrecord", examples(val_records, 3))
    (out / "done").write_text("")
    return out


def write_config(work: Path, name: str, data: Path, *, arch: str, precision: str, steps: int, batch: int,
                 size: int, deterministic: bool, workers: int, every: int = 100000, val: bool = False,
                 compile_mode: str = "auto") -> Path:
    text = f"""# written by benchmarks/gpu_check.py
[run]
name = "{name}"
out_dir = "{work / 'runs'}"
seed = 7
deterministic = {str(deterministic).lower()}
log_every = 10
[data]
train = ["{data}/train-*.tfrecord"]
val = [{f'"{data}/val.tfrecord"' if val else ''}]
num_classes = {NUM_CLASSES}
image_size = {size}
num_workers = {workers}
[model]
architecture = "{arch}"
[optimizer]
name = "adamw"
lr = 0.001
[train]
max_steps = {steps}
batch_size = {batch}
precision = "{precision}"
grad_clip = 1.0
compile = "{compile_mode}"
[checkpoint]
every_steps = {every}
keep_last = 2
keep_best = 0
min_free_gb = 0.0
"""
    path = work / "configs" / f"{name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def run_figures(run_dir: Path, warmup: int, batch: int, world: int = 1) -> dict:
    """Step rate after warmup (total steps / total time), peak memory and data wait from metrics.jsonl."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [x for x in lines if "samples_per_s" in x and x["step"] > warmup] or \
              [x for x in lines if "samples_per_s" in x]
    per_step = batch * world
    rate = len(windows) / sum(per_step / w["samples_per_s"] for w in windows)
    return {"steps_per_s": rate, "images_per_s": rate * per_step,
            "peak_memory_mb": max(w.get("peak_memory_mb", 0) for w in windows),
            "data_wait_pct": sum(w["data_wait_pct"] for w in windows) / len(windows),
            "windows": len(windows), "final_loss": windows[-1].get("loss")}

