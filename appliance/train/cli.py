"""`appliance train CONFIG.toml` and `appliance train slurm CONFIG.toml --nodes N`: thin handlers
over appliance.train.launcher."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from appliance.core import values
from appliance.train.quality import require_quality, summary_line
from appliance.train.config import load_config
from appliance.train.preflight import run_preflight

PROFILE_STEPS = 10  # `--profile` without a number
MAX_NODES = 16384  # far above any on-prem cluster; past it a typo, and torchrun would wait for them all
MAX_RESTARTS = 1000  # each restart resumes from a checkpoint: more is a loop, not resilience


def run(args) -> int:
    from appliance.train.stage import train_stage  # late: torch, at the CLI boundary

    if args.preflight:
        return preflight(args)
    result = train_stage(args.config, nproc_per_node=args.nproc_per_node, nnodes=args.nnodes[1],
                         min_nnodes=args.nnodes[0], node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint,
                         max_restarts=args.max_restarts, resume=args.resume, iface=args.iface, profile=args.profile,
                         dry_run=args.dry_run)
    if isinstance(result, str):
        print(result)
        return 0

    if result.quality is None:
        print(f"run {result.run_dir}: no validation pass recorded ([data] val): quality gate not applied")
        return 0
    require_quality(str(result.run_dir), result.quality)  # GateFailed: exit 3, the same line
    print(summary_line(str(result.run_dir), result.quality))
    return 0


def preflight(args) -> int:
    import sys

    cfg = load_config(args.config)
    problems = run_preflight(cfg, nnodes=args.nnodes[1], node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint,
                             timeout=args.preflight_timeout, expected_gpus=args.expect_gpus)
    for line in problems:
        print(f"appliance train: preflight: {line}", file=sys.stderr)
    if problems:
        return 1
    print(f"preflight: node {args.node_rank} of {args.nnodes[1]} ready ({cfg.source})")
    return 0


def nnodes_range(text: str) -> tuple[int, int]:
    """--nnodes N or MIN:MAX (torchrun's elastic form) as (min, max)."""
    low, _, high = text.partition(":")
    high = high or low
    if not (re.fullmatch(r"[0-9]{1,9}", low) and re.fullmatch(r"[0-9]{1,9}", high)):
        raise argparse.ArgumentTypeError(f"must be N or MIN:MAX (integers), got {values.shown(text)}")
    low, high = int(low), int(high)
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"must be N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    if high > MAX_NODES:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_NODES} nodes, got {text!r}")
    return low, high


def nproc_flag(text: str) -> str:
    """--nproc-per-node N or auto, refused at parse time (it also goes into `train slurm`'s script)."""
    problem = values.nproc_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def write_slurm(args) -> int:
    from appliance.train.launcher import slurm_script  # late: torch, at the CLI boundary

    print(slurm_script(Path(args.config), nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                       nproc_per_node=args.nproc_per_node, max_restarts=args.max_restarts,
                       profile=args.profile, out=Path(args.out) if args.out else None))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="train a model from a TOML config with torchrun (DDP), resumable",
        description="Train with torchrun: `appliance train CONFIG.toml` on this machine, or with "
        "--nnodes/--node-rank/--rdzv-endpoint on several.",
        epilog="`appliance train slurm CONFIG.toml --nodes N` writes an sbatch script instead "
        "(see `appliance train slurm --help`).")
    p.add_argument("config", metavar="CONFIG.toml", help="the training config")
    _add_nproc_and_restarts(p)
    p.add_argument("--nnodes", type=nnodes_range, default=(1, 1), metavar="N|MIN:MAX",
                   help="number of machines (default 1: standalone); MIN:MAX lets a run go on with as few as MIN "
                   "after a node fails, or take back a replacement (with --max-restarts)")
    p.add_argument("--node-rank", type=values.int_in(values.Range(ge=0, le=MAX_NODES - 1), "an integer"), default=0, help="this machine's rank; rank 0 hosts the rendezvous")
    p.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of node rank 0 (c10d rendezvous)")
    p.add_argument("--resume", default="auto", help="auto (newest good checkpoint), none, or a checkpoint directory")
    p.add_argument("--iface", default="", metavar="NAME",
                   help="network interface to use (e.g. eth1): torchrun binds its address, NCCL and Gloo use it "
                   "(default: [distributed] iface, else the hostname's address; loopback on one node)")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command and exit")
    _add_profile(p)
    p.add_argument("--preflight", action="store_true",
                   help="check this node and agree with the others (endpoint, config, versions, disk) and exit")
    p.add_argument("--preflight-timeout", type=values.float_in(values.SECONDS), default=60.0, metavar="S",
                   help="how long --preflight waits for the endpoint and the other nodes (default 60)")
    p.add_argument("--expect-gpus", type=values.int_in(values.Range(ge=0, le=values.MAX_NPROC), "an integer"), default=None, metavar="N", help="--preflight: GPUs each node must have")
    p.add_argument("--quiet", action="store_true", help="no progress output (results and errors still print)")
    p.set_defaults(func=run)

def slurm_parser() -> argparse.ArgumentParser:
    """`appliance train slurm ...`: its own parser (appliance.cli hands it the rest of the line),
    since `train`'s first argument is a file, not a sub-verb."""
    s = values.OneLineParser(
        prog="appliance train slurm",
        description="Write an sbatch script that runs `appliance train`'s torchrun command on N nodes under srun.")
    s.add_argument("config", metavar="CONFIG.toml", help="the training config")
    s.add_argument("--nodes", type=values.int_in(values.Range(ge=1, le=MAX_NODES), "an integer"), required=True,
                   help="number of nodes")
    s.add_argument("--gpus-per-node", type=values.int_in(values.Range(ge=0, le=values.MAX_NPROC), "an integer"), default=0, help="GPUs per node (0: CPU)")
    s.add_argument("--out", type=values.output_file, default=None, help="script path (default RUN_DIR/train.sbatch)")
    _add_nproc_and_restarts(s)
    _add_profile(s)
    s.set_defaults(func=write_slurm, verb="train", verb_label="train slurm")
    return s


def _add_nproc_and_restarts(p) -> None:
    p.add_argument("--nproc-per-node", type=nproc_flag, default="auto", help="processes per node: N or auto "
                   "(one per GPU; one CPU process without a GPU)")
    p.add_argument("--max-restarts", type=values.int_in(values.Range(ge=0, le=MAX_RESTARTS), "an integer"), default=0,
                   help="restart all workers this many times after a failure; each restart resumes "
                   "from the newest good checkpoint")


def _add_profile(p) -> None:
    p.add_argument("--profile", type=values.int_in(values.SMALL_COUNT_AT_LEAST_ONE, "an integer"), nargs="?", const=PROFILE_STEPS, default=None, metavar="STEPS",
                   help=f"profile STEPS optimizer steps (default {PROFILE_STEPS}) after [profile] wait + warmup steps "
                   "and write RUN_DIR/profile.html + profile.json and a trace per rank (default: [profile] steps, 0 = off)")
