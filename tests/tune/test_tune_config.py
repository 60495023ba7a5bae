"""Bad [tune] sections: one line naming the file and the key, before any trial trains; the pipeline's
[pipeline] tune = true puts the tune stage before train and trains the best trial's values."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))

from appliance.cli import main  # noqa: E402
from appliance.core.errors import ConfigError  # noqa: E402
from appliance.pipeline.config import load_pipeline_config  # noqa: E402
from appliance.pipeline.plan import Results, TrainStage, plan  # noqa: E402
from appliance.tune.space import parse_tune  # noqa: E402
from appliance.tune.stage import TuneResult  # noqa: E402
from train_data import make_config  # noqa: E402

LR = '"optimizer.lr" = { low = 1e-3, high = 1.0, log = true }'


@pytest.fixture(scope="module")
def training(tmp_path_factory) -> Path:
    return make_config(tmp_path_factory.mktemp("data"), train_records=12, val_records=6)


@pytest.mark.parametrize("tune, message", [
    (f"[tune]\ntrials = 0\n[tune.space]\n{LR}", "[tune] trials must be a budget of at least 1 trial, got 0"),
    (f"[tune]\nmax_minutes = -5\n[tune.space]\n{LR}", "[tune] max_minutes must be a number of minutes"),
    (f"[tune]\nbudget = 3\n[tune.space]\n{LR}", "[tune] unknown key 'budget'"),
    (f"[tune]\nsampler = 'grid'\n[tune.space]\n{LR}", "[tune] sampler must be tpe, random"),
    (f"[tune]\npruner = 'hyperband'\n[tune.space]\n{LR}", "[tune] pruner must be median, successive-halving, none"),
    (f"[tune]\nobjective = 'val_miou'\n[tune.space]\n{LR}", "[tune] objective must be val_acc or val_loss"),
    ("[tune]\ntrials = 3\n", "[tune.space] is missing or empty"),
    ('[tune.space]\n"optimizer.lrr" = { low = 0.1, high = 1.0 }', "[tune.space] optimizer.lrr: unknown key of the training config"),
    ('[tune.space]\n"optimiser.lr" = { low = 0.1, high = 1.0 }', "[tune.space] optimiser.lr: unknown key of the training config (known sections"),
    ('[tune.space]\n"optimizer.lr" = { low = 0.1, high = 0.1 }', "[tune.space] optimizer.lr: an empty range (low 0.1 must be below high 0.1)"),
    ('[tune.space]\n"train.batch_size" = { low = 64, high = 8 }', "[tune.space] train.batch_size: an empty range"),
    ('[tune.space]\n"optimizer.lr" = { choices = [] }', "[tune.space] optimizer.lr choices: an empty space"),
    ('[tune.space]\n"optimizer.weight_decay" = { low = 0.0, high = 0.1, log = true }',
     "[tune.space] optimizer.weight_decay: a log range must not reach zero or below"),
    ('[tune.space]\n"optimizer.lr" = { low = -1.0, high = 1.0 }',
     "[tune.space] optimizer.lr: the value -1.0 is refused by the training config: [optimizer] lr must be greater than 0"),
    ('[tune.space]\n"model.architecture" = { choices = ["small_cnn", "resnet9000"] }',
     "[tune.space] model.architecture: the value 'resnet9000' is refused by the training config"),
    ('[tune.space]\n"train.batch_size" = { low = 8, high = 32.5 }', "[tune.space] train.batch_size high must be an integer"),
    ('[tune.space]\n"run.out_dir" = { choices = ["a", "b"] }', "[tune.space] run.out_dir: not searchable"),
    ('[tune.space]\n"optimizer.betas" = { choices = [[0.9, 0.99]] }', "[tune.space] optimizer.betas: not searchable"),
    ('[tune.space]\n"augment.enabled" = { low = 0, high = 1 }', "augment.enabled is true/false: give choices"),
    ('[tune.space]\n"optimizer.lr" = { low = 0.1, high = 1.0, spread = 2 }', "[tune.space] optimizer.lr: unknown key 'spread'"),
])
def test_a_bad_tune_section_is_one_line_naming_the_key(training, tmp_path, capsys, tune, message):
    config = tmp_path / "tune.toml"
    config.write_text(training.read_text().replace('"data/', f'"{training.parent}/data/') + "\n" + tune + "\n")
    assert main(["tune", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"appliance tune: error: {config}: "), err
    assert message in err[0], err[0]
    assert not (tmp_path / "runs").exists()  # refused before any trial directory


def test_a_good_space_parses_with_kinds_from_the_training_config(training):
    import tomllib

    raw = tomllib.loads(training.read_text())
    spec = parse_tune({"space": {"optimizer.lr": {"low": 1e-4, "high": 0.1, "log": True},
                                 "train.batch_size": {"low": 8, "high": 32, "step": 8},
                                 "augment.degrees": {"low": 0, "high": 30},  # a float key given integers
                                 "augment.enabled": {"choices": [True, False]}}}, raw, training)
    kinds = {p.key: (p.kind, p.low, p.high) for p in spec.params}
    assert kinds["optimizer.lr"] == ("float", 1e-4, 0.1) and kinds["train.batch_size"] == ("int", 8, 32)
    assert kinds["augment.degrees"] == ("float", 0.0, 30.0) and kinds["augment.enabled"][0] == "choice"
    assert (spec.objective, spec.direction) == ("val_acc", "maximize")
    loss = parse_tune({"objective": "val_loss", "space": {"optimizer.lr": {"low": 0.1, "high": 1.0}}}, raw, training)
    assert loss.direction == "minimize"
    seg = parse_tune({"space": {"optimizer.lr": {"low": 0.1, "high": 1.0}}}, {**raw, "task": {"kind": "segmentation"},
                                                                                          "model": {"architecture": "unet_small"}},
                     training)
    assert seg.objective == "val_miou"  # the task's metric, by name
    unnamed = {k: v for k, v in raw.items() if k != "run"}  # a pipeline config may leave [run] out
    assert parse_tune({"space": {"optimizer.lr": {"low": 0.1, "high": 1.0}}}, unnamed, training).params


def _pipeline(tmp_path: Path, training: Path, extra: str) -> Path:
    text = training.read_text().replace('"data/', f'"{training.parent}/data/')
    path = tmp_path / "pipeline.toml"
    path.write_text(text + "\n" + extra + "\n")
    return path


def test_the_pipeline_plans_tune_before_train_and_trains_the_best_values(training, tmp_path):
    cfg = load_pipeline_config(_pipeline(tmp_path, training, f"[pipeline]\ntune = true\n[tune]\ntrials = 2\n[tune.space]\n{LR}"))
    names = [s.name for s in plan(cfg)]
    assert names.index("tune") == names.index("train") - 1
    assert "tune" not in [s.name for s in plan(load_pipeline_config(_pipeline(tmp_path, training, "")))]
    best = tmp_path / "best.toml"
    best.write_text("")
    result = TuneResult(out_dir=tmp_path, report_json=tmp_path / "report.json", report_html=tmp_path / "report.html",
                        best_config=best, best_params={"optimizer.lr": 0.0123}, best_value=0.9, objective="val_acc",
                        counts={"complete": 2})
    tuned = result.tuned(cfg.training)
    assert tuned["optimizer"]["lr"] == 0.0123 and cfg.training["optimizer"]["lr"] == 0.003
    train = next(s for s in plan(cfg) if isinstance(s, TrainStage))
    assert best in train.inputs(Results(cfg, tune=result))  # a new best reruns train


@pytest.mark.parametrize("extra, message", [
    ("[pipeline]\ntune = true\n", "[pipeline] tune = true needs a [tune] section"),
    ('[pipeline]\ntune = true\n[tune]\n[tune.space]\n"optimizer.lr" = { low = 1.0, high = 0.5 }',
     "[tune.space] optimizer.lr: an empty range"),
])
def test_the_pipeline_refuses_a_bad_tune_section_at_load(training, tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        load_pipeline_config(_pipeline(tmp_path, training, extra))
