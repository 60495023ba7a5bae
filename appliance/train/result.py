"""The train stage's typed result: what a finished run left in its run directory (model, checkpoints,
metrics.jsonl, manifest) and its last validation's figures, read back from those files."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from appliance.core.manifest import MANIFEST_NAME, read_manifest
from appliance.core.stage import Figures, flat_figures
from appliance.tasks import task_for


@dataclass(frozen=True)
class TrainResult:
    """What a finished training run produced: its directories and its final validation figures."""

    run_dir: Path
    model_dir: Path
    checkpoints_dir: Path
    metrics_path: Path
    manifest_path: Path
    steps: int
    val_acc: float | None  # top-1 on the validation set at the last evaluation (None without [data] val)
    val_loss: float | None
    val_confusion: tuple | None = None  # [true][predicted] counts at the last evaluation
    class_names: tuple[str, ...] = ()
    quality: dict | None = None  # the quality gate's figures (appliance.train.quality), once judged
    task: dict | None = None  # the model card's [task] (None: classification)

    def judged(self, thresholds) -> "TrainResult":
        """This result with the quality gate's figures for thresholds (a Thresholds); quality stays
        None without a validation pass that recorded its confusion counts."""
        if self.val_confusion is None:
            return self
        return replace(self, quality=task_for(self.task).quality(self.val_confusion, self.class_names, thresholds))

    @property
    def out_dir(self) -> Path:
        return self.run_dir

    def figures(self) -> Figures:
        """The run's directories and steps, its last validation under its task's names (classification:
        val_acc, its top-1; segmentation: val_miou, val_pixel_acc) and the model card's task."""
        task = task_for(self.task)
        return {"run_dir": str(self.run_dir), "model_dir": str(self.model_dir), "steps": self.steps,
                **task.train_figures(self.val_acc, self.val_confusion, self.class_names),
                **flat_figures(self.task or {}, "task.")}

    @classmethod
    def load(cls, out_dir: Path) -> "TrainResult":
        """The result of a finished run in out_dir (its run directory): the StageResult contract."""
        return cls.from_run_dir(out_dir)

    @classmethod
    def from_run_dir(cls, run_dir: Path) -> "TrainResult":
        run_dir = Path(run_dir)
        metrics_path = run_dir / METRICS_NAME
        evals = []
        if metrics_path.is_file():
            for line in metrics_path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill mid-write
                if isinstance(record, dict) and "val_loss" in record:  # every task's evaluation (detection has no val_acc)
                    evals.append(record)
        last = evals[-1] if evals else {}
        confusion = last.get("val_confusion")
        try:
            card = json.loads((run_dir / MODEL_DIR_NAME / "model.json").read_text())
            names, task = card.get("class_names", []), card.get("extra", {}).get("task")
        except (OSError, ValueError, AttributeError):
            names, task = [], None
        return cls(run_dir=run_dir, model_dir=run_dir / MODEL_DIR_NAME, checkpoints_dir=run_dir / "checkpoints",
                   metrics_path=metrics_path, manifest_path=run_dir / MANIFEST_NAME,
                   steps=int(read_manifest(run_dir)["params"].get("steps", 0)),
                   val_acc=last.get("val_acc"), val_loss=last.get("val_loss"),
                   val_confusion=tuple(map(tuple, confusion)) if isinstance(confusion, list) else None,
                   class_names=tuple(map(str, names or ())), task=task if isinstance(task, dict) else None)


METRICS_NAME = "metrics.jsonl"
MODEL_DIR_NAME = "model"
