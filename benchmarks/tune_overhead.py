"""The tuner's overhead per trial against the trials' own training time.

Two measurements on one small config (8x8 images, small_cnn, CPU, 2 epochs):

1. Rounds alternating a plain `appliance train` of the config (a fresh run directory) with
   `appliance tune` of one trial whose space holds only that config's learning rate: the same
   training run, launched by the tuner. Ratio tune/train per round; the median is printed.
2. One study of --trials trials: from its report.json, the seconds between one trial's run exiting
   and the next one's launch (the tuner's own work: record the outcome, sample, write the config)
   against each trial's training seconds.

    .venv/bin/python benchmarks/tune_overhead.py [--rounds 3] [--trials 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "train"))

from train_data import make_config  # noqa: E402

APPLIANCE = str(Path(sys.executable).parent / "appliance")


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode not in (0, 3):
        sys.exit(f"{' '.join(cmd)} failed: {proc.stderr[-2000:]}")
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tune-bench-"))
    train = dict(train={"epochs": 2, "batch_size": 16}, optimizer={"name": "sgd", "lr": 0.1})
    base = make_config(tmp, name="bench", train_records=96, val_records=33, **train).read_text()
    rows = []
    for r in range(args.rounds):
        plain = tmp / f"plain{r}.toml"
        plain.write_text(base.replace('name = "bench"', f'name = "plain{r}"'))
        one = tmp / f"one{r}.toml"
        one.write_text(base.replace('name = "bench"', f'name = "one{r}"') +
                       '\n[tune]\ntrials = 1\n[tune.space]\n"optimizer.lr" = { choices = [0.1] }\n')
        order = [("train", [APPLIANCE, "train", str(plain), "--quiet"]), ("tune", [APPLIANCE, "tune", str(one), "--quiet"])]
        if r % 2:
            order.reverse()  # alternate which runs first
        seconds = {name: timed(cmd) for name, cmd in order}
        rows.append({**seconds, "ratio": seconds["tune"] / seconds["train"]})
        print(f"round {r}: train {seconds['train']:.1f} s, one-trial tune {seconds['tune']:.1f} s, "
              f"ratio {rows[-1]['ratio']:.3f}", flush=True)
    study = tmp / "study.toml"
    study.write_text(base.replace('name = "bench"', 'name = "study"') +
                     f'\n[tune]\ntrials = {args.trials}\npruner = "none"\n[tune.space]\n'
                     '"optimizer.lr" = { low = 0.01, high = 0.5, log = true }\n')
    wall = timed([APPLIANCE, "tune", str(study), "--quiet"])
    report = json.loads((tmp / "runs" / "study-tune" / "report.json").read_text())
    gaps = report["overhead"]["between_trials_s"]
    training = [t["training_seconds"] for t in report["trials"]]
    result = {"rounds": rows, "median_ratio_one_trial_tune_over_train": statistics.median(r["ratio"] for r in rows),
              "study_wall_s": wall, "between_trials_s": gaps, "median_between_trials_s": statistics.median(gaps),
              "trial_training_s": training, "median_trial_training_s": statistics.median(training),
              "study_overhead_s": wall - sum(training)}
    print(f"one-trial tune / plain train, median of {len(rows)} rounds: {result['median_ratio_one_trial_tune_over_train']:.3f}")
    print(f"study of {args.trials} trials: {wall:.1f} s; between trials median {result['median_between_trials_s']:.2f} s "
          f"({', '.join(f'{g:.2f}' for g in gaps)}); trial training median {result['median_trial_training_s']:.1f} s; "
          f"outside the trials' runs {result['study_overhead_s']:.1f} s in all")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
