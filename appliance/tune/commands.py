"""The handler of `appliance tune` (imports optuna and the training launcher at its top)."""

from __future__ import annotations

from pathlib import Path

from appliance.core.errors import ConfigError
from appliance.core.inputs import require_file
from appliance.core.tomlconfig import read_toml
from appliance.train.config import config_from_dict
from appliance.tune.stage import tune_stage


def tune_command(args) -> int:
    require_file(args.config, "config file")
    raw = read_toml(args.config, "config file")
    if "tune" not in raw:
        raise ConfigError(f"{args.config}: no [tune] section: say what to search, e.g. [tune.space] "
                          '"optimizer.lr" = { low = 1e-4, high = 0.1, log = true }')
    tune = raw.pop("tune")
    cfg = config_from_dict(raw, args.config)  # the training sections, as `appliance train` reads them
    out = Path(args.out) if args.out else cfg.run_dir.parent / f"{cfg.run.name}-tune"
    result = tune_stage(raw, Path(args.config), tune, out, train_files=cfg.data.train, val_files=cfg.data.val,
                        check_report=Path(cfg.data.check_report) if cfg.data.check_report else None,
                        nproc_per_node=args.nproc_per_node, parallel=args.parallel)
    shown = ", ".join(f"{k} = {v:.4g}" if isinstance(v, float) else f"{k} = {v}" for k, v in result.best_params.items())
    print(f"tune {result.out_dir}: best {result.objective} {result.best_value:.4g} ({shown}); "
          f"{', '.join(f'{n} {s}' for s, n in result.counts.items() if n)}; report {result.report_html}; "
          f"train it: appliance train {result.best_config}")
    return 0
