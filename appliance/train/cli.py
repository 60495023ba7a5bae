"""`appliance train CONFIG.toml` and `appliance train slurm CONFIG.toml --nodes N`: thin handlers
over appliance.train.launcher."""

from __future__ import annotations

import argparse
from pathlib import Path

from appliance.core import values
from appliance.train.quality import require_quality, summary_line
from appliance.train.config import load_config
from appliance.train.preflight import run_preflight

PROFILE_STEPS = 10  # `--profile` without a number


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
    try:
        low, high = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be N or MIN:MAX (integers), got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"must be N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return low, high


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
    p.add_argument("--node-rank", type=values.non_negative_int, default=0, help="this machine's rank; rank 0 hosts the rendezvous")
    p.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of node rank 0 (c10d rendezvous)")
    p.add_argument("--resume", default="auto", help="auto (newest good checkpoint), none, or a checkpoint directory")
    p.add_argument("--iface", default="", metavar="NAME",
                   help="network interface to use (e.g. eth1): torchrun binds its address, NCCL and Gloo use it "
                   "(default: [distributed] iface, else the hostname's address; loopback on one node)")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command and exit")
    _add_profile(p)
    p.add_argument("--preflight", action="store_true",
                   help="check this node and agree with the others (endpoint, config, versions, disk) and exit")
    p.add_argument("--preflight-timeout", type=values.positive_float, default=60.0, metavar="S",
                   help="how long --preflight waits for the endpoint and the other nodes (default 60)")
    p.add_argument("--expect-gpus", type=values.non_negative_int, default=None, metavar="N", help="--preflight: GPUs each node must have")
    p.add_argument("--quiet", action="store_true", help="no progress output (results and errors still print)")
    p.set_defaults(func=run)

def slurm_parser() -> argparse.ArgumentParser:
    """`appliance train slurm ...`: its own parser (appliance.cli hands it the rest of the line),
    since `train`'s first argument is a file, not a sub-verb."""
    s = values.OneLineParser(
        prog="appliance train slurm",
        description="Write an sbatch script that runs `appliance train`'s torchrun command on N nodes under srun.")
    s.add_argument("config", metavar="CONFIG.toml", help="the training config")
    s.add_argument("--nodes", type=values.positive_int, required=True, help="number of nodes")
    s.add_argument("--gpus-per-node", type=values.non_negative_int, default=0, help="GPUs per node (0: CPU)")
    s.add_argument("--out", default="", help="script path (default RUN_DIR/train.sbatch)")
    _add_nproc_and_restarts(s)
    _add_profile(s)
    s.set_defaults(func=write_slurm, verb="train", verb_label="train slurm")
    return s


def _add_nproc_and_restarts(p) -> None:
    p.add_argument("--nproc-per-node", default="auto", help="processes per node: N or auto "
                   "(one per GPU; one CPU process without a GPU)")
    p.add_argument("--max-restarts", type=values.non_negative_int, default=0,
                   help="restart all workers this many times after a failure; each restart resumes "
                   "from the newest good checkpoint")


def _add_profile(p) -> None:
    p.add_argument("--profile", type=values.positive_int, nargs="?", const=PROFILE_STEPS, default=None, metavar="STEPS",
                   help=f"profile STEPS optimizer steps (default {PROFILE_STEPS}) after [profile] wait + warmup steps "
                   "and write RUN_DIR/profile.html + profile.json and a trace per rank (default: [profile] steps, 0 = off)")
