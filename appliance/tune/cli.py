"""`appliance tune CONFIG.toml`: a training config with a [tune] section (docs/tune.md)."""

from __future__ import annotations

from appliance.core import values
from appliance.train.cli import nproc_flag

MAX_PARALLEL = 1024


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "tune", help="search hyperparameters ([tune] section): each trial a real training run, resumable",
        description="Run an Optuna study (TPE, median or successive-halving pruning, journal file storage) over "
        "the keys of [tune.space]; each trial trains with `appliance train` in OUT/trials/NNNN. Killed, the same "
        "command continues the study. Writes OUT/report.html + report.json and OUT/best.toml, a config "
        "`appliance train` reproduces the best trial with.")
    p.add_argument("config", metavar="CONFIG.toml", help="a training config with a [tune] section")
    p.add_argument("--out", type=values.output_dir, default=None, metavar="DIR",
                   help="the study's directory (default: [run] out_dir/<[run] name>-tune)")
    p.add_argument("--parallel", type=values.int_in(values.Range(ge=1, le=MAX_PARALLEL), "an integer"), default=1,
                   metavar="K", help="trials at once, each on a share of the GPUs (CPU: of the cores); default 1")
    p.add_argument("--nproc-per-node", type=nproc_flag, default="auto",
                   help="processes per trial: N or auto (its share of the GPUs; one CPU process without a GPU)")
    p.add_argument("--quiet", action="store_true", help="no progress output (the trials' lines; results and errors still print)")
    p.set_defaults(func="appliance.tune.commands:tune_command")
