"""`appliance train CONFIG.toml`, `appliance train slurm CONFIG.toml --nodes N` and `appliance train
k8s CONFIG.toml --nodes N --image REF`: thin handlers over appliance.train.launcher and .k8s."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

from appliance.core import values
from appliance.train.quality import require_quality, summary_line
from appliance.train.config import load_config
from appliance.train import k8s_resources as q
from appliance.train.k8s import K8sSpec, write_manifests
from appliance.train.k8s_resources import PodResources
from appliance.train.preflight import run_preflight

PROFILE_STEPS = 10  # `--profile` without a number
MAX_NODES = 16384  # far above any on-prem cluster; past it a typo, and torchrun would wait for them all
MAX_RESTARTS = 1000  # each restart resumes from a checkpoint: more is a loop, not resilience


def run(args) -> int:
    from appliance.train.stage import train_command_line, train_stage  # late: torch, at the CLI boundary

    if args.preflight:
        return preflight(args)
    launch = dict(nproc_per_node=args.nproc_per_node, nnodes=args.nnodes[1], min_nnodes=args.nnodes[0],
                  node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint, max_restarts=args.max_restarts,
                  resume=args.resume, iface=args.iface, profile=args.profile)
    if args.dry_run:
        print(train_command_line(args.config, **launch))
        return 0
    result = train_stage(args.config, **launch)

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


def write_k8s(args) -> int:
    resources = PodResources(gpus=args.gpus_per_node, processes=1, cpu_request=args.cpu_request,
                             cpu_limit=args.cpu_limit, memory_request=args.memory_request,
                             memory_limit=args.memory_limit, shm_size=args.shm_size)
    spec = K8sSpec(config=Path(args.config), nodes=args.nodes, image=args.image, out=Path(args.out),
                   gpus_per_node=args.gpus_per_node, kind=args.kind, name=args.name,
                   nproc_per_node=args.nproc_per_node, max_restarts=args.max_restarts, resources=resources,
                   data_pvc=args.data_pvc, data_host_path=args.data_host_path, data_dir=args.data_dir,
                   run_storage=args.run_storage, storage_class=args.storage_class,
                   grace_seconds=args.termination_grace, runtime=args.runtime)
    print(write_manifests(spec, "appliance train k8s " + shlex.join(getattr(args, "argv", [args.config]))))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="train a model from a TOML config with torchrun (DDP), resumable",
        description="Train with torchrun: `appliance train CONFIG.toml` on this machine, or with "
        "--nnodes/--node-rank/--rdzv-endpoint on several.",
        epilog="`appliance train slurm CONFIG.toml --nodes N` writes an sbatch script instead "
        "(see `appliance train slurm --help`); `appliance train k8s CONFIG.toml --nodes N --image REF@sha256:...` "
        "writes Kubernetes manifests (see `appliance train k8s --help`).")
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


def k8s_parser() -> argparse.ArgumentParser:
    """`appliance train k8s ...`: Kubernetes manifests for one multi-node run (appliance/train/k8s.py)."""
    k = values.OneLineParser(
        prog="appliance train k8s",
        description="Write Kubernetes manifests (headless Service + StatefulSet, indexed Job or Kubeflow TrainJob) "
        "whose pods run `appliance train` on N nodes; resources are per GPU (per process without a GPU).")
    k.add_argument("config", metavar="CONFIG.toml", help="the training config")
    k.add_argument("--nodes", type=values.int_in(values.Range(ge=1, le=MAX_NODES), "an integer"), required=True,
                   help="number of pods (nodes)")
    k.add_argument("--gpus-per-node", type=values.int_in(values.Range(ge=0, le=1024), "an integer"), default=0,
                   help="GPUs per pod (nvidia.com/gpu; 0: CPU processes with gloo)")
    k.add_argument("--image", required=True, metavar="REF@sha256:DIGEST", help="the appliance image, pinned by digest")
    k.add_argument("--out", type=values.output_dir, required=True, help="directory for the manifests and README.md")
    k.add_argument("--kind", choices=("statefulset", "indexed-job", "trainjob"), default="statefulset",
                   help="the workload (default statefulset, podManagementPolicy Parallel)")
    k.add_argument("--name", default="", help="object and pod name prefix (default: [run] name as a DNS label)")
    k.add_argument("--data-pvc", default="", metavar="CLAIM", help="the data volume: a PersistentVolumeClaim")
    k.add_argument("--data-host-path", default="", metavar="DIR", help="the data volume: a directory on every node")
    k.add_argument("--data-dir", default="", metavar="DIR", help="where the pods mount the data (default: the "
                   "directory holding the config's data files, so its paths mean the same in the pod)")
    k.add_argument("--cpu-request", default=q.CPU_REQUEST, help=f"per GPU (default {q.CPU_REQUEST})")
    k.add_argument("--cpu-limit", default=q.CPU_LIMIT, help=f"per GPU (default {q.CPU_LIMIT})")
    k.add_argument("--memory-request", default=q.MEMORY_REQUEST, help=f"per GPU (default {q.MEMORY_REQUEST})")
    k.add_argument("--memory-limit", default=q.MEMORY_LIMIT, help=f"per GPU (default {q.MEMORY_LIMIT})")
    k.add_argument("--shm-size", default="8Gi", help="memory-backed /dev/shm per pod (default 8Gi)")
    k.add_argument("--run-storage", default="50Gi", help="each node's run-directory volume (default 50Gi)")
    k.add_argument("--storage-class", default="", help="storage class of the run-directory claims")
    k.add_argument("--termination-grace", type=values.int_in(values.Range(ge=30, le=86400), "an integer"),
                   default=600, metavar="S", help="seconds a deleted pod has to save its last checkpoint (default 600)")
    k.add_argument("--runtime", default="torch-distributed", help="--kind trainjob: the ClusterTrainingRuntime")
    k.add_argument("--nproc-per-node", type=nproc_flag, default="auto", help="processes per pod: N or auto "
                   "(one per GPU; one CPU process without a GPU)")
    k.add_argument("--max-restarts", type=values.int_in(values.Range(ge=0, le=MAX_RESTARTS), "an integer"), default=3,
                   help="torchrun restarts per pod, each from the newest good checkpoint; an indexed Job's "
                   "backoffLimit too (default 3: a lost pod comes back and the others wait for it)")
    k.set_defaults(func=write_k8s, verb="train", verb_label="train k8s")
    return k


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
